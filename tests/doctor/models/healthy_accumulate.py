"""Healthy: gradient accumulation over 4 micro-batches with a per-example loss (returned
undivided, as make_train_step's accumulate expects)."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):                      # shape (m,): one loss per example
    logits = fg.mlp_apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


step = fg.make_train_step(fg.accumulate(loss, 4), optax.adam(1e-3))


EXPECT = None
