"""Fault: a wrong custom_vjp in a fused RMS norm: the backward rule forgets the term through the
normaliser (treats rsqrt(mean(x^2)) as a constant), an error of a few percent on the input's
gradient."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


@jax.custom_vjp
def fused_rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _fwd(x, scale):
    r = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x * r * scale, (x, r, scale)


def _bwd(res, g):
    x, r, scale = res
    return g * scale * r, jnp.sum(g * x * r, axis=0)


fused_rms_norm.defvjp(_fwd, _bwd)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "b": jnp.zeros(32)},
            "norm": {"scale": jnp.ones(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"]
    h = jax.nn.relu(fused_rms_norm(h, params["norm"]["scale"]))
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "wrong_custom_vjp", "checks": {"fd_audit"}, "place": "fused_rms_norm"}
