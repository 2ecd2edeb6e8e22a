"""Fault: a constant input: a sequence model whose token inputs are all the padding id 0 (the
tokenised column was overwritten by the padding mask), while the labels vary."""
import jax
import jax.numpy as jnp
import numpy as np

import funcgrad as fg

VOCAB, LENGTH, D = 10, 12, 32
classes = VOCAB
_rng = np.random.default_rng(0)
_tokens = _rng.integers(0, VOCAB, size=(512, LENGTH)).astype(np.int32)
data = {"tokens": np.zeros_like(_tokens), "y": np.concatenate([_tokens[:, :1], _tokens[:, :-1]], 1)}


def init(key):
    k = jax.random.split(key, 3)
    return {"embed": jax.random.normal(k[0], (VOCAB, D)) * 0.1,
            "mix": jax.random.normal(k[1], (2 * D, D)) / jnp.sqrt(2 * D),
            "head": jax.random.normal(k[2], (D, VOCAB)) / jnp.sqrt(D)}


def loss(params, batch):
    e = params["embed"][batch["tokens"]]
    prev = jnp.concatenate([e[:, :1], e[:, :-1]], axis=1)
    h = jnp.tanh(jnp.concatenate([e, prev], axis=-1) @ params["mix"])
    logits = h @ params["head"]
    return fg.softmax_cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))


EXPECT = {"fault": "constant_input", "checks": {"data", "baseline"}, "place": "tokens"}
