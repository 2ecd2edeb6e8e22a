"""Fault: a where with a NaN branch: a 'safe' distance feature jnp.where(d2 > 0, sqrt(d2), 0)
whose unused branch still differentiates sqrt at negative d2 (the gradient is NaN, though the
forward value is fine)."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(1 / 64), "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    d2 = batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"]
    h = jnp.where(d2 > 0, jnp.sqrt(d2), 0.0)
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "where_nan", "checks": {"nonfinite"}, "place": "where_sqrt_branch.py:22"}
