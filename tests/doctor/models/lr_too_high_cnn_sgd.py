"""Fault: a learning rate far too high: SGD with momentum 0.9 at lr 10 on funcgrad's CNN with
BatchNorm."""
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
optimizer = optax.sgd(10.0, momentum=0.9)


def init(key):
    return fg.cnn_init(key, channels=(8, 16))


def _loss(params, batch, *, model_state, key):
    logits, model_state = fg.cnn_apply(params, model_state, batch["x"], train=True, key=key)
    return fg.softmax_cross_entropy(logits, batch["y"]), model_state


loss = fg.Loss(_loss, has_state=True, takes_key=True)

EXPECT = {"fault": "lr_too_high", "checks": {"training", "overfit"}, "place": None}
