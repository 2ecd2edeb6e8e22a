"""Fault: a dropped cotangent: a custom_vjp matmul (written for memory) returns zeros for the
weight, so the hidden layer's weight 'proj_w' never trains."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


@jax.custom_vjp
def lean_matmul(x, w):
    return x @ w


def _fwd(x, w):
    return x @ w, (x, w)


def _bwd(res, g):
    x, w = res
    return g @ w.T, jnp.zeros_like(w)


lean_matmul.defvjp(_fwd, _bwd)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"proj_w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "proj_b": jnp.zeros(32),
            "out_w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "out_b": jnp.zeros(10)}


def loss(params, batch):
    h = jax.nn.relu(lean_matmul(batch["x"], params["proj_w"]) + params["proj_b"])
    return fg.softmax_cross_entropy(h @ params["out_w"] + params["out_b"], batch["y"])


EXPECT = {"fault": "dropped_cotangent", "checks": {"fd_audit", "grad_flow"}, "place": "proj_w"}
