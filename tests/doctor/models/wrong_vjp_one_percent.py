"""Fault: a wrong custom_vjp: a hand-written smooth activation ('soft_clip' = tanh) whose backward
rule is 1% too large (a constant left over from tuning)."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


@jax.custom_vjp
def soft_clip(x):
    return jnp.tanh(x)


def _soft_clip_fwd(x):
    y = jnp.tanh(x)
    return y, y


def _soft_clip_bwd(y, g):
    return (g * (1.0 - y * y) * 1.01,)


soft_clip.defvjp(_soft_clip_fwd, _soft_clip_bwd)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) / 8.0, "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = soft_clip(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "wrong_custom_vjp", "checks": {"fd_audit"}, "place": "soft_clip"}
