"""Healthy: a regression MLP (8 -> 32 -> 1, tanh) on a smooth synthetic target, mean squared
error. No classes."""
import numpy as np

import funcgrad as fg

_rng = np.random.default_rng(0)
_x = _rng.normal(size=(512, 8)).astype(np.float32)
_y = (np.sin(_x[:, 0]) + 0.5 * _x[:, 1] * _x[:, 2] - 0.3 * _x[:, 3]
      + 0.05 * _rng.normal(size=512)).astype(np.float32)
data = {"x": _x, "y": _y}


def init(key):
    return fg.mlp_init(key, (8, 32, 1), activation="tanh")


def loss(params, batch):
    pred = fg.mlp_apply(params, batch["x"])[:, 0]
    return fg.mean_squared_error(pred, batch["y"])


EXPECT = None
