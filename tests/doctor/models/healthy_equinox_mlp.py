"""Healthy: an equinox MLP (eqx.nn.MLP, 64 -> 48 -> 48 -> 10, ReLU), called per example."""
import equinox as eqx
import jax

import funcgrad as fg
from funcgrad.interop import from_equinox

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10

model = from_equinox(eqx.nn.MLP(64, 10, 48, 2, activation=jax.nn.relu, key=jax.random.key(0)))


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = None
