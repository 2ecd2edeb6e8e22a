"""Real data without downloads: scikit-learn's bundled digits set, split, standardised and batched.

The digits set is 1,797 grey 8x8 images of handwritten digits (64 features, 10 classes) that
ship inside scikit-learn, so nothing is fetched at run time.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

_INSTALL_HINT = (
    "load_digits needs scikit-learn, one of funcgrad's dependencies, and importing it failed "
    "({error}): this environment's installation is incomplete or broken. Install it with: "
    "pip install 'scikit-learn>=1.3'")


class Dataset(NamedTuple):
    """A train/test split held as NumPy arrays on the host.

    Attributes:
      x_train: (n_train, features) float32, standardised with the train split's statistics.
      y_train: (n_train,) int32 class labels.
      x_test: (n_test, features) float32, standardised with the *train* statistics.
      y_test: (n_test,) int32 class labels.
      mean, scale: (features,) float64, the per-feature statistics fitted on the train split
        (``scale`` is 1 for constant features, as in sklearn's StandardScaler).
    """
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    mean: np.ndarray
    scale: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(*, test_size: float = 0.2, seed: int = 0,
                cache_dir: str | os.PathLike | None = None) -> Dataset:
    """Returns scikit-learn's digits set split into train and test, standardised on train only.

    The split is stratified by class and seeded, so the same `seed` gives the same split on
    every machine. Standardisation (zero mean, unit variance per feature) is fitted on the
    train split alone, so nothing about the test split leaks into training.

    Args:
      test_size: fraction of the 1,797 examples held out, in (0, 1). The default gives
        1,437 train and 360 test examples.
      seed: seed of the split.
      cache_dir: a folder for the split arrays (an ``.npz`` named by `test_size`, `seed` and
        the scikit-learn and NumPy versions), or None (the default) for no cache. A run that
        finds its file there reads it without importing scikit-learn (whose import is ~2.5 s
        of a 3 s ``funcgrad train``); a missing, corrupted or foreign file is rebuilt from
        scikit-learn, and a folder that cannot be written only means no cache.
    Returns:
      a `Dataset` with 64 features and 10 classes.
    Raises:
      ImportError: if scikit-learn is not installed (the message says how to install it).
      ValueError: if `test_size` is not in (0, 1).
    """
    if not 0.0 < test_size < 1.0:
        raise ValueError(f"load_digits: test_size must be in (0, 1), got {test_size!r}.")
    if cache_dir is None:
        return _split_digits(test_size, seed)
    key = _cache_key(test_size, seed)
    path = os.path.join(cache_dir, f"digits-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")
    cached = _read_cached(path, key)
    if cached is not None:
        return cached
    data = _split_digits(test_size, seed)
    _write_cached(path, key, data)
    return data


def _split_digits(test_size: float, seed: int) -> Dataset:
    """`load_digits` without a cache: scikit-learn's split and scaler."""
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
        from sklearn.model_selection import train_test_split
        from sklearn.preprocessing import StandardScaler
    except ImportError as e:  # pragma: no cover - exercised by hiding sklearn in a test
        raise ImportError(_INSTALL_HINT.format(error=e)) from e
    x, y = _sk_load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)
    return Dataset(
        x_train=scaler.transform(x_tr).astype(np.float32),
        y_train=y_tr.astype(np.int32),
        x_test=scaler.transform(x_te).astype(np.float32),
        y_test=y_te.astype(np.int32),
        mean=scaler.mean_, scale=scaler.scale_)


#: Bumped when what `_split_digits` computes changes, so older cache files are not trusted.
_CACHE_FORMAT = 1
#: The arrays of a cached split: (dtype, number of columns or None for a vector).
_CACHED = {"x_train": ("float32", 64), "y_train": ("int32", None), "x_test": ("float32", 64),
           "y_test": ("int32", None), "mean": ("float64", None), "scale": ("float64", None)}


def _cache_key(test_size: float, seed: int) -> str:
    """Everything that determines the split's arrays, as one string: stored in the cache file
    and checked when it is read (the file name is only a hash of it). Versions come from the
    installed packages' metadata, which does not import them."""
    from importlib import metadata
    try:
        sklearn = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        sklearn = "none"  # `_split_digits` then raises the install hint
    return (f"funcgrad-digits/{_CACHE_FORMAT} test_size={float(test_size)!r} seed={int(seed)} "
            f"scikit-learn={sklearn} numpy={np.__version__}")


def _read_cached(path: str, key: str) -> Dataset | None:
    """The split stored at `path` if it is whole and was made for `key`, else None (missing,
    unreadable, truncated or corrupted -- the zip's CRC-32 is checked as each array is read --
    or written for other settings or by other code)."""
    try:
        with open(path, "rb") as f:  # ours to close, whatever np.load makes of the bytes
            stored = np.load(f, allow_pickle=False)
            if not isinstance(stored, np.lib.npyio.NpzFile):  # a lone .npy array
                return None
            with stored:
                if set(stored.files) != {"key", *_CACHED} or str(stored["key"]) != key:
                    return None
                arrays = {name: stored[name] for name in _CACHED}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return None
    n = len(arrays["x_train"]) + len(arrays["x_test"])
    for name, (dtype, columns) in _CACHED.items():
        a = arrays[name]
        if a.dtype != dtype or a.ndim != (1 if columns is None else 2) \
                or (columns is not None and a.shape[1] != columns):
            return None
    if (n != 1797 or len(arrays["y_train"]) != len(arrays["x_train"])
            or len(arrays["y_test"]) != len(arrays["x_test"])
            or arrays["mean"].shape != (64,) or arrays["scale"].shape != (64,)):
        return None
    return Dataset(**arrays)


def _write_cached(path: str, key: str, data: Dataset) -> None:
    """Stores `data` at `path` atomically (a temporary file renamed into place, so a reader
    never sees half a file); a folder that cannot be made or written is skipped silently."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npz.tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, key=np.array(key), **data._asdict())
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass


def rows(tree: Any, name: str = "x") -> int:
    """The number of examples in `tree`: the common leading length of its leaves.

    Args:
      tree: an array, or a pytree of arrays (e.g. ``{"image": (n, 8, 8), "meta": (n, 3)}``
        for a model with several inputs); every leaf holds one row per example.
      name: what to call `tree` in an error (``x``, ``y``).
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
            raise ValueError(f"{where} has {n} rows but {first[0]} has {first[1]}; every leaf "
                             f"of {name} needs one row per example, the same n.")
    assert first is not None  # flat has a leaf (checked above)
    return first[1]


def batches(x: Any, y: Any, *, batch_size: int, seed: int = 0, epoch: int = 0,
            shuffle: bool = True, drop_last: bool = False) -> Iterator[dict[str, Any]]:
    """Yields mini-batches ``{"x": (b, ...), "y": (b, ...)}`` in a seeded order.

    The order depends only on ``(seed, epoch)``, so an epoch can be replayed exactly.

    Args:
      x: an array with a leading length n, or a pytree of them (a model with several inputs
        takes e.g. ``x = {"image": (n, 8, 8), "meta": (n, 3)}``; each batch then holds the
        same structure with b rows per leaf). Rows are counted on the leaves.
      y: as `x`, with the same leading length n.
      batch_size: examples per batch, a positive int.
      seed: with `epoch`, seeds the permutation (``jax.random.permutation`` of
        ``fold_in(key(seed), epoch)``: the order `funcgrad.train.fit` draws on the device for
        array data, so a loader made of these batches trains exactly as the arrays).
      epoch: with `seed`, seeds the permutation; an index here (0 for the first pass;
        `funcgrad.train.fit` numbers epochs from 1 in what it shows and passes ``epoch - 1``).
      shuffle: if False, batches are taken in order.
      drop_last: if True, a final batch smaller than `batch_size` is not yielded (so every
        batch has one shape and a jitted step compiles once).
    Raises:
      ValueError: at the call, not at the first batch: if the lengths differ (the message
        names the leaves), `batch_size` is not a positive int, or `seed` or `epoch` is
        negative.
    """
    n = rows(x, "x")
    m = rows(y, "y")
    if m != n:
        raise ValueError(f"batches: x has {n} rows but y has {m}; they must match.")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batches: batch_size must be a positive int, got {batch_size!r}.")
    for name, value in (("seed", seed), ("epoch", epoch)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"batches: {name} must be an int >= 0, got {value!r}.")
    if shuffle:  # the order fit draws on the device for array data (threefry, any backend)
        from funcgrad.train.loop._chunks import epoch_order
        order = np.asarray(epoch_order(int(seed), int(epoch), n))
    else:
        order = np.arange(n)
    stop = n - n % batch_size if drop_last else n
    take = lambda tree, idx: jax.tree.map(lambda leaf: leaf[idx], tree)
    return ({"x": take(x, idx), "y": take(y, idx)}
            for idx in (order[start:start + batch_size] for start in range(0, stop, batch_size)))
