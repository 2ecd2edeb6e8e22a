"""Fault: an integer cast in the forward pass: a learned 'gate' picks how many of the hidden
units to keep via int(gate * 32) (a count used as a mask bound), so the gate gets no gradient."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "b": jnp.zeros(32)},
            "keep_gate": jnp.array(0.75),
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    keep = (params["keep_gate"] * 32).astype(jnp.int32)
    h = h * (jnp.arange(32) < keep)
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "int_cast", "checks": {"grad_flow"}, "place": "keep_gate"}
