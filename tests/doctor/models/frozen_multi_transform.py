"""Fault: frozen layers still updated: optax.multi_transform sends the 'encoder' to a 'frozen'
group that zeroes its gradient and then adds weight decay (meant as 'keep it regularised'),
which moves the frozen encoder by -1e-2 * w every step."""
import jax
import jax.numpy as jnp
import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"encoder": {"w": jax.random.normal(k1, (64, 48)) * jnp.sqrt(2 / 64),
                        "b": jnp.zeros(48)},
            "decoder": {"w": jax.random.normal(k2, (48, 10)) / jnp.sqrt(48), "b": jnp.zeros(10)}}


_labels = {"encoder": {"w": "frozen", "b": "frozen"}, "decoder": {"w": "train", "b": "train"}}
optimizer = optax.multi_transform(
    {"train": optax.adam(1e-3),
     "frozen": optax.chain(optax.set_to_zero(), optax.add_decayed_weights(1e-2))}, _labels)


def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["encoder"]["w"] + params["encoder"]["b"])
    return fg.softmax_cross_entropy(h @ params["decoder"]["w"] + params["decoder"]["b"], batch["y"])


EXPECT = {"fault": "frozen_updated", "checks": {"semantics"}, "place": "encoder"}
