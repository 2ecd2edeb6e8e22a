"""Fault: labels out of range: an 'other' class (label 10) was added to the data for 10% of the
rows, but the head still has 10 outputs (classes = 10)."""
import numpy as np

import funcgrad as fg

_d = fg.load_digits(seed=0)
_target = _d.y_train[:512].copy()
_target[np.random.default_rng(0).random(512) < 0.1] = 10
data = {"x": _d.x_train[:512], "target": _target}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["target"])


EXPECT = {"fault": "bad_labels", "checks": {"data", "init_loss", "nonfinite"}, "place": "target"}
