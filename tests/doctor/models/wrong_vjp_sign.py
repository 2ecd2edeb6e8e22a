"""Fault: a wrong custom_vjp with the wrong sign: a numerically 'stable' softplus whose backward
rule returns -sigmoid(x) * g."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


@jax.custom_vjp
def stable_softplus(x):
    return jnp.logaddexp(x, 0.0)


def _fwd(x):
    return stable_softplus(x), x


def _bwd(x, g):
    return (-g * jax.nn.sigmoid(x),)


stable_softplus.defvjp(_fwd, _bwd)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) / 8.0, "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = stable_softplus(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "wrong_custom_vjp", "checks": {"fd_audit"}, "place": "stable_softplus"}
