"""Fault: a learning rate far too high: Adam at 1.0 (meant 1e-3) on the digits MLP."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
optimizer = optax.adam(1.0)


def init(key):
    return fg.mlp_init(key, (64, 64, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


EXPECT = {"fault": "lr_too_high", "checks": {"training", "overfit"}, "place": None}
