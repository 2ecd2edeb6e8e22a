"""ZeRO-1: the optimizer state sharded over the data axis, the params replicated.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), stage 1 ("P_os"): with N data-parallel devices each holds 1/N of the optimizer
state (Adam's two moments: twice the params' bytes) instead of all of it. The update is
elementwise in the state, so each device updates only its slice of it, and the updated params
are gathered back: one reduce of the gradients (an all-reduce, or the reduce-scatter half of
it) and one all-gather of the update per step, the same bytes on the wire as plain data
parallelism's one all-reduce (an all-reduce is a reduce-scatter plus an all-gather).

Here the rule is written as shardings and XLA's partitioner (GSPMD) does the rest:
`funcgrad.data_parallel(step, mesh, shard_opt_state=True)` jits the step with each optimizer-state
leaf split over the data axis along its first axis that divides among the devices (Adam's
``mu``/``nu`` of a ``(64, 32)`` weight: rows; scalars such as the step count, and leaves with
no such axis, stay replicated), and the params, model state and everything else replicated.
The numbers are the replicated step's: only where the state lives changes.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def replicated_constraint(mesh: Any) -> Any:
    """``tree -> tree`` constrained to be replicated over `mesh` (inside a jitted step): the
    step's updates, computed on the optimizer state's slices, gathered once before the guard
    and ``apply_updates`` read them."""
    replicated = NamedSharding(mesh, P())
    return lambda tree: jax.lax.with_sharding_constraint(tree, replicated)


def opt_state_spec(shape: tuple[int, ...], size: int, axis: str) -> P:
    """The `PartitionSpec` of an optimizer-state leaf of `shape` under ZeRO-1 over `size`
    devices of `axis`: split along the first axis whose length is a positive multiple of
    `size`, replicated (``P()``) when there is none (scalars, odd lengths) or ``size == 1``."""
    if size > 1:
        for i, n in enumerate(shape):
            if n >= size and n % size == 0:
                return P(*([None] * i), axis)
    return P()


def state_shardings(state: Any, mesh: Any, axis: str) -> Any:
    """The shardings of a `funcgrad.TrainState` under ZeRO-1: a pytree of `NamedSharding`
    with `state`'s structure, its ``opt_state`` leaves split by `opt_state_spec` and every
    other leaf replicated over `mesh`."""
    size = int(mesh.shape[axis])
    replicated = NamedSharding(mesh, P())
    opt = jax.tree.map(lambda a: NamedSharding(mesh, opt_state_spec(np.shape(a), size, axis)),
                       state.opt_state)
    return state._replace(**{name: (opt if name == "opt_state"
                                    else jax.tree.map(lambda _: replicated, value))
                             for name, value in state._asdict().items()})


def place_state(state: Any, mesh: Any, axis: str, *, check: bool = True) -> Any:
    """`state` replicated over `mesh` (`funcgrad.replicate`: in several processes the copies
    are compared first with `check`), then its optimizer state split as `state_shardings`
    says: each device keeps its slice, nothing is sent (a jitted identity with those output
    shardings). A state already placed so is returned as is."""
    from funcgrad.parallel.placement import replicate

    shardings = state_shardings(state, mesh, axis)
    leaves = jax.tree.leaves(state)
    if all(isinstance(a, jax.Array) and a.sharding == s
           for a, s in zip(leaves, jax.tree.leaves(shardings))):
        return state
    replicated = replicate(state, mesh, check=check)
    return jax.jit(lambda s: s, out_shardings=shardings)(replicated)
