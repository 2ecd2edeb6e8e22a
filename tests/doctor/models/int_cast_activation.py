"""Fault: an integer cast in the forward pass: the hidden activations are 'quantised' with
astype(int32) and back to float (simulated 8-bit inference left on in training), so no gradient
reaches the first layer."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"quant_layer": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64),
                            "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["quant_layer"]["w"] + params["quant_layer"]["b"])
    h = (h * 16).astype(jnp.int32).astype(jnp.float32) / 16
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "int_cast", "checks": {"grad_flow"}, "place": "quant_layer"}
