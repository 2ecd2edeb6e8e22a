"""Healthy: fine-tuning with the first layer frozen through the step's trainable mask (its
leaves get no gradient and no update, by design)."""
import jax
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10

_params = fg.mlp_init(jax.random.key(0), (64, 64, 32, 10))


def init(key):
    return fg.mlp_init(key, (64, 64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


step = fg.make_train_step(loss, optax.adam(1e-3),
                         trainable=fg.trainable_mask(_params, freeze="0/*"))


EXPECT = None
