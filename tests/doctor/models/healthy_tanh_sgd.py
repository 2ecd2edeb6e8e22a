"""Healthy: a 3-hidden-layer tanh MLP (Glorot init) trained with SGD + momentum 0.9, lr 0.05."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
optimizer = optax.sgd(0.05, momentum=0.9)


def init(key):
    return fg.mlp_init(key, (64, 48, 48, 48, 10), activation="tanh")


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


EXPECT = None
