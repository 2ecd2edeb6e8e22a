"""Fault: exploding init: an 8-layer ReLU MLP initialised with standard-normal weights (no
1/sqrt(fan_in) scale), so activations and logits grow ~sqrt(64/2)x per layer."""
import jax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
SIZES = (64, 64, 64, 64, 64, 64, 64, 64, 10)


def init(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    return [{"w": jax.random.normal(k, (a, b)), "b": jax.numpy.zeros(b)}
            for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])]


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


EXPECT = {"fault": "exploding_init", "checks": {"init_loss", "grad_stats", "training"},
          "place": None}
