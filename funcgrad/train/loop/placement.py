"""Where `fit` puts the data and the state: the one place that decides placement.

Array data goes to the device once per run (`place_data`), a loader's batches are stacked on
the host and sent in one transfer per chunk (`stack_batches`), and the state a chunk donates
is first made fit's own (`owned_copy`), so that no array the caller holds is invalidated.
Today everything lives on JAX's default device; placing data and state over several devices
or processes changes these functions, not their callers.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def place_data(data: PyTree) -> PyTree:
    """The dataset's leaves (arrays with a leading example axis, any dtype) as device arrays
    on the default device, one transfer each; leaves that are device arrays already stay
    where they are."""
    return jax.tree.map(lambda a: jax.device_put(np.asarray(a) if not isinstance(a, jax.Array)
                                                 else a), data)


def stack_batches(batches: Sequence[PyTree]) -> PyTree:
    """Batches of one structure and shapes as one pytree with a leading batch axis:
    ``(T, batch, ...)`` NumPy arrays on the host, which the chunk's call sends in one
    transfer per leaf."""
    return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)


def owned_copy(tree: PyTree) -> PyTree:
    """A copy of every array leaf (on its own device), so that donating it leaves the
    caller's arrays valid."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a,
                        tree)
