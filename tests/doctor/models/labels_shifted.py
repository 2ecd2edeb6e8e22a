"""Fault: labels shifted to 1..K: the labels were converted from a 1-based file format
(label = digit + 1) but the model has K = 10 outputs for 0..9."""
import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "label": _d.y_train[:512] + 1}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["label"])


EXPECT = {"fault": "bad_labels", "checks": {"data", "init_loss", "nonfinite"}, "place": "label"}
