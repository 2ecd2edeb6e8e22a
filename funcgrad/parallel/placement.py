"""Where the arrays of a data-parallel run live: the mesh, replicated state, sharded batches.

The data-parallel step (``funcgrad.data_parallel(step, mesh)``) takes its `TrainState`
replicated over the mesh and its batch split along the rows over the mesh's data axis. These
helpers put them there, in one process or in several (``jax.distributed``), and check what
would otherwise go wrong silently or hang: a mesh without the data axis, a batch whose rows do
not divide among the devices, processes that disagree on the batch's shapes or on the initial
parameters, a process feeding rows that belong to another.
"""
from __future__ import annotations

import os
import zlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from funcgrad._paths import key_paths, keystr

PyTree = Any

#: The data axis's name when none is given (``funcgrad.data_parallel(step, mesh, data_axis=)``).
DATA_AXIS = "data"


def data_mesh(devices: Any = None, axis: str = DATA_AXIS) -> Mesh:
    """Returns a 1-D `jax.sharding.Mesh` named `axis` over `devices` (default: ``jax.devices()``,
    every device of every process, in JAX's order).

    Its axis type is ``Auto`` (JAX's default for ``Mesh(...)``; ``jax.make_mesh`` makes
    ``Explicit`` axes in recent releases, which the data-parallel step refuses): the step's
    loss is written on the global batch and XLA's partitioner (GSPMD) splits it.

    Raises:
      ValueError: `devices` is empty; this process was started as one of several (by
        ``funcgrad launch``) but never joined them (no ``fg.distributed_init()`` before).
    """
    check_joined("data_mesh")
    found = list(jax.devices() if devices is None else devices)
    if not found:
        raise ValueError("data_mesh: no devices given.")
    return Mesh(np.array(found, dtype=object), (axis,))


def check_joined(where: str) -> None:
    """Raises ValueError when ``funcgrad launch`` started this process as one of several
    (``FUNCGRAD_NUM_PROCESSES`` > 1) but JAX runs it alone: ``fg.distributed_init()`` was not
    called, and each process would train on its own, silently."""
    from funcgrad.parallel.distributed import ENV_NUM_PROCESSES

    wanted = os.environ.get(ENV_NUM_PROCESSES, "")
    if wanted.isdigit() and int(wanted) > 1 and jax.process_count() == 1:
        raise ValueError(
            f"{where}: this process was started as one of {wanted} ({ENV_NUM_PROCESSES}="
            f"{wanted}, set by funcgrad launch), but JAX runs it alone: each process would "
            "train on its own. Call fg.distributed_init() at the top of the script, before "
            "any JAX computation.")


def check_mesh(mesh: Any, axis: str, where: str) -> int:
    """The size of `mesh`'s `axis`, after checking the mesh can carry a data-parallel step.

    Raises:
      TypeError: `mesh` is not a ``jax.sharding.Mesh``.
      ValueError: the mesh has no axis `axis`; the axis is ``Explicit``; in a run of several
        processes, the mesh leaves a process out (that process would train alone).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be a jax.sharding.Mesh (e.g. fg.data_mesh(), or "
                        f"jax.sharding.Mesh(jax.devices(), ('data',))), got "
                        f"{type(mesh).__name__}.")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: the mesh has axes {tuple(mesh.axis_names)} and no data axis {axis!r}, "
            f"over which the batch's rows are split. Pass data_axis= one of "
            f"{tuple(mesh.axis_names)}, or build the mesh with fg.data_mesh() (a 1-D mesh "
            f"named {DATA_AXIS!r} over all devices).")
    types = getattr(mesh, "axis_types", None) or ()
    names = list(mesh.axis_names)
    if types and "Explicit" in str(types[names.index(axis)]):
        raise ValueError(
            f"{where}: the mesh's axis {axis!r} is Explicit (jax.make_mesh's default in this "
            "JAX), which puts shardings into the types of every array the loss computes; the "
            "data-parallel step writes the loss on the global batch and lets XLA partition it, "
            "on Auto axes. Build the mesh with fg.data_mesh(), jax.sharding.Mesh(devices, "
            f"({axis!r},)) or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,)).")
    check_joined(where)
    if jax.process_count() > 1:
        held = {d.process_index for d in mesh.devices.flat}
        if held != set(range(jax.process_count())):
            missing = sorted(set(range(jax.process_count())) - held)
            raise ValueError(
                f"{where}: the mesh holds devices of processes {sorted(held)} of "
                f"{jax.process_count()}; processes {missing} would train on their own, apart "
                "from the others. Build the mesh from jax.devices() (every process's devices), "
                "e.g. fg.data_mesh(), not jax.local_devices().")
    return int(mesh.shape[axis])


def _key_data(x: Any) -> Any:
    """`x`, or the raw data of a typed PRNG key array (which has no NumPy form)."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def _local_value(x: Any) -> np.ndarray:
    """This process's copy of a replicated leaf (or the host value of a local one)."""
    x = _key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def leaf_fingerprint(x: Any) -> int:
    """A CRC-32 of a leaf's shape, dtype and bytes (this process's copy): what the processes
    compare to find out whether they hold the same value."""
    value = np.ascontiguousarray(_local_value(x))
    return zlib.crc32(value.tobytes(), zlib.crc32(f"{value.shape}{value.dtype}".encode()))


def replicate(tree: PyTree, mesh: Mesh, *, check: bool = True) -> PyTree:
    """Returns `tree` with every leaf replicated on `mesh` (``NamedSharding(mesh, P())``): the
    placement of a data-parallel step's `TrainState` (params, optimizer state, model state,
    key, monitor and loss-scale states).

    A leaf already replicated on `mesh` is returned as is (no copy). In a run of several
    processes each process passes its own copy, which must be the same on all: with `check`
    (the default) the processes compare one CRC32 per leaf first (one small all-gather) and a
    difference raises instead of training on params that silently differ per process (built
    from another seed, say).

    Args:
      tree: a pytree of arrays (``jax.Array``, NumPy, typed PRNG keys), e.g. a `TrainState`.
      mesh: the step's mesh.
      check: compare the leaves across processes (ignored in one process).
    Returns:
      the same pytree of ``jax.Array``, each fully replicated over the mesh's devices.
    Raises:
      ValueError: a leaf is already sharded (not replicated) over the mesh, or (with
        `check`) the processes hold different values; the message names the first leaf.
    """
    sharding = NamedSharding(mesh, P())
    leaves, treedef = jax.tree.flatten(tree)
    paths = key_paths(tree)
    # Leaves named as the caller writes them: state.params['w'] for a TrainState.
    root = "state" if hasattr(tree, "params") and hasattr(tree, "opt_state") else "tree"
    for path, leaf in zip(paths, leaves):
        if (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
                and not leaf.is_fully_replicated):
            raise ValueError(f"replicate: {root}{keystr(path)} is sharded as {leaf.sharding}; "
                             "the data-parallel step keeps the state replicated on every "
                             "device. Gather it first (jax.experimental.multihost_utils."
                             "process_allgather) or rebuild it with step.init(params).")
    if check and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mine = np.array([leaf_fingerprint(x) for x in leaves], dtype=np.int64)
        every = np.asarray(multihost_utils.process_allgather(mine))
        differ = np.flatnonzero((every != every[0]).any(axis=0))
        if differ.size:
            i = int(differ[0])
            which = [p for p in range(every.shape[0]) if every[p, i] != every[0, i]]
            raise ValueError(
                f"replicate: the processes hold different values for {root}{keystr(paths[i])} "
                f"(and {differ.size - 1} more leaves): process 0 differs from processes "
                f"{which}. A replicated state must be the same on every process: build it "
                "from the same seed on each (step.init(fg.mlp_init(jax.random.key(0), "
                "...))), or broadcast process 0's with jax.experimental.multihost_utils."
                "broadcast_one_to_all.")
    placed = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            placed.append(leaf)
        elif isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            placed.append(leaf)  # replicated on another mesh of the same devices: jit reshards
        elif jax.process_count() == 1:
            placed.append(jax.device_put(leaf, sharding))
        else:  # this process's copy; JAX's device_put would compare every leaf (NaN != NaN)
            placed.append(_replicated_from_local(leaf, sharding))
    return jax.tree.unflatten(treedef, placed)


def _replicated_from_local(leaf: Any, sharding: NamedSharding) -> jax.Array:
    """A global replicated array from this process's copy of `leaf` (typed keys too)."""
    typed = jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key)
    host = _local_value(leaf)
    out = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.random.wrap_key_data(out, impl=jax.random.key_impl(leaf)) if typed else out


def _rows_of(tree: PyTree, where: str, axis_index: int = 0) -> int:
    """The common length of axis `axis_index` over the leaves of `tree`."""
    leaves, paths = jax.tree.leaves(tree), key_paths(tree)
    if not leaves:
        raise ValueError(f"{where}: the batch has no arrays.")
    counts = {}
    for path, leaf in zip(paths, leaves):
        if np.ndim(leaf) <= axis_index:
            raise ValueError(f"{where}: batch{keystr(path)} has shape {np.shape(leaf)}, with no "
                             f"row axis to split over the devices. Every leaf of a sharded "
                             "batch has the rows first; keep settings (a temperature, a flag) "
                             "in the loss's closure.")
        counts[keystr(path)] = np.shape(leaf)[axis_index]
    if len(set(counts.values())) > 1:
        raise ValueError(f"{where}: the batch's leaves disagree on the number of rows: "
                         f"{counts}.")
    return int(next(iter(counts.values())))


def divisibility_error(where: str, rows: int, devices: int, axis: str,
                       accumulate: bool = False) -> ValueError:
    """The error for a batch whose rows do not divide among the devices, with the fix."""
    what = "micro-batch size" if accumulate else "batch size"
    pad = -rows % devices
    return ValueError(
        f"{where}: a {what} of {rows} rows does not divide among the {devices} devices of the "
        f"mesh's axis {axis!r}. Pad it to {rows + pad} rows ({pad} more, e.g. copies of the "
        "last row) and give the padding zero weight: a loss that sums per-row terms times a "
        "0/1 mask and divides by the mask's sum (the real-row count) ignores it exactly; "
        "that accumulates (fg.accumulate), fg.stack_microbatches pads and masks for you. Or "
        "drop the rows "
        f"(a batch size that is a multiple of {devices}).")


def _row_axis(batch: PyTree, row_axis: int | None) -> int:
    """The axis of `batch`'s rows: 1 for a `funcgrad.Microbatches` (stacked micro-batches
    ``(num_micro_batches, m, ...)`` and their mask), else 0, unless `row_axis` says."""
    if row_axis is not None:
        return row_axis
    from funcgrad.train.microbatches import Microbatches

    return 1 if isinstance(batch, Microbatches) else 0


def shard_batch(batch: PyTree, mesh: Mesh, axis: str = DATA_AXIS, *,
                row_axis: int | None = None) -> PyTree:
    """Returns the global batch `batch` split along its rows over `mesh`'s `axis`.

    Each leaf's leading axis (the rows) is divided among the devices of `axis`
    (``NamedSharding(mesh, P(axis))``); other axes stay whole. For one process, or for
    several that each hold the whole global batch (a dataset every process loads, such as
    the digits): each process places the rows of its own devices. When each process reads
    only its own rows (a loader per process), use `process_batch` (`funcgrad.fit` does
    this for a loader per process itself).

    Args:
      batch: a pytree of arrays of shape ``(B, ...)``, the same on every process; or stacked
        micro-batches for an accumulating step: a `funcgrad.Microbatches` (its arrays
        ``(num_micro_batches, B, ...)`` and mask ``(num_micro_batches, B)``), split along
        axis 1.
      mesh: the step's mesh; `axis`: its data axis.
      row_axis: the axis of the rows (default 0; 1 for a `Microbatches`); 1 for a plain
        pytree of stacked micro-batches (and, separately, their mask).
    Returns:
      the batch as global ``jax.Array`` leaves of the same shapes (a `Microbatches` stays
      one).
    Raises:
      ValueError: B does not divide among the devices (the message says how to pad and mask),
        the leaves disagree on B, or a leaf has no row axis.
    """
    size = check_mesh(mesh, axis, "shard_batch")
    row_axis = _row_axis(batch, row_axis)
    rows = _rows_of(batch, "shard_batch", row_axis)
    if rows % size:
        raise divisibility_error("shard_batch", rows, size, axis, accumulate=row_axis == 1)
    sharding = NamedSharding(mesh, P(*([None] * row_axis), axis))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)

    def put(x: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(put, batch)


def process_rows(global_rows: int, mesh: Mesh, axis: str = DATA_AXIS) -> slice:
    """The rows of a global batch of `global_rows` rows that this process's devices hold.

    A loader per process reads exactly these (``dataset[step * B:][process_rows(B, mesh)]``)
    and hands them to `process_batch`. On a mesh from ``jax.devices()`` process p of P holds
    rows ``p * B/P`` to ``(p + 1) * B/P``.

    Returns:
      ``slice(start, stop)``.
    Raises:
      ValueError: `global_rows` does not divide among the devices, or this process's devices
        hold rows that are not contiguous (a mesh whose device order interleaves processes).
    """
    size = check_mesh(mesh, axis, "process_rows")
    if global_rows % size:
        raise divisibility_error("process_rows", global_rows, size, axis)
    index = NamedSharding(mesh, P(axis)).addressable_devices_indices_map((global_rows,))
    spans = sorted({(s[0].start or 0, s[0].stop if s[0].stop is not None else global_rows)
                    for s in index.values() if s is not None})
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        if stop != start:
            raise ValueError(f"process_rows: this process's devices hold rows {spans} of the "
                             "global batch, which are not contiguous; build the mesh from "
                             "jax.devices() in JAX's order (fg.data_mesh()).")
    return slice(spans[0][0], spans[-1][1])


def _layout(tree: PyTree) -> str:
    """The batch's structure with each leaf's trailing shape and dtype (rows left out)."""
    leaves = [(keystr(p), tuple(np.shape(x))[1:], str(np.result_type(_key_data(x))))
              for p, x in zip(key_paths(tree), jax.tree.leaves(tree))]
    return repr(leaves)


#: How many bytes of each process's text `gather_from_processes` passes on.
TEXT_BYTES = 512


def crc_int31(text: str) -> int:
    """A CRC32 of `text` that fits an int32 (what `gather_from_processes` sends)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def gather_from_processes(numbers: Any, text: str = "") -> tuple[np.ndarray, list[str]]:
    """Every process's `numbers` and `text`, by one small all-gather: how the processes check
    that they agree (on a batch's rows and layout, a loader's batch count) before a
    collective that would hang or fail if they did not. Every process must call it, in the
    same order, with as many numbers.

    Args:
      numbers: ints, each within int32 (they travel as int32, whether or not ``jax_enable_x64``
        is set); `text`: a short description (its first `TEXT_BYTES` UTF-8 bytes travel).
    Returns:
      ``(every, texts)``: an int32 array of shape ``(process_count, len(numbers))``, row p
      process p's numbers, and ``texts[p]`` process p's text. In one process: this process's
      alone, with no communication.
    """
    mine = np.asarray(numbers, dtype=np.int64).reshape(-1)
    if mine.size and (mine.min() < -2**31 or mine.max() >= 2**31):
        raise ValueError(f"gather_from_processes: {mine.tolist()} do not all fit in int32.")
    if jax.process_count() == 1:
        return mine.astype(np.int32)[None], [text]
    from jax.experimental import multihost_utils

    raw = text.encode()[:TEXT_BYTES]
    packed = np.frombuffer(raw.ljust(TEXT_BYTES, b"\0"), dtype=np.uint8).astype(np.int32)
    sent = np.concatenate([mine.astype(np.int32), [len(raw)], packed]).astype(np.int32)
    every = np.asarray(multihost_utils.process_allgather(sent)).astype(np.int32)
    k = mine.size
    texts = [bytes(row[k + 1:k + 1 + int(row[k])].astype(np.uint8)).decode(errors="replace")
             for row in every]
    return every[:, :k], texts


def process_batch(local: PyTree, mesh: Mesh, axis: str = DATA_AXIS, *,
                  rows: Any = None, check: bool = True, row_axis: int | None = None) -> PyTree:
    """Returns the global batch made of every process's `local` rows
    (``jax.make_array_from_process_local_data``), split over `mesh`'s `axis`.

    Each process passes the rows its own devices hold (`process_rows`), all processes the
    same number: the global batch has P times as many rows, process 0's first. In one
    process this is `shard_batch`.

    Args:
      local: a pytree of arrays of shape ``(b, ...)``: this process's rows; or its rows of
        stacked micro-batches for an accumulating step: a `funcgrad.Microbatches` (arrays
        ``(num_micro_batches, b, ...)``, mask ``(num_micro_batches, b)``), rows on axis 1.
      mesh: the step's mesh (all processes' devices); `axis`: its data axis.
      rows: optional, the global row numbers of `local` (an int array of length b, or a
        slice): checked against `process_rows`, so that rows fed by the wrong process (shards
        swapped) raise instead of training on a reordered batch.
      check: before building the arrays, the processes compare their row counts and the
        batch's structure, trailing shapes and dtypes (one small all-gather): a difference
        raises here rather than hanging or failing inside the step's collectives.
      row_axis: the axis of the rows (default 0; 1 for a `Microbatches`); 1 for a plain
        pytree of stacked micro-batches (and, separately, their mask).
    Returns:
      the batch as global ``jax.Array`` leaves of shape ``(P * b, ...)`` (P * b on
      `row_axis`; a `Microbatches` stays one).
    Raises:
      ValueError: processes that disagree on the rows, structure, shapes or dtypes (with each
        process's row count); `rows` that are not this process's; P * b not divisible among
        the devices (how to pad and mask); leaves that disagree on b.
    """
    size = check_mesh(mesh, axis, "process_batch")
    row_axis = _row_axis(local, row_axis)
    b = _rows_of(local, "process_batch", row_axis)
    count = jax.process_count()
    if check and count > 1:
        layout = _layout(local)
        every, _ = gather_from_processes([b, crc_int31(layout)])
        if (every != every[0]).any():
            counts = {p: int(every[p, 0]) for p in range(count)}
            same = bool((every[:, 1] == every[0, 1]).all())
            raise ValueError(
                f"process_batch: the processes disagree on the batch: rows per process "
                f"{counts}" + ("" if same else "; its structure, trailing shapes or dtypes "
                               f"differ too (this process, {jax.process_index()}: {layout})")
                + ". Every process must feed the same number of rows of the same layout at "
                "every step, and run the same number of steps: pad a short last batch to the "
                "full size and mask the padding (a loss that weights rows by a 0/1 mask and "
                "divides by its sum), or drop it on every process.")
    total = b * count
    if total % size:
        raise divisibility_error("process_batch", total, size, axis,
                                 accumulate=row_axis == 1)
    if rows is not None:
        expected = process_rows(total, mesh, axis)
        got = (np.arange(total)[rows] if isinstance(rows, slice)
               else np.asarray(rows).reshape(-1))
        if not np.array_equal(got, np.arange(expected.start, expected.stop)):
            shown = (f"{got[0]}..{got[-1]}" if got.size and np.array_equal(
                got, np.arange(got[0], got[0] + got.size)) else f"{got[:8].tolist()}...")
            raise ValueError(
                f"process_batch: process {jax.process_index()} fed rows {shown} of the global "
                f"batch, but its devices hold rows {expected.start}..{expected.stop - 1}: the "
                "shards are swapped or misordered. Read fg.process_rows(global_batch_size, "
                "mesh) on each process and feed exactly those rows.")
    sharding = NamedSharding(mesh, P(*([None] * row_axis), axis))

    def put(x: Any) -> jax.Array:
        host = np.asarray(x) if not isinstance(x, jax.Array) else x
        shape = list(np.shape(host))
        shape[row_axis] = total
        return jax.make_array_from_process_local_data(sharding, host, tuple(shape))
    return jax.tree.map(put, local)
