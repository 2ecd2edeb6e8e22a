"""Fault: an integer cast in the forward pass: the embedding table of a token model is cast to
int8 'to save memory' before the lookup, so the embeddings never train."""
import jax
import jax.numpy as jnp
import numpy as np

import funcgrad as fg

VOCAB, LENGTH, D = 10, 12, 32
classes = VOCAB
_rng = np.random.default_rng(0)
_x = _rng.integers(0, VOCAB, size=(512, LENGTH)).astype(np.int32)
data = {"x": _x, "y": np.concatenate([_x[:, :1], _x[:, :-1]], axis=1)}


def init(key):
    k = jax.random.split(key, 3)
    return {"token_table": jax.random.normal(k[0], (VOCAB, D)) * 4.0,
            "mix": jax.random.normal(k[1], (2 * D, D)) / jnp.sqrt(2 * D),
            "head": jax.random.normal(k[2], (D, VOCAB)) / jnp.sqrt(D)}


def loss(params, batch):
    table = params["token_table"].astype(jnp.int8).astype(jnp.float32)
    e = table[batch["x"]] / 4.0
    prev = jnp.concatenate([e[:, :1], e[:, :-1]], axis=1)
    h = jnp.tanh(jnp.concatenate([e, prev], axis=-1) @ params["mix"])
    logits = h @ params["head"]
    return fg.softmax_cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))


EXPECT = {"fault": "int_cast", "checks": {"grad_flow"}, "place": "token_table"}
