"""Small hand-made models for the doctor's tests: an 8 -> 16 -> 3 tanh MLP on 96 synthetic
examples whose class is the argmax of three fixed projections of the input (learnable)."""
import jax
import jax.numpy as jnp
import numpy as np

import funcgrad as fg

K = 3


def data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(8, K)), axis=1).astype(np.int32)
    return {"x": x, "y": y}


def params(seed=0):
    return fg.mlp_init(jax.random.key(seed), (8, 16, K), activation="tanh")


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"], activation="tanh"),
                                    batch["y"])


def per_example(params, batch):
    import optax
    logits = fg.mlp_apply(params, batch["x"], activation="tanh")
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def mean_logits_loss(params, batch):
    """Coupled through the batch: each example's logits are centred on the batch mean."""
    logits = fg.mlp_apply(params, batch["x"], activation="tanh")
    centred = logits - jnp.mean(logits, axis=0, keepdims=True)
    return fg.softmax_cross_entropy(centred, batch["y"])
