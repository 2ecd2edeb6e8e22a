"""Fault: log of a softmax that underflows: the loss is written as log(softmax(logits / T)) with
a sharp temperature T = 0.01, so wrong-class probabilities underflow to 0 and log gives -inf
(log_softmax would not)."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10
TEMPERATURE = 0.01


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    logits = fg.mlp_apply(params, batch["x"]) / TEMPERATURE
    log_probs = jnp.log(jax.nn.softmax(logits, axis=-1))
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=-1))


EXPECT = {"fault": "log_softmax_underflow", "checks": {"nonfinite"},
          "place": "log_softmax_temperature.py:21"}
