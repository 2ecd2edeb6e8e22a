"""Where `fit` puts the data and the state: the one place that decides placement.

Array data goes to the device once per run (`place_data`), a loader's batches are stacked on
the host and sent in one transfer per chunk (`stack_batches`), and the state a chunk donates
is first made fit's own (`owned_copy`), so that no array the caller holds is invalidated.

One device: everything lives on JAX's default device. A data-parallel step
(``make_train_step(..., mesh=mesh)``): the state, the order's key and the dataset are
replicated over the mesh (`place_state`, `place_data`); inside each chunk every step's batch
is gathered from the dataset and constrained to rows split over the mesh's data axis
(`funcgrad.train.loop._chunks`), so each device gathers and differentiates only its own
rows, with no communication but the step's own all-reduce. In a run of several processes
each process passes its own copy of the whole dataset (``jax.make_array_from_process_local_data``
with a replicated sharding: every process's local data is the whole array) and of the state
(checked equal across processes by `funcgrad.replicate`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def mesh_of(step: Any) -> Any:
    """The step's mesh (``make_train_step(..., mesh=)``), or None for a one-device step."""
    return getattr(step, "mesh", None)


def place_data(data: PyTree, mesh: Any = None) -> PyTree:
    """The dataset's leaves (arrays with a leading example axis, any dtype) as device arrays,
    one transfer each: on the default device (leaves that are device arrays already stay
    where they are), or with a `mesh`, replicated over it (each process passing its own copy
    of the whole dataset)."""
    if mesh is None:
        return jax.tree.map(lambda a: jax.device_put(np.asarray(a) if not isinstance(
            a, jax.Array) else a), data)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated = NamedSharding(mesh, P())

    def put(a: Any) -> jax.Array:
        if isinstance(a, jax.Array) and a.sharding == replicated:
            return a
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            raise ValueError(
                f"fit: a data leaf is a global array sharded as {a.sharding}; fit with a "
                "data-parallel step takes the whole dataset on every process (host arrays) "
                "and splits each batch's rows over the mesh itself.")
        host = np.asarray(a)
        return jax.make_array_from_process_local_data(replicated, host, host.shape)
    return jax.tree.map(put, data)


def place_state(tree: PyTree, mesh: Any = None, *, check: bool = True) -> PyTree:
    """`tree` (a `TrainState`, the order's key) where the step takes it: as is for a
    one-device step, replicated over `mesh` otherwise (`funcgrad.replicate`: in several
    processes the copies are compared first with `check`)."""
    if mesh is None:
        return tree
    from funcgrad.parallel.placement import replicate

    return replicate(tree, mesh, check=check)


def stack_batches(batches: Sequence[PyTree]) -> PyTree:
    """Batches of one structure and shapes as one pytree with a leading batch axis:
    ``(T, batch, ...)`` NumPy arrays on the host, which the chunk's call sends in one
    transfer per leaf."""
    return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)


@jax.jit
def _copied(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.copy, tree)


def owned_copy(tree: PyTree) -> PyTree:
    """A copy of every array leaf (where it lives: on its device, or with its sharding over
    a mesh), so that donating it leaves the caller's arrays valid."""
    leaves = jax.tree.leaves(tree)
    if any(isinstance(a, jax.Array) and len(a.sharding.device_set) > 1 for a in leaves):
        return _copied(tree)  # a replicated state (`place_state`): one program, any process
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a,
                        tree)
