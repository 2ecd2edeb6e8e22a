"""Fault: BatchNorm statistics never updated: the loss runs funcgrad's CNN in training mode but
returns the model state it was given instead of the new one, so the running mean and variance
stay at their init (0 and 1) and evaluation normalises with the wrong statistics."""
import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.cnn_init(key, channels=(8, 16))


def _loss(params, batch, *, model_state, key):
    logits, new_state = fg.cnn_apply(params, model_state, batch["x"], train=True, key=key)
    return fg.softmax_cross_entropy(logits, batch["y"]), model_state


loss = fg.Loss(_loss, has_state=True, takes_key=True)

EXPECT = {"fault": "bn_stats_frozen", "checks": {"semantics", "training"}, "place": "bn"}
