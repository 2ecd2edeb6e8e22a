"""Fault: a constant input: a data-pipeline bug repeats the first image for every example
(np.broadcast_to of one row), so the inputs carry no information about the labels."""
import numpy as np

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"image": np.broadcast_to(_d.x_train[0], (512, 64)).copy(), "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["image"]), batch["y"])


EXPECT = {"fault": "constant_input", "checks": {"data", "baseline"}, "place": "image"}
