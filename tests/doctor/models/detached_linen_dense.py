"""Fault: a flax linen MLP whose hidden Dense kernel is read through stop_gradient inside the
module (a custom layer written to 'share' a kernel), so Dense 'encoder' never trains."""
import flax.linen as nn
import jax
import jax.numpy as jnp

import funcgrad as fg
from funcgrad.interop import from_linen


class SharedDense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        return x @ jax.lax.stop_gradient(kernel) + bias


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(SharedDense(32, name="encoder")(x))
        return nn.Dense(10, name="classifier")(x)


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10

_module = MLP()
model = from_linen(_module, _module.init(jax.random.key(0), jnp.zeros((1, 64))), rngs=())


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "detached_weight", "checks": {"grad_flow"}, "place": "['encoder']['kernel']"}
