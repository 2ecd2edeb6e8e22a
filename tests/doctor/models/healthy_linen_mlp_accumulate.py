"""Healthy: a flax linen MLP with LayerNorm, trained with AdamW and accumulate=2 on one loss per
example."""
import flax.linen as nn
import jax
import optax

import funcgrad as fg
from funcgrad.interop import from_linen


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.LayerNorm()(nn.Dense(64)(x)))
        return nn.Dense(10)(x)


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
optimizer = optax.adamw(1e-3, weight_decay=1e-4)

_module = MLP()
model = from_linen(_module, _module.init(jax.random.key(0), data["x"][:2]), rngs=())


def objective(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


step = fg.make_train_step(fg.accumulate(model.loss(objective, train=True), 2), optimizer)


EXPECT = None
