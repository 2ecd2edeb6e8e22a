"""Fault: frozen layers still updated: the 'backbone' is frozen by zeroing its gradients
(optax.masked(set_to_zero)) in front of AdamW, whose decoupled weight decay still shrinks the
backbone's weights every step."""
import jax
import jax.numpy as jnp
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"backbone": {"w": jax.random.normal(k1, (64, 32)) * jnp.sqrt(2 / 64),
                         "b": jnp.zeros(32)},
            "head": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


_frozen = {"backbone": {"w": True, "b": True}, "head": {"w": False, "b": False}}
optimizer = optax.chain(optax.masked(optax.set_to_zero(), _frozen),
                        optax.adamw(1e-3, weight_decay=0.1))


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["backbone"]["w"] + params["backbone"]["b"])
    return fg.softmax_cross_entropy(h @ params["head"]["w"] + params["head"]["b"], batch["y"])


EXPECT = {"fault": "frozen_updated", "checks": {"semantics"}, "place": "backbone"}
