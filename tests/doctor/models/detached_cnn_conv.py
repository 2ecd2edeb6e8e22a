"""Fault: a CNN whose second convolution kernel is detached (a 'frozen feature extractor' done
with stop_gradient on the wrong block)."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512].reshape(-1, 8, 8, 1), "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"conv_a": jax.random.normal(k1, (3, 3, 1, 8)) * jnp.sqrt(2 / 9),
            "conv_b": jax.random.normal(k2, (3, 3, 8, 16)) * jnp.sqrt(2 / 72),
            "dense": {"w": jax.random.normal(k3, (16 * 4 * 4, 10)) / 16.0, "b": jnp.zeros(10)}}


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def loss(params, batch):
    x = jax.nn.relu(_conv(batch["x"], params["conv_a"]))
    x = jax.nn.relu(_conv(x, jax.lax.stop_gradient(params["conv_b"])))
    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    logits = x.reshape(x.shape[0], -1) @ params["dense"]["w"] + params["dense"]["b"]
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "detached_weight", "checks": {"grad_flow"}, "place": "conv_b"}
