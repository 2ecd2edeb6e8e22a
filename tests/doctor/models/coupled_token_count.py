"""Fault: a batch-coupled loss accumulated: a sequence model's per-example loss is its sum of
token losses divided by the count of valid tokens in the whole batch (the usual normalisation,
but under accumulate=4 each micro-batch divides by its own count)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import funcgrad as fg

VOCAB, LENGTH, D = 10, 12, 32
classes = VOCAB
_rng = np.random.default_rng(0)
_x = _rng.integers(0, VOCAB, size=(512, LENGTH)).astype(np.int32)
_lengths = _rng.integers(2, LENGTH + 1, size=512)
_mask = (np.arange(LENGTH)[None, :] < _lengths[:, None]).astype(np.float32)
data = {"x": _x, "y": np.concatenate([_x[:, :1], _x[:, :-1]], axis=1), "mask": _mask}


def init(key):
    k = jax.random.split(key, 4)
    return {"embed": jax.random.normal(k[0], (VOCAB, D)) * 0.1,
            "prev": jax.random.normal(k[1], (D, D)) / jnp.sqrt(D),
            "self": jax.random.normal(k[2], (D, D)) / jnp.sqrt(D),
            "head": jax.random.normal(k[3], (D, VOCAB)) / jnp.sqrt(D)}


def loss(params, batch):
    e = params["embed"][batch["x"]]
    shifted = jnp.concatenate([e[:, :1], e[:, :-1]], axis=1)
    h = jnp.tanh(shifted @ params["prev"] + e @ params["self"])
    token_loss = optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], batch["y"])
    n_valid = jnp.sum(batch["mask"])
    return jnp.sum(token_loss * batch["mask"], axis=1) / n_valid * batch["x"].shape[0]


step = fg.make_train_step(fg.accumulate(loss, 4), optax.adam(1e-3))


EXPECT = {"fault": "batch_coupled_accum", "checks": {"semantics"}, "place": None}
