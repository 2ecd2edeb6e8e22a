"""Fault: a where with a NaN branch: the hidden features h = tanh(x @ w + b) are normalised per
example, guarded by where(norm > 0, h / norm, 0); a row whose hidden units are all zero (the
data's blank padding rows) gives 0/0 in the unused branch and NaN gradients."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
_x = _d.x_train[:512].copy()
_x[::16] = 0.0                                   # blank padding rows
data = {"x": _x, "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(1 / 64), "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    norm = jnp.linalg.norm(h, axis=1, keepdims=True)
    h = jnp.where(norm > 0, h / norm, 0.0) * 4.0
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "where_nan", "checks": {"nonfinite"}, "place": "where_divide_branch.py:25"}
