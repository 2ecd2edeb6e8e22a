"""Fault: vanishing gradients: a hand-written 10-layer sigmoid stack ('layer0'...'layer9') with
small (std 0.1) weights, followed by a linear readout."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
DEPTH, WIDTH = 10, 24


def init(key):
    keys = jax.random.split(key, DEPTH + 1)
    params = {}
    n_in = 64
    for i in range(DEPTH):
        params[f"layer{i}"] = {"w": jax.random.normal(keys[i], (n_in, WIDTH)) * 0.1,
                               "b": jnp.zeros(WIDTH)}
        n_in = WIDTH
    params["readout"] = {"w": jax.random.normal(keys[-1], (WIDTH, 10)) * 0.1, "b": jnp.zeros(10)}
    return params


def loss(params, batch):
    h = batch["x"]
    for i in range(DEPTH):
        h = jax.nn.sigmoid(h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"])
    logits = h @ params["readout"]["w"] + params["readout"]["b"]
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "vanishing_sigmoid", "checks": {"grad_stats", "training", "grad_flow"},
          "place": "layer0"}
