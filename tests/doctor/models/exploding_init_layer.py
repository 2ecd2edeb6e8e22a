"""Fault: exploding init in one layer: the 'mixer' weight is drawn with std 30 (a typo for
0.30), so the logits are in the thousands at init."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"embed": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64), "b": jnp.zeros(32)},
            "mixer": {"w": jax.random.normal(k2, (32, 32)) * 30.0, "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k3, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["embed"]["w"] + params["embed"]["b"])
    h = jax.nn.relu(h @ params["mixer"]["w"] + params["mixer"]["b"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "exploding_init", "checks": {"init_loss", "grad_stats", "training"},
          "place": "mixer"}
