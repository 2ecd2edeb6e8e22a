"""Fault: clipping before unscaling: a hand-made loss scale of 4096 with the optimizer chain
clip_by_global_norm(1.0) -> scale(1/4096) -> sgd: the clip sees the scaled gradients."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
LOSS_SCALE = 4096.0
optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.scale(1 / LOSS_SCALE),
                        optax.sgd(0.1, momentum=0.9))


def init(key):
    return fg.mlp_init(key, (64, 64, 10))


def loss(params, batch):
    logits = fg.mlp_apply(params, batch["x"])
    return fg.softmax_cross_entropy(logits, batch["y"]) * LOSS_SCALE


EXPECT = {"fault": "clip_before_unscale",
          "checks": {"semantics", "grad_stats", "training", "init_loss", "overfit"},
          "place": None}
