"""Where `fit` puts the data and the state: the one place that decides placement.

Array data goes to the device once per run (`place_data`), a loader's batches are stacked on
the host and sent in one transfer per chunk (`stack_batches`), and the state a chunk donates
is first made fit's own (`owned_copy`), so that no array the caller holds is invalidated.

One device: everything lives on JAX's default device. A data-parallel step
(``funcgrad.data_parallel(step, mesh)``): the state, the order's key and the dataset are
replicated over the mesh (`place_state`, `place_data`); inside each chunk every step's batch
is gathered from the dataset and constrained to rows split over the mesh's data axis
(`funcgrad.train.loop._chunks`), so each device gathers and differentiates only its own
rows, with no communication but the step's own all-reduce. In a run of several processes
each process passes its own copy of the whole dataset (``jax.make_array_from_process_local_data``
with a replicated sharding: every process's local data is the whole array) and of the state
(checked equal across processes by `funcgrad.replicate`).

A loader in a run of several processes (`per_process_loader`) yields each process's own rows
of every global batch; `local_batches_agree` checks, before each chunk, that the processes
hold as many batches of one layout (one small all-gather), and `global_batches` builds the
chunk's global arrays from every process's rows (``jax.make_array_from_process_local_data``,
one transfer per leaf), split over the data axis in the mesh's order of processes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def mesh_of(step: Any) -> Any:
    """The step's mesh (`funcgrad.data_parallel`), or None for a one-device step."""
    return step.mesh


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
    if jax.process_count() > 1:
        _same_data_everywhere(data, replicated)

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


def _same_data_everywhere(data: PyTree, replicated: Any) -> None:
    """Raises ValueError on every process when the processes passed different datasets (a
    shape, a dtype or a byte differs): fit takes the same whole dataset on every process and
    picks each batch's rows itself, so a process's own slice, or a copy shuffled its own way,
    would train on rows mixed across processes, silently. One small all-gather of a CRC-32
    of each leaf's layout and bytes (about 1 s per GB on the host, once per `fit` call)."""
    from funcgrad._paths import key_paths, slash_path
    from funcgrad.parallel.placement import gather_from_processes, leaf_fingerprint

    paths = [slash_path(p) or "data" for p in key_paths(data)]
    sums, layout = [], []
    for path, a in zip(paths, jax.tree.leaves(data)):
        if isinstance(a, jax.Array) and a.sharding == replicated:
            sums.append(0)  # placed by the caller already: one global array
            continue
        sums.append(leaf_fingerprint(a) & 0x7FFFFFFF)  # (gathered as int32)
        layout.append(f"{path} {tuple(np.shape(a))} {np.result_type(a)}")
    every, texts = gather_from_processes(sums, "; ".join(layout))
    differ = [path for i, path in enumerate(paths) if len(set(every[:, i].tolist())) > 1]
    if differ:
        shown = "; ".join(f"process {p}: {t}" for p, t in enumerate(texts))
        raise ValueError(
            f"fit: the processes passed different data (the leaves {differ} differ; {shown}). "
            "With a data-parallel step every process passes the same whole dataset (the same "
            "arrays, in the same order), and fit gives each device its rows of every batch. "
            "To have each process read only its own part, pass a loader that yields this "
            "process's rows of each global batch (fg.process_rows(B, mesh)) instead of arrays.")


def place_state(tree: PyTree, mesh: Any = None, *, check: bool = True,
                step: Any = None) -> PyTree:
    """`tree` (a `TrainState`, the order's key) where the step takes it: as is for a
    one-device step, replicated over `mesh` otherwise (`funcgrad.replicate`: in several
    processes the copies are compared first with `check`); a `TrainState` given with the
    `step` that takes it goes where ``step.place_state`` puts it (with
    ``shard_opt_state=True``, the optimizer state split over the data axis)."""
    if mesh is None:
        return tree
    if step is not None and step.shard_opt_state:
        return step.place_state(tree, check=check)
    from funcgrad.parallel.placement import replicate

    return replicate(tree, mesh, check=check)


def per_process_loader(source: Any, mesh: Any) -> bool:
    """Whether `fit` reads a loader whose batches are each process's own rows: a loader, a
    data-parallel step, several processes. (In one process a loader yields global batches.)"""
    return source.loader is not None and mesh is not None and jax.process_count() > 1


def _layout(tree: PyTree) -> str:
    """The leaves of a batch with their shapes and dtypes: ``x (16, 64) float32, y (16,)
    int32`` (an error's words, and what the processes compare)."""
    from funcgrad._paths import key_paths, slash_path

    return ", ".join(f"{slash_path(p) or 'batch'} {tuple(np.shape(a))} {np.result_type(a)}"
                     for p, a in zip(key_paths(tree), jax.tree.leaves(tree)))


def local_batches_agree(batches: Sequence[PyTree], last: bool, *, epoch: int, step: int,
                        following: PyTree = None,
                        what: tuple[str, str] = ("batch", "batches")) -> None:
    """Checks that every process is at the same point of its loader, before the collectives
    of a chunk of `batches` (this process's next ones, all of one layout; none at the end of
    an epoch) would hang or fail: the same number of them, of the same structure, shapes and
    dtypes, and the epoch ending after them (`last`) on every process or on none. One small
    all-gather (`funcgrad.parallel.placement.gather_from_processes`); every process calls it
    once per chunk, in the same order.

    Args:
      batches: this process's batches of the chunk (host arrays), or none.
      last: whether this process's loader ends the epoch after them.
      epoch: the epoch (from 1) and `step` the chunk's first step in it: for the message.
      following: the batch read after them (of other shapes or dtypes), if any: for the
        message.
      what: the singular and plural of what `batches` are.
    Raises:
      ValueError: the processes disagree; on every process, the same message, with each
        process's count, layout and what follows, and the fix.
    """
    from funcgrad.parallel.placement import crc_int31, gather_from_processes

    layout = _layout(batches[0]) if batches else ""
    after = _layout(following) if following is not None else ""
    every, texts = gather_from_processes([len(batches), int(last), crc_int31(layout)],
                                         f"{layout}\n{after}")
    if (every == every[0]).all():
        return
    count = len(every)

    def said(p: int) -> str:
        n, ends = int(every[p, 0]), bool(every[p, 1])
        held, _, then = texts[p].partition("\n")
        held = f"{n} {what[n != 1]} ({held})" if n else f"no more {what[1]}"
        then = ("its epoch ends" if ends else f"one of ({then})" if then else "more")
        return f"process {p}: {held}, then {then}"
    raise ValueError(
        f"fit: the processes' loaders disagree in epoch {epoch} from step {step} on: "
        + "; ".join(said(p) for p in range(count)) + ". With a data-parallel step in a run of "
        f"{count} processes each process's loader yields its own rows of every global batch "
        "(the global batch is every process's batch, in process order), so every process "
        "must yield as many batches per epoch, with the same leaves, shapes and dtypes: "
        f"B / {count} rows each for a global batch of B (fg.process_rows(B, mesh)). Pad a "
        "short last batch to the full size and mask the padding (a loss that weights rows by "
        "a 0/1 mask and divides by its sum), or drop it on every process (fg.Batches(..., "
        "drop_last=True)); or give fit the whole dataset as arrays on every process "
        "(fg.Batches).")


def global_batches(local: PyTree, mesh: Any, axis: str, *, row_axis: int) -> PyTree:
    """This process's rows as the global arrays of every process's rows: each leaf of `local`
    (host arrays; the rows on axis `row_axis`: 0 for one batch ``(b, ...)``, 1 for stacked
    batches ``(T, b, ...)`` or micro-batches ``(K, m, ...)`` and their mask) becomes a global
    ``jax.Array`` with P times the rows on that axis, split over the mesh's `axis`, process
    p's rows where its devices are (rows ``p * b`` to ``(p + 1) * b`` on `fg.data_mesh()`).
    One transfer per leaf (``jax.make_array_from_process_local_data``). The processes must
    agree on the shapes first (`local_batches_agree`).

    Raises:
      ValueError: P * b does not divide among the axis's devices (how to pad and mask), this
        process's devices hold rows that are not contiguous, or a leaf is a global array
        already (fit takes each process's host rows).
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from funcgrad.parallel.placement import divisibility_error, process_rows

    leaves = jax.tree.leaves(local)
    if any(isinstance(a, jax.Array) and not a.is_fully_addressable for a in leaves):
        raise ValueError(
            "fit: a loader's batch holds a global jax.Array (from fg.process_batch or "
            "fg.shard_batch, say); with a data-parallel step in a run of several processes "
            "fit takes each process's own rows as host arrays and builds the global batch "
            "itself: yield the local rows.")
    size = int(mesh.shape[axis])
    total = int(np.shape(leaves[0])[row_axis]) * jax.process_count()
    if total % size:
        raise divisibility_error(
            f"fit (each process's loader yields {total // jax.process_count()} rows of a "
            f"global batch of {total})", total, size, axis)
    process_rows(total, mesh, axis)  # this process's rows are contiguous: a slice of each
    sharding = NamedSharding(mesh, P(*([None] * row_axis), axis))

    def put(leaf: Any) -> jax.Array:
        host = np.asarray(leaf)
        shape = (*host.shape[:row_axis], total, *host.shape[row_axis + 1:])
        return jax.make_array_from_process_local_data(sharding, host, shape)
    return jax.tree.map(put, local)


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
