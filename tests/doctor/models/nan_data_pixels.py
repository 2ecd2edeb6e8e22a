"""Fault: NaN in the data: a few missing pixel values were read as NaN and never imputed."""
import numpy as np

import funcgrad as fg

_d = fg.load_digits(seed=0)
_pixels = _d.x_train[:512].copy()
_pixels[[17, 230, 401], [5, 33, 60]] = np.nan
data = {"pixels": _pixels, "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["pixels"]), batch["y"])


EXPECT = {"fault": "nan_data", "checks": {"data", "nonfinite"}, "place": "pixels"}
