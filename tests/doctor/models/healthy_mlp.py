"""Healthy: the digits MLP (64 -> 32 -> 10, ReLU, He init), Adam 1e-3."""

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def evaluate(params):
    return {"accuracy": fg.accuracy(fg.mlp_apply(params, _d.x_test), _d.y_test)}


EXPECT = None
