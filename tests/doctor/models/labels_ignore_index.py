"""Fault: labels out of range: PyTorch's ignore_index habit: 5% of the labels are -100 ('no
label') and the loss (optax's integer-label cross-entropy) has no notion of ignoring them."""
import numpy as np
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
_label = _d.y_train[:512].copy()
_label[np.random.default_rng(0).choice(512, size=26, replace=False)] = -100
data = {"x": _d.x_train[:512], "label": _label}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    logits = fg.mlp_apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


EXPECT = {"fault": "bad_labels", "checks": {"data", "init_loss", "nonfinite"}, "place": "label"}
