"""Healthy: float16 compute over float32 params with a dynamic loss scale (unscaled by the step
before the norm and the clipping), clipped at a global norm of 5.0."""
import jax.numpy as jnp
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


step = fg.make_train_step(
    fg.mixed_precision(loss, jnp.float16, loss_scale=fg.dynamic_loss_scale()),
    optax.chain(fg.clip_by_global_norm(5.0), optax.adam(1e-3)))


EXPECT = None
