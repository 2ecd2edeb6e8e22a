"""Fault: sum instead of mean in accumulation: the loss accumulates by hand over 4 micro-batches
of the batch (to save memory) and adds up their mean losses instead of averaging them, so the
loss and the gradient are 4x the mean."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
MICRO = 4


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    xs = batch["x"].reshape(MICRO, -1, batch["x"].shape[-1])
    ys = batch["y"].reshape(MICRO, -1)
    losses = jax.lax.map(lambda xy: fg.softmax_cross_entropy(fg.mlp_apply(params, xy[0]), xy[1]),
                         (xs, ys))
    return jnp.sum(losses)


EXPECT = {"fault": "sum_not_mean", "checks": {"init_loss", "semantics", "grad_stats"},
          "place": None}
