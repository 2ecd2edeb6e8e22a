"""Healthy: a flax linen CNN with BatchNorm and dropout (the interop guide's model)."""
import flax.linen as nn
import jax

import funcgrad as fg
from funcgrad.interop import from_linen


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512].reshape(-1, 8, 8, 1), "y": _d.y_train[:512]}
classes = 10

_module = CNN()
model = from_linen(_module, _module.init(jax.random.key(0), data["x"][:2], train=False))


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = None
