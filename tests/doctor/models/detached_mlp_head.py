"""Fault: the output layer's weight is detached (stop_gradient left over from a debugging
session), so it never trains; only its bias and the hidden layer learn."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    w = jax.lax.stop_gradient(params["readout"]["w"])
    logits = h @ w + params["readout"]["b"]
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "detached_weight", "checks": {"grad_flow"}, "place": "['readout']['w']"}
