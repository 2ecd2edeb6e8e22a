"""The data-parallel train step: ``funcgrad.data_parallel(step, mesh)`` jits the same step
with the state replicated over the mesh and the batch's rows split over its data axis.

The loss is still written on the global batch. XLA's partitioner (GSPMD) runs each device's
rows where they are and inserts the collectives the math needs: the sum of the per-device
partial gradients (one all-reduce, of all the leaves together), the global sums of a mean
loss, of a token count, of BatchNorm's statistics. So every number the step computes is the
one-device step's on the same global batch, up to float rounding of the summation order:
clipping on the global norm, the non-finite guard, accumulation, loss scaling, the monitor,
masks, model state and keys (a dropout mask drawn for the global batch with JAX's
partitionable threefry is the same bits as on one device; each device computes only its
rows' part of it). `funcgrad.parallel.collectives` lists what was inserted.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from funcgrad._paths import key_paths, keystr
from funcgrad.parallel.placement import check_mesh, divisibility_error
from funcgrad.train.step import TrainStep, require_train_step


class DataParallel:
    """Where a data-parallel `TrainStep` runs (its ``parallel`` field): the mesh, the axis
    the batch's rows are split over, and whether the optimizer state is split (ZeRO-1)."""

    def __init__(self, mesh: Any, data_axis: str, shard_opt_state: bool):
        self.mesh, self.data_axis, self.shard_opt_state = mesh, data_axis, shard_opt_state

    def __repr__(self) -> str:
        zero = ", shard_opt_state=True" if self.shard_opt_state else ""
        return f"data_parallel({dict(self.mesh.shape)}, data_axis={self.data_axis!r}{zero})"

    def jit(self, step: Callable, accumulate: int | None) -> Any:
        """`step` (unjitted) jitted for the mesh (`data_parallel_jit`)."""
        return data_parallel_jit(step, self.mesh, self.data_axis, accumulate,
                                 self.shard_opt_state)

    def gather_updates(self) -> Callable | None:
        """ZeRO-1's one all-gather of the sharded update inside the step, or None."""
        if not self.shard_opt_state:
            return None
        from funcgrad.parallel.zero import replicated_constraint
        return replicated_constraint(self.mesh)

    def state_shardings(self, state: Any) -> Any:
        if not self.shard_opt_state:
            return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), state)
        from funcgrad.parallel import zero
        return zero.state_shardings(state, self.mesh, self.data_axis)

    def place_state(self, state: Any, *, check: bool = True) -> Any:
        if not self.shard_opt_state:
            from funcgrad.parallel.placement import replicate
            return replicate(state, self.mesh, check=check)
        from funcgrad.parallel import zero
        return zero.place_state(state, self.mesh, self.data_axis, check=check)


def data_parallel(step: TrainStep, mesh: Any, *, data_axis: str = "data",
                  shard_opt_state: bool = False) -> TrainStep:
    """`step` for data parallelism over `mesh`: jitted with the state replicated over the
    mesh and the batch's rows (axis 0; axis 1 of stacked micro-batches under
    `funcgrad.accumulate`) split over its `data_axis`, in one process or across processes
    (``jax.distributed``, ``funcgrad launch``).

    The loss is written on the global batch as before; XLA inserts the gradient all-reduce,
    and the numbers are the one-device step's on the same global batch (docs/guide/
    distributed.md). Under `funcgrad.accumulate` each device accumulates its own rows and the
    sums are all-reduced once per update (a coupled loss such as BatchNorm then sees each
    device's rows, the model state is averaged over the devices, a loss's key is folded with
    the device index). Rows must divide among the axis's devices.

    Args:
      step: a `TrainStep` (`funcgrad.make_train_step`), jitted (not ``jit=False``).
      mesh: a ``jax.sharding.Mesh`` (``funcgrad.data_mesh()``).
      data_axis: the mesh axis the batch's rows are split over.
      shard_opt_state: split the optimizer state over `data_axis` ZeRO-1 style
        (`funcgrad.parallel.zero`): each device keeps 1/N of Adam's moments, the params stay
        replicated, and the step gathers the update (an all-gather besides the gradient
        reduce). Place a state with ``step.place_state(state)``; `fit` does it itself.
    Returns:
      the `TrainStep` with ``parallel`` set; ``step.lower`` lowers the sharded program.
    Raises:
      TypeError: if `step` is not a `TrainStep` or `mesh` not a ``jax.sharding.Mesh``.
      ValueError: if `mesh` has no axis `data_axis` (or it is Explicit, or it leaves a process
        out), the step is already data-parallel, was made with ``jit=False``, or locates
        anomalies (`funcgrad.detect_anomaly`: apply it to the one-device step).
    Example:
      >>> step = fg.data_parallel(fg.make_train_step(loss_fn, optax.adam(1e-3)),
      ...                         fg.data_mesh())
    """
    require_train_step("data_parallel", step)
    check_mesh(mesh, data_axis, "data_parallel")
    if step.parallel is not None:
        raise ValueError(f"data_parallel: the step is already data-parallel ({step.parallel!r});"
                         " apply data_parallel once, to the one-device step.")
    if not step.jit:
        raise ValueError("data_parallel: the step was made with jit=False; data_parallel "
                         "shards the jitted step. Debug with the one-device step.")
    if step.detect_anomaly:
        raise ValueError("data_parallel: the step locates anomalies (funcgrad.detect_anomaly), "
                         "which re-runs the loss eagerly on the host's copy of the batch. Locate "
                         "a NaN with the one-device step on the same global batch.")
    if not isinstance(shard_opt_state, bool):
        raise TypeError(f"data_parallel: shard_opt_state must be True or False, got "
                        f"{shard_opt_state!r}.")
    import dataclasses
    return dataclasses.replace(step, parallel=DataParallel(mesh, data_axis, shard_opt_state))


def _check_rows(batch: Any, mask: Any, size: int, axis: str, row_axis: int) -> None:
    """At trace time: every leaf has a row axis that divides among `size` devices."""
    where = "the data-parallel train step"
    for name, tree in (("batch", batch), ("mask", mask)):
        for path, leaf in zip(key_paths(tree), jax.tree.leaves(tree)):
            shape = np.shape(leaf)
            if len(shape) <= row_axis:
                what = ("(num_micro_batches, micro_batch_size, ...)" if row_axis
                        else "(batch_size, ...)")
                raise ValueError(
                    f"{where}: {name}{keystr(path)} has shape {shape}; every leaf of a "
                    f"sharded batch has the shape {what}, whose rows are split over the "
                    f"devices of {axis!r}. Keep settings (a temperature, a flag) in the "
                    "loss's closure.")
            if shape[row_axis] % size:
                raise divisibility_error(where, shape[row_axis], size, axis,
                                         accumulate=bool(row_axis))


def _check_global(batch: Any, mask: Any, accumulate: int | None) -> None:
    """In a run of several processes: no batch leaf is a ``jax.Array`` on this process's
    devices alone. JAX would take each process's devices' part of its own local array as the
    global batch (half of each process's rows on 2 processes), silently."""
    for name, tree in (("batch", batch), ("mask", mask)):
        for path, leaf in zip(key_paths(tree), jax.tree.leaves(tree)):
            if isinstance(leaf, jax.Array) and leaf.is_fully_addressable:
                fix = ("fg.process_batch(local_microbatches, mesh) (a fg.Microbatches: rows "
                       "on axis 1)" if accumulate is not None
                       else "fg.process_batch(local_rows, mesh)")
                raise ValueError(
                    f"the data-parallel train step: {name}{keystr(path)} is a jax.Array on "
                    f"this process's devices only ({leaf.sharding}) in a run of "
                    f"{jax.process_count()} processes. The step takes global arrays: from "
                    "local ones JAX would use each device's part of its own process's array "
                    "as the global batch, mixing the processes' rows. Build the global batch "
                    f"with {fix}, each process passing its own rows (fg.process_rows), or "
                    "fg.shard_batch(global_batch, mesh) when every process holds the whole "
                    "batch.")


def _explain(error: ValueError, mesh: Any, axis: str,
             zero: bool = False) -> ValueError | None:
    """A clearer error for JAX's placement errors at the step's call, or None."""
    text = str(error)
    split = re.search(r"partitioned (\d+) times, but the dimension size is (\d+)", text)
    if split:
        return divisibility_error("the data-parallel train step", int(split.group(2)),
                                  int(split.group(1)), axis)
    rank = re.search(r"key path (\S+) is incompatible.*?only valid for values of rank at "
                     r"least (\d+), but was applied to a value of rank (\d+)", text, re.S)
    if rank:
        return ValueError(
            f"the data-parallel train step: {rank.group(1)} has {rank.group(3)} axes; every "
            f"leaf of a sharded batch needs at least {rank.group(2)}, with the rows split over "
            f"the devices of {axis!r} (the batch (batch_size, ...), stacked micro-batches "
            "(num_micro_batches, micro_batch_size, ...)). Keep settings (a temperature, a "
            "flag) in the loss's closure.")
    if "non-trivial shardings for numpy inputs" in text:
        return ValueError(
            f"the data-parallel train step: a batch leaf is a host (NumPy) array in a run of "
            f"{jax.process_count()} processes, where each process holds only its own rows. "
            "Build the global batch with fg.process_batch(local_rows, mesh) (each process "
            "its rows, fg.process_rows) or fg.shard_batch(global_batch, mesh) (every process "
            "holding the whole batch).")
    if "does not match the sharding" in text or "incompatible devices" in text.lower():
        state = ("the state placed by step.place_state(state): the params replicated, the "
                 "optimizer state split over the data axis (shard_opt_state=True)" if zero
                 else f"the state replicated over {mesh}")
        place = "step.place_state(state)" if zero else "fg.replicate(state, mesh)"
        if "P(None, " in text:  # the rows of stacked micro-batches: axis 1
            return ValueError(
                "the data-parallel train step: an argument is placed otherwise than the step "
                f"expects: {state}, and the stacked micro-batches (and their mask) with their "
                "rows, axis 1, split over the data axis. Place the state with "
                f"{place} and the micro-batches with fg.process_batch(local_microbatches, "
                "mesh) or fg.shard_batch(microbatches, mesh) given a fg.Microbatches (or "
                "row_axis=1 for a plain pytree and its mask). JAX said: "
                f"{text.splitlines()[0]}")
        return ValueError(
            "the data-parallel train step: an argument is placed on other devices or sharded "
            f"otherwise than the step expects ({state}, the batch's rows split over its data "
            f"axis). Place them with {place} and fg.shard_batch / fg.process_batch, or leave "
            "them uncommitted (host arrays in one process). JAX said: "
            f"{text.splitlines()[0]}")
    return None


def data_parallel_jit(step: Callable, mesh: Any, axis: str, accumulate: int | None,
                      shard_opt_state: bool = False) -> Any:
    """`step` (unjitted) jitted for `mesh`: ``(state, batch[, mask]) -> (state, metrics)``
    with the state and the new state replicated (with `shard_opt_state`, the optimizer state
    split ZeRO-1 style, `funcgrad.parallel.zero`), the batch's rows (axis 0; axis 1 of
    stacked micro-batches) split over `axis`, and the metrics where XLA puts them (scalars
    are replicated). The returned function has ``lower`` for `funcgrad.collectives` and
    `funcgrad.memory_report`, ``state_shardings(state)`` (the shardings it takes the state
    with) and ``place_state(state)`` (the state put there)."""
    from funcgrad.parallel import zero

    size = check_mesh(mesh, axis, "data_parallel")
    row_axis = 0 if accumulate is None else 1
    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P(*([None] * row_axis), axis))

    def traced(state: Any, batch: Any, mask: Any) -> Any:
        _check_rows(batch, mask, size, axis, row_axis)
        return step(state, batch) if accumulate is None else step(state, batch, mask)

    def state_shardings(state: Any) -> Any:
        if not shard_opt_state:
            return jax.tree.map(lambda _: replicated, state)
        return zero.state_shardings(state, mesh, axis)

    def place_state(state: Any, *, check: bool = True) -> Any:
        if not shard_opt_state:
            from funcgrad.parallel.placement import replicate
            return replicate(state, mesh, check=check)
        return zero.place_state(state, mesh, axis, check=check)

    jitted: Any
    if not shard_opt_state:
        jitted = jax.jit(traced, in_shardings=(replicated, rows, rows),
                         out_shardings=(replicated, None))
    else:
        programs: dict[Any, Any] = {}  # one jit per state layout (its shardings differ)

        def jitted_for(state: Any) -> Any:
            layout = (jax.tree.structure(state),
                      tuple(np.shape(a) for a in jax.tree.leaves(state)))
            if layout not in programs:
                shardings = state_shardings(state)
                programs[layout] = jax.jit(traced, in_shardings=(shardings, rows, rows),
                                           out_shardings=(shardings, None))
            return programs[layout]

        def jitted(state: Any, batch: Any, mask: Any = None) -> Any:
            return jitted_for(state)(state, batch, mask)
        jitted.lower = lambda state, *a: jitted_for(state).lower(state, *a)

    def translated(run: Callable, state: Any, batch: Any, mask: Any) -> Any:
        try:
            return run(state, batch, mask)
        except ValueError as error:
            clearer = _explain(error, mesh, axis, shard_opt_state)
            if clearer is None:
                raise
            raise clearer from error

    several = jax.process_count() > 1

    def call(state: Any, batch: Any, mask: Any = None) -> Any:
        if accumulate is None and mask is not None:
            raise TypeError("the train step takes (state, batch); a mask is for a step made "
                            "whose loss accumulates (funcgrad.accumulate).")
        if several:
            _check_global(batch, mask, accumulate)
        return translated(jitted, state, batch, mask)

    call.__name__ = call.__qualname__ = getattr(step, "__name__", "step")
    call.lower = (  # type: ignore[attr-defined]
        lambda state, batch, mask=None: translated(jitted.lower, state, batch, mask))
    call.jitted = jitted  # type: ignore[attr-defined]
    call.state_shardings = state_shardings  # type: ignore[attr-defined]
    call.place_state = place_state  # type: ignore[attr-defined]
    return call
