"""Fault: exploding init in a CNN without normalisation: conv kernels drawn with std 2 (no fan-in
scaling), three conv layers deep."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512].reshape(-1, 8, 8, 1), "y": _d.y_train[:512]}
classes = 10


def init(key):
    k = jax.random.split(key, 4)
    return {"conv1": jax.random.normal(k[0], (3, 3, 1, 16)) * 2.0,
            "conv2": jax.random.normal(k[1], (3, 3, 16, 16)) * 2.0,
            "conv3": jax.random.normal(k[2], (3, 3, 16, 16)) * 2.0,
            "dense": {"w": jax.random.normal(k[3], (16, 10)) / 4.0, "b": jnp.zeros(10)}}


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def loss(params, batch):
    x = batch["x"]
    for name in ("conv1", "conv2", "conv3"):
        x = jax.nn.relu(_conv(x, params[name]))
    logits = x.mean(axis=(1, 2)) @ params["dense"]["w"] + params["dense"]["b"]
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "exploding_init", "checks": {"init_loss", "grad_stats", "training"},
          "place": None}
