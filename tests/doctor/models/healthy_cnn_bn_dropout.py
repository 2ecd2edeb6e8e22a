"""Healthy: funcgrad's CNN (conv -> BatchNorm -> ReLU -> max-pool, dropout before the head) on
the 8x8 digits, with running statistics as model state and a dropout key per step."""
import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.cnn_init(key, channels=(8, 16))      # (params, model_state)


def _loss(params, batch, *, model_state, key):
    logits, model_state = fg.cnn_apply(params, model_state, batch["x"], train=True, key=key)
    return fg.softmax_cross_entropy(logits, batch["y"]), model_state


loss = fg.Loss(_loss, has_state=True, takes_key=True)

EXPECT = None
