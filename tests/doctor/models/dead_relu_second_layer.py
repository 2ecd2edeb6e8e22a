"""Fault: dead-ReLU init in the second of three hidden layers (bias -10 after a LayerNorm-free
stack), made with funcgrad's mlp_init and one overwritten bias."""
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    params = fg.mlp_init(key, (64, 64, 64, 32, 10))
    params[1]["b"] = jnp.full(64, -10.0)
    return params


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


EXPECT = {"fault": "dead_relu", "checks": {"grad_flow", "grad_stats"}, "place": "[1]"}
