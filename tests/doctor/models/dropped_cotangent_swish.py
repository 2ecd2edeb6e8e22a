"""Fault: a dropped cotangent: a learnable-beta swish (x * sigmoid(beta * x)) with a custom_vjp
that returns zeros for beta, so 'swish_beta' never moves."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


@jax.custom_vjp
def swish(x, beta):
    return x * jax.nn.sigmoid(beta * x)


def _fwd(x, beta):
    return swish(x, beta), (x, beta)


def _bwd(res, g):
    x, beta = res
    s = jax.nn.sigmoid(beta * x)
    return g * (s + beta * x * s * (1 - s)), jnp.zeros_like(beta)


swish.defvjp(_fwd, _bwd)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "b": jnp.zeros(32)},
            "swish_beta": jnp.ones(32),
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = swish(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"], params["swish_beta"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "dropped_cotangent", "checks": {"fd_audit", "grad_flow"},
          "place": "swish_beta"}
