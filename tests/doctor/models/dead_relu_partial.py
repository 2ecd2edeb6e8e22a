"""Fault: dead-ReLU init on most units: a bias of -12 on 90% of the 'trunk' layer's units (a
'sparsity' init), so 58 of 64 units never fire on the data."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    bias = jnp.where(jnp.arange(64) < 58, -12.0, 0.0)
    return {"trunk": {"w": jax.random.normal(k1, (64, 64)) * jnp.sqrt(2 / 64), "b": bias},
            "readout": {"w": jax.random.normal(k2, (64, 10)) / 8.0, "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["trunk"]["w"] + params["trunk"]["b"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "dead_relu", "checks": {"grad_flow", "grad_stats"}, "place": "trunk"}
