"""Healthy: an MLP whose loss returns aux outputs (accuracy and the logits' scale)."""
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 64, 10))


def _loss(params, batch):
    logits = fg.mlp_apply(params, batch["x"])
    value = fg.softmax_cross_entropy(logits, batch["y"])
    return value, {"accuracy": fg.accuracy(logits, batch["y"]),
                   "logit_std": jnp.std(logits)}


loss = fg.Loss(_loss, has_aux=True)

EXPECT = None
