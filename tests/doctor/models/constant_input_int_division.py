"""Fault: a constant input: raw 0..16 pixels scaled with integer division (x // 17) instead of
x / 16, so every feature is 0 for every example."""
import numpy as np
from sklearn.datasets import load_digits

import funcgrad as fg

_x, _y = load_digits(return_X_y=True)
_x = _x[:512].astype(np.int64)
data = {"pixels": (_x // 17).astype(np.float32), "y": _y[:512].astype(np.int32)}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["pixels"]), batch["y"])


EXPECT = {"fault": "constant_input", "checks": {"data", "baseline"}, "place": "pixels"}
