"""Fault: a where with a NaN branch: log-features of ReLU outputs guarded by where(h > 0,
log(h), 0); at h == 0 (every dead unit) the unused branch's gradient is 0 * inf = NaN."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    feats = jnp.where(h > 0, jnp.log1p(h) + jnp.log(h), 0.0)
    return fg.softmax_cross_entropy(feats @ params["readout"]["w"] + params["readout"]["b"],
                                    batch["y"])


EXPECT = {"fault": "where_nan", "checks": {"nonfinite"}, "place": "where_log_branch.py:21"}
