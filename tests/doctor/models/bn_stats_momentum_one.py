"""Fault: BatchNorm statistics never updated: a hand-written BatchNorm with momentum 1.0 (the
running average keeps 100% of the old value: PyTorch's momentum=0.0 or a decay typo), so the
running statistics never leave their init."""
import jax
import jax.numpy as jnp

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512] * 3.0 + 1.0, "y": _d.y_train[:512]}
classes = 10
MOMENTUM = 1.0


def init(key):
    k1, k2 = jax.random.split(key)
    params = {"dense1": {"w": jax.random.normal(k1, (64, 64)) * jnp.sqrt(2 / 64)},
              "norm1": {"scale": jnp.ones(64), "bias": jnp.zeros(64)},
              "dense2": {"w": jax.random.normal(k2, (64, 10)) / 8.0, "b": jnp.zeros(10)}}
    state = {"norm1": {"mean": jnp.zeros(64), "var": jnp.ones(64)}}
    return params, state


def _batch_norm(p, s, x):
    mean, var = x.mean(0), x.var(0)
    new = {"mean": MOMENTUM * s["mean"] + (1 - MOMENTUM) * mean,
           "var": MOMENTUM * s["var"] + (1 - MOMENTUM) * var}
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"], new


def _loss(params, batch, *, model_state):
    h, bn = _batch_norm(params["norm1"], model_state["norm1"], batch["x"] @ params["dense1"]["w"])
    logits = jax.nn.relu(h) @ params["dense2"]["w"] + params["dense2"]["b"]
    return fg.softmax_cross_entropy(logits, batch["y"]), {"norm1": bn}


loss = fg.Loss(_loss, has_state=True)

EXPECT = {"fault": "bn_stats_frozen", "checks": {"semantics", "training"}, "place": "norm1"}
