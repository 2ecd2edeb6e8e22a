"""Fault: a batch-coupled loss accumulated: the per-example losses are divided by the batch's own
standard deviation of the logits ('adaptive loss scaling'), and the model trains with
accumulate=4, so each micro-batch uses its own statistic and the accumulated gradient is not the
full-batch gradient."""
import jax.numpy as jnp
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    return fg.mlp_init(key, (64, 32, 10))


def loss(params, batch):
    logits = fg.mlp_apply(params, batch["x"])
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return per_example / (jnp.std(logits) + 1e-3)


step = fg.make_train_step(fg.accumulate(loss, 4), optax.adam(1e-3))


EXPECT = {"fault": "batch_coupled_accum", "checks": {"semantics"}, "place": None}
