"""Fault: a learning rate far too high: plain SGD at 5.0 on a regression MLP (the loss
oscillates and blows up)."""
import numpy as np
import optax

import funcgrad as fg

_rng = np.random.default_rng(0)
_x = _rng.normal(size=(512, 8)).astype(np.float32)
_y = (np.sin(_x[:, 0]) + 0.5 * _x[:, 1] * _x[:, 2]).astype(np.float32)
data = {"x": _x, "y": _y}
optimizer = optax.sgd(5.0)


def init(key):
    return fg.mlp_init(key, (8, 64, 64, 1))


def loss(params, batch):
    return fg.mean_squared_error(fg.mlp_apply(params, batch["x"])[:, 0], batch["y"])


EXPECT = {"fault": "lr_too_high", "checks": {"training", "overfit"}, "place": None}
