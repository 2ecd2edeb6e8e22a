"""Fault: vanishing gradients: a 12-layer sigmoid MLP (width 32, Glorot init); the first
layers get ~1e-7 of the gradient while the loss is high."""
import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64,) + (32,) * 12 + (10,), activation="sigmoid")


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


EXPECT = {"fault": "vanishing_sigmoid", "checks": {"grad_stats", "training", "grad_flow"},
          "place": "[0]"}
