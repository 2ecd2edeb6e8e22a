"""Fault: a batch-coupled loss accumulated: a regression loss on targets centred by the batch's
own mean of the predictions ('remove the offset'), trained with accumulate=4."""
import numpy as np
import optax

import funcgrad as fg

_rng = np.random.default_rng(0)
_x = _rng.normal(size=(512, 8)).astype(np.float32)
_y = (np.sin(_x[:, 0]) + 0.5 * _x[:, 1]).astype(np.float32)
data = {"x": _x, "y": _y}


def init(key):
    return fg.mlp_init(key, (8, 32, 1), activation="tanh")


def loss(params, batch):
    pred = fg.mlp_apply(params, batch["x"])[:, 0]
    pred = pred - pred.mean() + batch["y"].mean()
    return (pred - batch["y"]) ** 2


step = fg.make_train_step(fg.accumulate(loss, 4), optax.adam(1e-3))


EXPECT = {"fault": "batch_coupled_accum", "checks": {"semantics"}, "place": None}
