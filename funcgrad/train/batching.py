"""What training reads: a dataset cut into mini-batches (`Batches`), or a loader, both taken in
through one door, `as_source`, by `funcgrad.fit` and `funcgrad.doctor`.

* **`Batches`**: arrays with a leading example axis, in any pytree, with a batch size and a
  seeded order per epoch. ``Batches(x, y, batch_size=32)`` is ``Batches({"x": x, "y": y},
  batch_size=32)``. ``batches.epoch(e)`` yields the batches of pass `e` on the host; `fit`
  puts the arrays on the device once and draws the same order there.
* **a loader**: an iterable of batch pytrees (a list of batches, a generator, a grain or torch
  ``DataLoader`` yielding NumPy arrays), iterated once per epoch, or a function
  ``epoch -> iterable`` (epoch 0-based). A list is a sequence of batches, never a dataset.

Errors name the leaf by its path (``data['image']``) and say what was expected.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def rows(tree: Any, name: str = "x") -> int:
    """The number of examples in `tree`: the common leading length of its leaves.

    Args:
      tree: an array, or a pytree of arrays (e.g. ``{"image": (n, 8, 8), "meta": (n, 3)}``
        for a model with several inputs); every leaf holds one row per example.
      name: what to call `tree` in an error (``x``, ``y``, ``data``).
    Returns:
      n, an int.
    Raises:
      ValueError: if `tree` has no leaves, a leaf is a scalar, or two leaves have different
        leading lengths (the message names both by their pytree paths).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        raise ValueError(f"{name} has no arrays (got {tree!r}); pass an array, or a dict of "
                         "arrays with one row per example.")
    first = None
    for path, leaf in flat:
        where = name + jax.tree_util.keystr(path)
        if np.ndim(leaf) == 0:
            raise ValueError(f"{where} is a scalar, not one row per example; give every leaf a "
                             "leading axis of length n (the number of examples).")
        n = np.shape(leaf)[0]
        if first is None:
            first = (where, n)
        elif n != first[1]:
            raise ValueError(f"{where} has {n} rows but {first[0]} has {first[1]}: the leaves "
                             f"have different numbers of examples; every leaf of {name} needs "
                             "one row per example, the same n.")
    assert first is not None  # flat has a leaf (checked above)
    return first[1]


def epoch_order(seed: int, epoch: int, n: int) -> jax.Array:
    """The example order of one epoch: a permutation of ``range(n)``, int32, drawn on the
    default device from ``fold_in(key(seed), epoch)`` (threefry: the same on every backend).
    `Batches.order` reads it back; `fit` draws it inside its compiled chunks (`device_order`)."""
    return device_order(jax.random.key(seed), np.int32(epoch), n)


@functools.partial(jax.jit, static_argnums=2)
def device_order(key: jax.Array, epoch: jax.Array, n: int) -> jax.Array:
    """`epoch_order` from the seed's key, traceable: ``permutation(fold_in(key, epoch), n)``."""
    return jax.random.permutation(jax.random.fold_in(key, epoch), n).astype(jnp.int32)


def _int_at_least(value: Any, low: int) -> bool:
    return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and bool(value >= low))


@dataclasses.dataclass(frozen=True, eq=False, init=False, repr=False)
class Batches:
    """A dataset cut into mini-batches: arrays with a leading example axis and how to batch
    them. `funcgrad.fit` takes it as its data (the arrays go to the device once and each
    epoch's order is drawn there); ``epoch(e)`` yields the same batches on the host.

    Each epoch visits the examples in ``order(epoch)``: a permutation drawn from
    ``fold_in(key(seed), epoch)`` (or ``range(n)`` without `shuffle`), cut into runs of
    `batch_size`; the last, smaller batch is kept unless `drop_last`.

    Attributes:
      data: the dataset, a pytree of arrays whose leaves share a leading length n;
        ``Batches(x, y, ...)`` stores ``{"x": x, "y": y}``. Leaves that are not NumPy or JAX
        arrays (lists) become NumPy arrays.
      batch_size: examples per batch, a positive int.
      seed: seeds the order with the epoch, an int >= 0.
      shuffle: False takes the examples in order every epoch.
      drop_last: True leaves out each epoch's last batch when it is smaller than
        `batch_size` (every batch then has one shape).
      n: the number of examples (read only).
    Raises:
      ValueError: at construction: leaves with different numbers of rows (named by their
        paths), no examples, a `batch_size` or `seed` out of range.
      TypeError: `shuffle` or `drop_last` not a bool.
    Example:
      >>> b = fg.Batches(np.arange(10.0), np.arange(10) % 2, batch_size=4, shuffle=False)
      >>> tuple(len(batch["y"]) for batch in b.epoch(0))   # the last batch is smaller
      (4, 4, 2)
      >>> len(b), b.n
      (3, 10)
    """
    data: PyTree
    batch_size: int
    seed: int
    shuffle: bool
    drop_last: bool

    def __init__(self, data: PyTree, y: PyTree = None, *, batch_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):
        if y is not None:  # Batches(x, y): the classic two-array form
            # Python lists, as from a CSV reader, become arrays; a dict (several inputs) stays.
            x = np.asarray(data) if isinstance(data, (list, tuple)) else data
            y = np.asarray(y) if isinstance(y, (list, tuple)) else y
            try:
                n, m = rows(x, "x"), rows(y, "y")
            except ValueError as error:
                raise ValueError(f"Batches: {error}") from None
            if m != n:
                raise ValueError(f"Batches: x has {n} rows but y has {m}; they must match "
                                 "(one row per example).")
            data = {"x": x, "y": y}
        if data is None or not jax.tree.leaves(data):
            raise ValueError(f"Batches: data has no arrays (got {data!r}); pass arrays with one "
                             "row per example, e.g. {'x': x, 'y': y}.")
        data = jax.tree.map(lambda a: a if isinstance(a, (jax.Array, np.ndarray))
                            else np.asarray(a), data)
        try:
            n = rows(data, "data")
        except ValueError as error:
            raise ValueError(f"Batches: {error}") from None
        if n == 0:
            raise ValueError("Batches: data has no examples (a leading axis of 0); there is "
                             "nothing to train on.")
        if not _int_at_least(batch_size, 1):
            raise ValueError(f"Batches: batch_size must be a positive int, got {batch_size!r}.")
        if not _int_at_least(seed, 0):
            raise ValueError(f"Batches: seed must be an int >= 0, got {seed!r}.")
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"Batches: {name} must be True or False, got {flag!r}.")
        if drop_last and n < batch_size:
            raise ValueError(f"Batches: drop_last=True with {n} examples and batch_size="
                             f"{batch_size} leaves no batch at all; use a batch_size of at most "
                             f"{n}, or drop_last=False.")
        for name, value in (("data", data), ("batch_size", int(batch_size)), ("seed", int(seed)),
                            ("shuffle", bool(shuffle)), ("drop_last", bool(drop_last))):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_n", n)

    _n: int = dataclasses.field(init=False, repr=False)  # set by __init__: see `n`

    @property
    def n(self) -> int:
        """The number of examples: the leaves' common leading length."""
        return self._n

    @property
    def used(self) -> int:
        """The examples each epoch visits: n, less the last partial batch with `drop_last`."""
        return self.n - self.n % self.batch_size if self.drop_last else self.n

    def __len__(self) -> int:
        """Batches per epoch: ceil(n / batch_size), or floor with `drop_last`."""
        return math.ceil(self.used / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order of the examples (0-based epoch): ``(n,)`` int32 on the host,
        the permutation `epoch_order` draws (``arange(n)`` without `shuffle`)."""
        if not _int_at_least(epoch, 0):
            raise ValueError(f"Batches: epoch must be an int >= 0, got {epoch!r}.")
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int32)
        return np.asarray(epoch_order(self.seed, int(epoch), self.n))

    def epoch(self, epoch: int) -> Iterator[PyTree]:
        """The batches of pass `epoch` (0-based), each of `data`'s structure with up to
        `batch_size` rows per leaf, taken in ``order(epoch)``. ``batches.epoch`` is itself a
        loader (``epoch -> iterable``): `fit` given it trains on the same batches, made on the
        host.

        Raises:
          ValueError: at the call, for an `epoch` that is not an int >= 0.
        """
        order, size, stop = self.order(epoch), self.batch_size, self.used
        return (jax.tree.map(lambda leaf, idx=order[start:start + size]: leaf[idx], self.data)
                for start in range(0, stop, size))

    def __repr__(self) -> str:
        leaves = jax.tree.map(lambda a: _Shown(f"{tuple(np.shape(a))} {np.result_type(a)}"),
                              self.data)
        extra = "".join(f", {k}={getattr(self, k)}" for k, default in
                        (("shuffle", True), ("drop_last", False)) if getattr(self, k) != default)
        return (f"Batches({self.n} examples {leaves}, batch_size={self.batch_size}, "
                f"seed={self.seed}{extra})")


class _Shown(str):
    """A leaf's description, shown without quotes inside a pytree's repr."""

    def __repr__(self) -> str:
        return str(self)


class Source:
    """Training data as `as_source` took it in: a `Batches` (arrays), or a loader.

    Attributes:
      batches: the `Batches`, or None (a loader).
      loader: the iterable or ``epoch -> iterable`` (a loader), or None.
      tree, n, batch_size: the `Batches`' data, examples and batch size (None for a loader).
    """

    def __init__(self, *, batches: Batches | None = None, loader: Any = None):
        self.batches, self.loader = batches, loader
        self.tree = None if batches is None else batches.data
        self.n = None if batches is None else batches.n
        self.batch_size = None if batches is None else batches.batch_size
        self._first: PyTree = None  # the first batch seen from a loader (structure check)

    def steps_per_epoch(self, accumulate: int = 1) -> int:
        """Steps (updates) per epoch of array data: ceil(batches / accumulate)."""
        assert self.batches is not None, "array data only"
        return math.ceil(len(self.batches) / accumulate)

    def iterate(self, epoch: int, where: str = "fit") -> Iterator[PyTree]:
        """The loader's batches for `epoch` (0-based), each checked against the first."""
        got = self.loader(epoch) if is_function(self.loader) else self.loader
        if isinstance(got, Mapping) or hasattr(got, "shape") or not isinstance(got, Iterable):
            raise TypeError(f"{where}: data(epoch) returned a {type(got).__name__}; a function "
                            "passed as data must return an iterable of batches for that epoch.")
        for i, batch in enumerate(got):
            yield self._checked(batch, epoch, i, where)

    def _checked(self, batch: PyTree, epoch: int, i: int, where: str) -> PyTree:
        at = f"batch {i} of epoch {epoch + 1}"
        batch = jax.tree.map(_as_array, batch)
        try:
            rows(batch, "batch")
        except ValueError as error:
            lists = any(isinstance(node, list) for node in jax.tree.leaves(
                batch, is_leaf=lambda x: isinstance(x, list)))
            raise ValueError(f"{where}: {at} of the loader: {error}"
                             + (" (nested Python lists are read as trees of scalars: make "
                                "each leaf an array with np.asarray)" if lists else "")) from None
        if self._first is None:
            self._first = batch
        elif jax.tree.structure(batch) != jax.tree.structure(self._first):
            raise ValueError(
                f"{where}: {at} of the loader has the structure {jax.tree.structure(batch)}, "
                f"but the first batch had {jax.tree.structure(self._first)}; every batch must "
                "hold the same leaves.")
        return batch


def is_function(obj: Any) -> bool:
    """Whether `obj` is a loader given as a function ``epoch -> iterable`` (callable, and not
    itself an iterable of batches)."""
    return callable(obj) and not isinstance(obj, Iterable)


def _as_array(leaf: Any) -> Any:
    if isinstance(leaf, (jax.Array, np.ndarray)):
        return leaf
    if hasattr(leaf, "numpy") and hasattr(leaf, "detach"):  # a torch tensor
        return leaf.detach().cpu().numpy()
    return np.asarray(leaf)


_NEEDS_BATCHES = (
    "{where}: data is a pytree of arrays, and {where} needs to know how to cut it into "
    "batches: pass fg.Batches(data, batch_size=32) (with seed=, shuffle=, drop_last= as "
    "needed), or fg.Batches(x, y, batch_size=32) for batches {{'x': ..., 'y': ...}}.")


def as_source(data: Any, *, where: str = "fit", epochs: int | None = None,
              batch_size: int | None = None, seed: int = 0) -> Source:
    """The one door for training data: `data` as a checked `Source`.

    Args:
      data: a `Batches`; a loader (see the module docstring); or a pytree of arrays, which
        needs `batch_size` (a caller's default, e.g. `funcgrad.doctor`'s).
      where: the caller's name, for the errors.
      epochs: the passes the caller makes, if known (an iterator allows only one).
      batch_size: how to batch a pytree of arrays (a `Batches`' field); None: such data is
        refused with the fix.
      seed: the order's seed for a pytree of arrays (a `Batches`' field).
    Raises:
      ValueError: arrays without a batch size (the message shows `Batches`), no examples,
        leaves with different row counts (named), an iterator (used up after one pass) with
        more than one epoch.
    """
    if isinstance(data, Batches):
        return Source(batches=data)
    if isinstance(data, list) or (not isinstance(data, (Mapping, tuple)) and not hasattr(
            data, "shape") and (isinstance(data, Iterable) or is_function(data))):
        if isinstance(data, Iterator) and epochs is not None and epochs > 1:
            raise ValueError(
                f"{where}: data is an iterator ({type(data).__name__}), which is used up after "
                f"one pass, and epochs={epochs}. Pass a re-iterable (a list of batches, a torch "
                "DataLoader) or a function epoch -> iterable of batches.")
        return Source(loader=data)
    if data is None or not jax.tree.leaves(data):
        raise ValueError(f"{where}: data has no arrays (got {data!r}); pass "
                         "fg.Batches(arrays, batch_size=...) or a loader.")
    if batch_size is None:
        try:  # a malformed dataset is named first: the fix for it comes before the batching
            rows(data, "data")
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        raise ValueError(_NEEDS_BATCHES.format(where=where))
    try:
        return Source(batches=Batches(data, batch_size=batch_size, seed=seed))
    except (ValueError, TypeError) as error:
        raise type(error)(f"{where}: {str(error).removeprefix('Batches: ')}") from None


def take_rows(tree: PyTree, index: np.ndarray) -> PyTree:
    """The rows `index` of every leaf (host NumPy indexing; device arrays are read back)."""
    return jax.tree.map(lambda leaf: np.asarray(leaf)[index], tree)


def split_for_accumulation(batch: PyTree, k: int) -> PyTree:
    """A batch of k*m rows as k micro-batches ``(k, m, ...)``."""
    return jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)
