"""Healthy: multinomial logistic regression (one dense layer, zero init) with a small L2
penalty, on a data function that yields shuffled batches of 64 each epoch."""
import jax.numpy as jnp
import numpy as np

import funcgrad as fg

_d = fg.load_digits(seed=0)
_x, _y = _d.x_train[:512], _d.y_train[:512]
classes = 10


def data(epoch):
    order = np.random.default_rng(epoch).permutation(len(_x))
    for i in range(0, len(_x), 64):
        rows = order[i:i + 64]
        yield {"x": _x[rows], "y": _y[rows]}


def init(key):
    return {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}


def loss(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return fg.softmax_cross_entropy(logits, batch["y"]) + 1e-4 * jnp.sum(params["w"] ** 2)


EXPECT = None
