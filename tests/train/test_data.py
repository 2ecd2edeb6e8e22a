"""The digits split and its standardisation (the batching: tests/train/test_batching.py)."""
import re
import sys

import numpy as np
import pytest

import funcgrad as fg


@pytest.fixture(scope="module")
def digits():
    return fg.load_digits(seed=0)


def test_split_sizes_and_classes(digits):
    # 1797 examples; sklearn's train_test_split puts ceil(0.2 * 1797) = 360 in the test split.
    assert digits.x_train.shape == (1437, 64) and digits.x_test.shape == (360, 64)
    assert digits.y_train.shape == (1437,) and digits.num_classes == 10
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int32
    # Stratified: each of the 10 classes has 35 or 36 of the 360 test examples (~178/1797 * 360).
    assert set(np.bincount(digits.y_test)) <= {35, 36, 37}


def test_standardised_with_train_statistics_only(digits):
    from sklearn.datasets import load_digits
    x, _ = load_digits(return_X_y=True)
    # Second method: undo the transform and compare the statistics with NumPy's on raw train rows.
    raw_train = digits.x_train.astype(np.float64) * digits.scale + digits.mean
    np.testing.assert_allclose(digits.mean, raw_train.mean(axis=0), atol=1e-4)
    varying = raw_train.std(axis=0) > 0
    np.testing.assert_allclose(digits.x_train[:, varying].mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(digits.x_train[:, varying].std(axis=0), 1.0, atol=1e-4)
    # The recovered raw rows are real digits rows (pixel values are integers 0..16).
    np.testing.assert_allclose(raw_train, np.round(raw_train), atol=1e-4)
    assert raw_train.shape[0] + digits.x_test.shape[0] == x.shape[0]


def test_split_is_seeded(digits):
    again = fg.load_digits(seed=0)
    other = fg.load_digits(seed=1)
    np.testing.assert_array_equal(digits.x_test, again.x_test)
    assert not np.array_equal(digits.y_test, other.y_test)


def test_bad_arguments():
    with pytest.raises(ValueError, match="test_size must be in"):
        fg.load_digits(test_size=1.5)


def test_missing_scikit_learn_says_how_to_install(monkeypatch):
    # scikit-learn is a dependency of funcgrad (pyproject): missing, the install is broken,
    # and the message gives the pip command for it (not an extra) with the import's error.
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"one of funcgrad's dependencies, and importing it "
                                          r"failed \(import of sklearn.datasets halted.*"
                                          r"pip install 'scikit-learn>=1.3'$"):
        fg.load_digits()


def test_a_plain_install_has_what_funcgrad_train_needs():
    # `pip install funcgrad` must be enough for `funcgrad train` (digits via scikit-learn, the
    # plot via matplotlib): both are main dependencies, and [examples] stays as an (empty)
    # alias so that existing install commands keep working. Read from pyproject.toml, the
    # source of the wheel's metadata (the wheel check builds and installs it).
    import pathlib
    import tomllib
    project = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    names = lambda specs: {re.split(r"[<>=!~\[;]", s, maxsplit=1)[0].strip() for s in specs}
    assert {"scikit-learn", "matplotlib"} <= names(project["project"]["dependencies"])
    assert project["project"]["optional-dependencies"]["examples"] == []


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


_SKLEARN = ("sklearn.datasets", "sklearn.model_selection", "sklearn.preprocessing")


def test_cached_split_is_sklearns_bit_for_bit_and_skips_sklearn(digits, tmp_path, monkeypatch):
    first = fg.load_digits(seed=0, cache_dir=tmp_path)  # built by scikit-learn, then stored
    (stored,) = tmp_path.iterdir()
    for name in _SKLEARN:  # a second run must not import scikit-learn: any import now fails
        monkeypatch.setitem(sys.modules, name, None)
    again = fg.load_digits(seed=0, cache_dir=tmp_path)
    for field in digits._fields:  # `digits` came from scikit-learn without a cache
        assert _same_bits(getattr(first, field), getattr(digits, field)), field
        assert _same_bits(getattr(again, field), getattr(digits, field)), field
    assert list(tmp_path.iterdir()) == [stored]
    with pytest.raises(ImportError):  # other settings are not in the cache: scikit-learn again
        fg.load_digits(seed=1, cache_dir=tmp_path)


def test_corrupted_or_foreign_cache_file_is_rebuilt(digits, tmp_path):
    fg.load_digits(seed=1, cache_dir=tmp_path / "other")
    (foreign,) = (tmp_path / "other").iterdir()
    fg.load_digits(seed=0, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.npz")
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1  # one bit inside x_train's data: the zip's CRC-32 catches it
    for bad in (b"not an npz", good[: len(good) // 2], bytes(flipped), foreign.read_bytes()):
        path.write_bytes(bad)
        loaded = fg.load_digits(seed=0, cache_dir=tmp_path)
        assert all(_same_bits(getattr(loaded, f), getattr(digits, f)) for f in digits._fields)
        assert path.read_bytes() == good  # rewritten whole (np.savez is deterministic)


def test_unwritable_cache_folder_still_loads(digits, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    loaded = fg.load_digits(seed=0, cache_dir=blocker / "cache")
    assert all(_same_bits(getattr(loaded, f), getattr(digits, f)) for f in digits._fields)
