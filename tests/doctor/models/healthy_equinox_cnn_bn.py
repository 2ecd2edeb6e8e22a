"""Healthy: an equinox CNN with eqx.nn.BatchNorm (its State) and dropout."""
import equinox as eqx
import jax

import funcgrad as fg
from funcgrad.interop import from_equinox


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    pool: eqx.nn.AvgPool2d
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="ema")
        self.dropout = eqx.nn.Dropout(0.1)
        self.pool = eqx.nn.AvgPool2d(2, 2)
        self.out = eqx.nn.Linear(8 * 4 * 4, 10, key=k2)

    def __call__(self, x, state, *, key=None):
        x, state = self.bn(self.conv(x), state)
        x = self.pool(self.dropout(jax.nn.relu(x), key=key))
        return self.out(x.reshape(-1)), state


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512].reshape(-1, 1, 8, 8), "y": _d.y_train[:512]}
classes = 10

model = from_equinox(*eqx.nn.make_with_state(CNN)(jax.random.key(0)))


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = None
