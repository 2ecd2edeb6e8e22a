"""Fault: BatchNorm statistics never updated: a flax linen MLP with nn.BatchNorm(momentum=1.0)
(flax's momentum is the decay of the running average: 1.0 keeps the init forever)."""
import flax.linen as nn
import jax
import jax.numpy as jnp

import funcgrad as fg
from funcgrad.interop import from_linen


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(64, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=1.0, name="bn_hidden")(x)
        return nn.Dense(10)(nn.relu(x))


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512] * 2.0 + 0.5, "y": _d.y_train[:512]}
classes = 10

_module = MLP()
model = from_linen(_module, _module.init(jax.random.key(0), jnp.zeros((2, 64)), train=False),
                   rngs=())


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "bn_stats_frozen", "checks": {"semantics", "training"}, "place": "bn_hidden"}
