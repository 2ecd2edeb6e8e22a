"""Fault: clipping before unscaling: the loss is scaled by hand by 1024 (a static loss scale
for float16 habits), the step clips the global norm at 1.0 and the unscaling happens later, in
the optimizer chain; every step is clipped to a tiny update."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
SCALE = 1024.0
optimizer = optax.chain(optax.scale(1 / SCALE), optax.sgd(0.1))


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return SCALE * fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


step = fg.make_train_step(loss, optax.chain(fg.clip_by_global_norm(1.0), optimizer))


EXPECT = {"fault": "clip_before_unscale",
          "checks": {"semantics", "grad_stats", "training", "init_loss", "overfit"},
          "place": None}
