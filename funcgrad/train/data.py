"""Real data without downloads: scikit-learn's bundled digits set, split and standardised.

The digits set is 1,797 grey 8x8 images of handwritten digits (64 features, 10 classes) that
ship inside scikit-learn, so nothing is fetched at run time. Batching it (or any arrays) is
`funcgrad.Batches` (`funcgrad.train.batching`).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from typing import NamedTuple

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
