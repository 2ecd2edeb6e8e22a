"""The model ``funcgrad doctor`` examines without a model file: the 64 -> 128 -> 10 ReLU MLP
on scikit-learn's digits that ``funcgrad train`` trains by default. It is also a model file:
``funcgrad doctor funcgrad/doctor/digits_mlp.py`` runs the same checks."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_digits = fg.load_digits(seed=0)
data = {"x": _digits.x_train, "y": _digits.y_train}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 128, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


@jax.jit
def evaluate(params):
    return {"test_accuracy": fg.accuracy(fg.mlp_apply(params, jnp.asarray(_digits.x_test)),
                                         jnp.asarray(_digits.y_test))}
