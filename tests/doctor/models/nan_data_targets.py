"""Fault: NaN in the data: a regression target column with missing values (NaN) for 2% of rows."""
import numpy as np

import funcgrad as fg

_rng = np.random.default_rng(0)
_x = _rng.normal(size=(512, 8)).astype(np.float32)
_target = (_x[:, 0] - 0.5 * _x[:, 1] ** 2).astype(np.float32)
_target[_rng.choice(512, size=10, replace=False)] = np.nan
data = {"x": _x, "target": _target}


def init(key):
    return fg.mlp_init(key, (8, 32, 1), activation="tanh")


def loss(params, batch):
    return fg.mean_squared_error(fg.mlp_apply(params, batch["x"])[:, 0], batch["target"])


EXPECT = {"fault": "nan_data", "checks": {"data", "nonfinite"}, "place": "target"}
