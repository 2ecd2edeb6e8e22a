"""Fault: an equinox MLP with a learned output temperature field that __call__ forgets to apply."""
import equinox as eqx
import jax
import jax.numpy as jnp

import funcgrad as fg
from funcgrad.interop import from_equinox


class Net(eqx.Module):
    body: eqx.nn.MLP
    temperature: jax.Array

    def __init__(self, key):
        self.body = eqx.nn.MLP(64, 10, 32, 1, activation=jax.nn.relu, key=key)
        self.temperature = jnp.ones(())

    def __call__(self, x):
        return self.body(x)


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10

model = from_equinox(Net(jax.random.key(0)))


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "unused_param", "checks": {"grad_flow"}, "place": "temperature"}
