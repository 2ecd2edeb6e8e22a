"""Micro-batches on the host: padded to one size and stacked, with the mask of their real rows.

`funcgrad.train.accumulate` scans over a stack of equal-sized micro-batches; these helpers build
that stack from micro-batches of unequal sizes (the last one of an epoch is usually short) and keep
the mask of real rows in the same object, a `Microbatches`, so that the padding rows cannot be
counted as examples by forgetting to pass the mask.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Microbatches:
    """Stacked, padded micro-batches and the mask of their real rows, travelling together.

    Made by `stack_microbatches` and `group_microbatches`; `accumulate_grads` and an
    accumulating step (``make_train_step(funcgrad.accumulate(loss, K), ...)``) take it whole
    and use its mask, so padding rows are never counted as examples. A pytree (its leaves are
    those of `data`, then `mask`), so it passes through ``jax.jit``. It does not unpack: the
    PyTorch-style ``stacked, mask = stack_microbatches(...)`` raises, because dropping the
    mask later would silently average the padding rows in.

    Attributes:
      data: pytree of arrays of shape ``(num_micro_batches, m, ...)``, padded to m rows.
      mask: bool ``(num_micro_batches, m)``, True for a real example, False for padding.
    """
    data: PyTree
    mask: Any

    def __iter__(self):
        raise TypeError(
            "a Microbatches does not unpack: it keeps the stacked micro-batches and the mask of "
            "their real rows together, so the padding cannot be counted by accident. Pass it "
            "whole: accumulate_grads(loss_fn, params, mbs) or step(state, mbs); read the arrays "
            "as mbs.data and mbs.mask.")


jax.tree_util.register_dataclass(Microbatches, data_fields=["data", "mask"], meta_fields=[])


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int (micro-batches per update), got "
                         f"{value!r}.")
    return int(value)


def stack_microbatches(microbatches: Sequence[PyTree], *,
                       size: int | None = None) -> Microbatches:
    """Pads micro-batches of possibly unequal sizes to one size and stacks them, with a mask.

    Runs on the host, in NumPy, except for leaves of an extended dtype (typed PRNG keys,
    ``jax.random.split(key, n)`` for per-example dropout), which NumPy cannot hold: those are
    padded and stacked with ``jax.numpy`` and stay JAX arrays. A micro-batch with n < `size`
    rows is padded with copies of its last row (so the padded losses are finite whenever the
    real ones are, and a padded key is a valid key), and the mask marks its first n rows as
    real.

    Args:
      microbatches: a non-empty sequence of pytrees with one structure (e.g. dicts
        ``{"x": (n_j, ...), "y": (n_j,)}``); within a micro-batch every leaf has the same
        leading length n_j >= 1. JAX arrays are copied to the host.
      size: the padded size m; default the largest n_j.
    Returns:
      a `Microbatches`: ``.data`` has the structure of a micro-batch with leaves of shape
      ``(len(microbatches), m, ...)`` and the leaves' dtypes (NumPy arrays; JAX arrays for
      PRNG keys); ``.mask`` is bool ``(len(microbatches), m)``.
      Pass it whole to `accumulate_grads` or an accumulating step.
    Raises:
      ValueError: if there are no micro-batches, one is empty, its leaves disagree on their
        leading length (or one is a scalar), it has more than `size` rows, or the structures
        differ.
    """
    if not microbatches:
        raise ValueError("stack_microbatches: got no micro-batches; pass at least one.")
    treedef = jax.tree.structure(microbatches[0])
    counts = []
    for j, mb in enumerate(microbatches):
        if jax.tree.structure(mb) != treedef:
            raise ValueError(f"stack_microbatches: micro-batch {j} has structure "
                             f"{jax.tree.structure(mb)}, but micro-batch 0 has {treedef}.")
        lengths = {_rows(leaf, j) for leaf in jax.tree.leaves(mb)}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError(f"stack_microbatches: the leaves of micro-batch {j} have leading "
                             f"lengths {sorted(lengths)}; they must be one length >= 1.")
        counts.append(lengths.pop())
    size = max(counts) if size is None else size
    if max(counts) > size:
        raise ValueError(f"stack_microbatches: micro-batch {counts.index(max(counts))} has "
                         f"{max(counts)} rows, more than size={size}. Pass a larger size.")

    stacked = jax.tree.map(lambda *leaves: _padded_stack(leaves, size), *microbatches)
    mask = np.arange(size)[None, :] < np.asarray(counts)[:, None]
    return Microbatches(stacked, mask)


def _rows(leaf, j: int) -> int:
    """The leading length of a micro-batch leaf (its shape is read, never its values)."""
    shape = np.shape(leaf)  # .shape when it has one: a PRNG key array does not become NumPy
    if not shape:
        raise ValueError(f"stack_microbatches: micro-batch {j} has a scalar leaf "
                         f"({leaf!r}); every leaf needs a leading axis of examples, e.g. "
                         "shape (n_j, ...).")
    return shape[0]


def _padded_stack(leaves: Sequence[Any], size: int):
    """The leaves padded to `size` rows with copies of their last row, stacked: NumPy, or
    jax.numpy for an extended dtype (typed PRNG keys), which NumPy cannot hold."""
    extended = any(isinstance(a, jax.Array)
                   and jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended) for a in leaves)
    xp = jnp if extended else np
    rows = lambda n: np.minimum(np.arange(size), n - 1)  # 0 .. n-1, then n-1 repeated
    return xp.stack([xp.asarray(a)[rows(np.shape(a)[0])] for a in leaves])


def group_microbatches(microbatches: Iterable[PyTree], accumulate: int, *,
                       size: int | None = None) -> Iterator[Microbatches]:
    """Yields ``stack_microbatches`` of each `accumulate` consecutive micro-batches.

    The last group holds the remaining 1 .. accumulate - 1 micro-batches when their number is
    not a multiple of `accumulate`; it is yielded, never dropped here, so that the step's
    `tail` policy decides. All groups pad to one size, so a jitted step compiles at most twice
    (full groups, and the shorter last one).

    Args:
      microbatches: an iterable of micro-batches, e.g. ``funcgrad.Batches(x, y,
        batch_size=m).epoch(e)``, whose last one may be smaller.
      accumulate: micro-batches per group, a positive int.
      size: the padded micro-batch size; default the size of the first micro-batch.
    Yields:
      a `Microbatches` per group, as `stack_microbatches` returns it, leading axis
      `accumulate` (fewer for the last group).
    Raises:
      ValueError: if `accumulate` is not a positive int, or as `stack_microbatches`.
      TypeError: if `microbatches` is one batch (a dict or an array), not an iterable of them.
    """
    k = _positive_int(accumulate, "group_microbatches: accumulate")  # checked at the call
    if isinstance(microbatches, Mapping) or hasattr(microbatches, "shape"):
        raise TypeError(
            "group_microbatches takes an iterable of micro-batches (e.g. a list of dicts, or "
            "funcgrad.Batches(x, y, batch_size=m).epoch(0)), got one "
            f"{type(microbatches).__name__}; iterating it would give its "
            f"{'keys' if isinstance(microbatches, Mapping) else 'rows'}. Split the batch "
            "first, or pass [batch].")

    def groups(size):
        group: list[PyTree] = []
        for mb in microbatches:
            size = _rows(jax.tree.leaves(mb)[0], 0) if size is None else size
            group.append(mb)
            if len(group) == k:
                yield stack_microbatches(group, size=size)
                group = []
        if group:
            yield stack_microbatches(group, size=size)
    return groups(size)


#: What a final group of fewer than K micro-batches does (`accumulate`).
TAIL_POLICIES = ("apply", "drop")


def accumulate(loss_fn: Any, k: int, *, tail: str = "apply") -> Any:
    """The loss, marked to give one update per K micro-batches with the mean gradient over
    their examples (a piece of `funcgrad.make_train_step`; PyTorch's ``loss.backward()`` K
    times before ``optimizer.step()``, but equal to the full batch's gradient).

    The step then takes ``step(state, microbatches, mask=None)``: leaves of shape
    ``(M, m, ...)`` (M micro-batches of m examples, padded; `mask` bool ``(M, m)`` marks the
    real ones) or one `Microbatches` (`group_microbatches`, `stack_microbatches`), and the loss
    returns one loss per example, shape ``(m,)``. The norm, clipping, guard and optimizer run
    once per group of K, inside one ``lax.scan``; the metrics gain a leading axis of length U
    (updates in the call) plus ``"examples": (U,)`` and ``"dropped_examples": ()``. The mean
    is the full-batch gradient only if each example's loss depends on that example alone: a
    loss coupled through the micro-batch (BatchNorm in training mode) warns at the first call
    (`funcgrad.CoupledExamplesWarning`). Derivation and measurements:
    the training guide (docs/guide/train.md).

    Args:
      loss_fn: the per-example loss: a function or a `funcgrad.Loss`.
      k: micro-batches per update, an int >= 1.
      tail: a final group of fewer than K micro-batches: "apply" (one more update over its
        examples) or "drop" (counted in "dropped_examples").
    Returns:
      a `funcgrad.Loss` whose ``accumulation`` is ``Accumulation(k, tail)``.
    Raises:
      ValueError: if `k` is not a positive int, `tail` is not "apply" or "drop", or the loss
        already accumulates.
    Example:
      >>> step = fg.make_train_step(fg.accumulate(per_example_loss, 4), optax.sgd(0.1))
    """
    from funcgrad.train.loss import Accumulation, as_loss

    loss = as_loss(loss_fn)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"accumulate: k must be a positive int (micro-batches per update), "
                         f"got {k!r}.")
    if tail not in TAIL_POLICIES:
        raise ValueError(f"accumulate: tail must be one of {TAIL_POLICIES}, got {tail!r}.")
    if loss.accumulation is not None:
        raise ValueError(f"accumulate: {loss!r} already accumulates; apply accumulate once.")
    return loss._marked(accumulation=Accumulation(int(k), tail))


def unpack_microbatches(microbatches, mask) -> tuple[PyTree, Any]:
    """The stacked arrays and the mask, from a `Microbatches` or from a pytree and `mask`."""
    if isinstance(microbatches, Microbatches):
        if mask is not None:
            raise TypeError("accumulate: the Microbatches already carry the mask of their real "
                            "rows; drop mask= (or pass mbs.data with mask=).")
        return microbatches.data, microbatches.mask
    return microbatches, mask


def one_microbatch(microbatches: PyTree) -> PyTree:
    """The shapes and dtypes of one micro-batch: `microbatches` without its leading axis."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], jnp.result_type(a)),
                        microbatches)


def leading_axes(microbatches: PyTree) -> tuple[int, int]:
    leaves = jax.tree_util.tree_flatten_with_path(microbatches)[0]
    if not leaves:
        raise ValueError("accumulate: microbatches has no arrays; pass a pytree whose leaves "
                         "have shape (num_micro_batches, micro_batch_size, ...).")
    shapes = [(jax.tree_util.keystr(path), jnp.shape(leaf)) for path, leaf in leaves]
    path0, shape0 = shapes[0]
    for path, shape in shapes:
        if len(shape) < 2 or shape[:2] != shape0[:2] or shape[0] == 0:
            raise ValueError(
                f"accumulate: every leaf of microbatches needs shape (num_micro_batches, "
                f"micro_batch_size, ...) with the same two leading sizes and at least one "
                f"micro-batch; microbatches{path} has shape {shape} but microbatches{path0} has "
                f"{shape0}. Stack micro-batches with stack_microbatches(...).")
    return shape0[0], shape0[1]


def checked_mask(mask, num: int, size: int) -> jax.Array | None:
    if mask is None:  # every row is real; not materialised (it would be temporary memory)
        return None
    if jnp.result_type(mask) != jnp.bool_:
        raise TypeError(f"accumulate: mask must be boolean (True for a real example), got "
                        f"dtype {jnp.result_type(mask)}. Use mask.astype(bool).")
    if jnp.shape(mask) != (num, size):
        raise ValueError(f"accumulate: mask has shape {jnp.shape(mask)} but the micro-batches "
                         f"need ({num}, {size}) = (num_micro_batches, micro_batch_size).")
    return jnp.asarray(mask)
