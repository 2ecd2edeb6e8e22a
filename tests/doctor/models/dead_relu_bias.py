"""Fault: dead-ReLU init: the hidden layer's bias is initialised to -10 (meant as a 'sparse
start'), every hidden unit is negative for every standardised input, and only the output bias
can learn."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 64)) * jnp.sqrt(2 / 64),
                       "b": jnp.full(64, -10.0)},
            "readout": {"w": jax.random.normal(k2, (64, 10)) / 8.0, "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "dead_relu", "checks": {"grad_flow", "grad_stats"}, "place": "hidden"}
