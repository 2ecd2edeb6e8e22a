"""Fault: an unused parameter: the model declares an input bias ('shift') that the forward pass
never adds (the line that used it was refactored away)."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"shift": jnp.zeros(64),
            "hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    x = batch["x"]
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "unused_param", "checks": {"grad_flow"}, "place": "shift"}
