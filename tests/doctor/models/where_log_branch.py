"""Fault: a where with a NaN branch: log-magnitude features of learned per-pixel gains,
where(u != 0, log|u|, 0) with u = gain * x; the blank border pixels (x == 0 exactly) make the
unused branch log(0), and its gradient 0 * inf = NaN reaches the gains."""
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return {"gain": jnp.ones(64), "mlp": fg.mlp_init(key, (128, 32, 10))}


def loss(params, batch):
    u = params["gain"] * batch["x"]
    log_mag = jnp.where(u != 0, jnp.log(jnp.abs(u)), 0.0)
    x = jnp.concatenate([u, log_mag], axis=1)
    return fg.softmax_cross_entropy(fg.mlp_apply(params["mlp"], x), batch["y"])


EXPECT = {"fault": "where_nan", "checks": {"nonfinite"}, "place": "where_log_branch.py:19"}
