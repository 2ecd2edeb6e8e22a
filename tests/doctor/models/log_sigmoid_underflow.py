"""Fault: log of a probability that underflows: a binary classifier ('is it a 0 digit?') whose
loss is -log(sigmoid(z)) written literally; for confident wrong logits (|z| > ~90 in float32)
sigmoid underflows to 0 and the loss is inf (jax.nn.log_sigmoid would not). The logits are
large because the inputs are not standardised (raw 0..16 pixels)."""
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

_x, _y = load_digits(return_X_y=True)
data = {"x": _x[:512].astype(np.float32), "y": (_y[:512] == 0).astype(np.float32)}


def init(key):
    return {"w": jax.random.normal(key, (64,)) * 2.0, "b": jnp.zeros(())}


def loss(params, batch):
    z = batch["x"] @ params["w"] + params["b"]
    p = jax.nn.sigmoid(z)
    nll = -(batch["y"] * jnp.log(p) + (1 - batch["y"]) * jnp.log(1 - p))
    return jnp.mean(nll)


EXPECT = {"fault": "log_softmax_underflow", "checks": {"nonfinite"},
          "place": "log_sigmoid_underflow.py:21"}
