"""Small problems shared by the train-step and fit tests."""
import jax
import jax.numpy as jnp

import funcgrad as fg


def half_squared_norm(params, batch):
    # L = ||p||^2 / 2  ->  dL/dp = p
    del batch
    return 0.5 * jnp.sum(params["p"] ** 2)


def mlp_problem():
    """A 6-8-3 MLP, a batch of 5 and its cross-entropy loss."""
    params = fg.mlp_init(jax.random.key(0), (6, 8, 3))
    batch = {"x": jax.random.normal(jax.random.key(1), (5, 6)), "y": jnp.array([0, 1, 2, 1, 0])}

    def loss_fn(p, b):
        return fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])
    return params, batch, loss_fn
