"""Fault: sum instead of mean in accumulation: under accumulate=4 the per-example loss is
multiplied by the micro-batch size (the author 'undid' a mean they expected the step to take
per micro-batch), so every update is m times the mean gradient."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
optimizer = optax.sgd(0.05)


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    logits = fg.mlp_apply(params, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses * batch["y"].shape[0]


step = fg.make_train_step(fg.accumulate(loss, 4), optimizer)


EXPECT = {"fault": "sum_not_mean", "checks": {"init_loss", "semantics", "grad_stats"},
          "place": None}
