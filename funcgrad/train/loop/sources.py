"""What `fit` trains on: arrays with a leading example axis in any pytree, or a loader.

`as_source` turns `fit`'s ``data`` (and ``y``) into a `Source`:

* **arrays**: a pytree (dict, tuple, NamedTuple, or one array) whose leaves all have the same
  leading length n, one row per example; ``fit(step, state, x, y)`` is
  ``data = {"x": x, "y": y}``. Batches have the same structure with ``batch_size`` rows.
* **a loader**: an iterable of batch pytrees (a list of batches, a generator, a grain or torch
  ``DataLoader`` yielding NumPy arrays), iterated once per epoch, or a function
  ``epoch -> iterable`` (epoch 0-based). A list is a sequence of batches, never a dataset.

Errors name the leaf by its path (``data['image']``) and say what was expected.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from funcgrad.train.data import rows

PyTree = Any


class Source:
    """The training data of a `fit` run (see the module docstring).

    Attributes:
      tree: the dataset's pytree of arrays (arrays), or None (a loader).
      n: its number of examples, or None (a loader).
      batch_size: examples per batch (arrays), or None.
      loader: the iterable or ``epoch -> iterable`` (a loader), or None.
    """

    def __init__(self, *, tree: PyTree = None, n: int | None = None,
                 batch_size: int | None = None, loader: Any = None):
        self.tree, self.n, self.batch_size, self.loader = tree, n, batch_size, loader
        self._first: PyTree = None  # the first batch seen from a loader (structure check)

    def steps_per_epoch(self, accumulate: int = 1) -> int:
        """Steps (updates) per epoch of array data: ceil(ceil(n / batch) / accumulate)."""
        assert self.n is not None and self.batch_size is not None, "array data only"
        return math.ceil(math.ceil(self.n / self.batch_size) / accumulate)

    def iterate(self, epoch: int) -> Iterator[PyTree]:
        """The loader's batches for `epoch` (0-based), each checked against the first."""
        got = self.loader(epoch) if _is_function(self.loader) else self.loader
        if isinstance(got, Mapping) or hasattr(got, "shape") or not isinstance(got, Iterable):
            raise TypeError(f"fit: data(epoch) returned a {type(got).__name__}; a function "
                            "passed as data must return an iterable of batches for that epoch.")
        for i, batch in enumerate(got):
            yield self._checked(batch, epoch, i)

    def _checked(self, batch: PyTree, epoch: int, i: int) -> PyTree:
        where = f"batch {i} of epoch {epoch + 1}"
        batch = jax.tree.map(_as_array, batch)
        try:
            rows(batch, "batch")
        except ValueError as error:
            lists = any(isinstance(node, list) for node in jax.tree.leaves(
                batch, is_leaf=lambda x: isinstance(x, list)))
            raise ValueError(f"fit: {where} of the loader: {error}"
                             + (" (nested Python lists are read as trees of scalars: make "
                                "each leaf an array with np.asarray)" if lists else "")) from None
        if self._first is None:
            self._first = batch
        elif jax.tree.structure(batch) != jax.tree.structure(self._first):
            raise ValueError(
                f"fit: {where} of the loader has the structure {jax.tree.structure(batch)}, "
                f"but the first batch had {jax.tree.structure(self._first)}; every batch must "
                "hold the same leaves.")
        return batch


def _is_function(obj: Any) -> bool:
    return callable(obj) and not isinstance(obj, Iterable)


def _as_array(leaf: Any) -> Any:
    if isinstance(leaf, (jax.Array, np.ndarray)):
        return leaf
    if hasattr(leaf, "numpy") and hasattr(leaf, "detach"):  # a torch tensor
        return leaf.detach().cpu().numpy()
    return np.asarray(leaf)


def as_source(data: Any, y: PyTree = None, *, batch_size: Any, epochs: int) -> Source:
    """`fit`'s data as a `Source`, checked (see the module docstring).

    Raises:
      ValueError: array data without a positive int `batch_size`, no examples, leaves with
        different row counts (named), an iterator (used up after one pass) with more than one
        epoch, a `y` given with a loader.
      TypeError: data that is neither arrays nor an iterable of batches.
    """
    if y is not None:  # fit(step, state, x, y): the classic two-array form
        # Python lists, as from a CSV reader, become arrays; a dict (several inputs) stays.
        x = np.asarray(data) if isinstance(data, (list, tuple)) else data
        y = np.asarray(y) if isinstance(y, (list, tuple)) else y
        try:
            n = rows(x, "x")
            if rows(y, "y") != n:
                raise ValueError(f"x has {n} rows but y has {rows(y, 'y')}; they must match "
                                 "(one row per example).")
        except ValueError as error:
            raise ValueError(f"fit: {error}") from None
        return _arrays({"x": x, "y": y}, n, batch_size, "x")
    if isinstance(data, list) or (not isinstance(data, (Mapping, tuple)) and not hasattr(
            data, "shape") and (isinstance(data, Iterable) or _is_function(data))):
        if batch_size is not None:
            raise ValueError(
                "fit: batch_size applies to array data, and data here is read as a loader"
                + (" (a list is a sequence of batches, not [x, y]: pass fit(step, state, x, y, "
                   "batch_size=...) or a tuple (x, y) or a dict {'x': x, 'y': y})"
                   if isinstance(data, list) else "")
                + "; a loader's batches keep their own size: drop batch_size=.")
        if isinstance(data, Iterator) and epochs > 1:
            raise ValueError(
                f"fit: data is an iterator ({type(data).__name__}), which is used up after one "
                f"pass, and epochs={epochs}. Pass a re-iterable (a list of batches, a torch "
                "DataLoader) or a function epoch -> iterable of batches.")
        return Source(loader=data)
    if data is None or not jax.tree.leaves(data):
        raise ValueError(f"fit: data has no arrays (got {data!r}); pass arrays with one row "
                         "per example (a dict such as {'x': x, 'y': y}) or a loader.")
    tree = jax.tree.map(lambda a: a if isinstance(a, (jax.Array, np.ndarray)) else
                        np.asarray(a), data)
    try:
        n = rows(tree, "data")
    except ValueError as error:
        raise ValueError(f"fit: {error}") from None
    return _arrays(tree, n, batch_size, "data")


def _arrays(tree: PyTree, n: int, batch_size: Any, name: str) -> Source:
    if n == 0:
        raise ValueError(f"fit: {name} is empty; there is nothing to train on.")
    if batch_size is None:
        raise ValueError("fit: array data needs batch_size= (examples per step).")
    if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
            or batch_size < 1):
        raise ValueError(f"fit: batch_size must be a positive int, got {batch_size!r}.")
    return Source(tree=tree, n=n, batch_size=int(batch_size))


def take_rows(tree: PyTree, index: np.ndarray) -> PyTree:
    """The rows `index` of every leaf (host NumPy indexing; device arrays are read back)."""
    return jax.tree.map(lambda leaf: np.asarray(leaf)[index], tree)


def split_for_accumulation(batch: PyTree, k: int) -> PyTree:
    """A batch of k*m rows as k micro-batches ``(k, m, ...)``."""
    return jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)
