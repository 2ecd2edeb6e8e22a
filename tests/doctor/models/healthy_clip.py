"""Healthy: global-norm clipping at 5.0 (about the 90th percentile of this model's gradient
norms in its first epochs), Adam 1e-3."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


step = fg.make_train_step(loss, optax.chain(fg.clip_by_global_norm(5.0), optax.adam(1e-3)))


EXPECT = None
