"""`fg.Batches`, the one data value of `fit` (and the doctor): which rows each batch holds,
computed here by hand from the documented order (``permutation(fold_in(key(seed), epoch), n)``
cut into runs of batch_size), and `fit` trained on them equals `fit` trained on a list of the
hand-made batches (the loader path, compiled apart: float32 rounding)."""
import jax
import numpy as np
import optax
import pytest

import funcgrad as fg

N, F, C = 48, 6, 3
_rng = np.random.default_rng(2)
X = _rng.standard_normal((N, F)).astype(np.float32)
Y = _rng.integers(0, C, N).astype(np.int32)


def _by_hand(seed, epoch, n):
    """The documented order, from JAX's own calls (not funcgrad's)."""
    key = jax.random.fold_in(jax.random.key(seed), epoch)
    return np.asarray(jax.random.permutation(key, n))


def _runs(order, size, stop=None):
    stop = len(order) if stop is None else stop
    return [order[i:min(i + size, stop)] for i in range(0, stop, size)]


def test_the_batches_are_the_seeded_permutation_cut_into_runs():
    x, y = np.arange(10.0)[:, None], np.arange(10) * 10
    data = fg.Batches(x, y, batch_size=4, seed=3)
    for epoch in (0, 1):
        expected = _runs(_by_hand(3, epoch, 10), 4)
        got = list(data.epoch(epoch))
        assert [len(b["y"]) for b in got] == [4, 4, 2] and len(data) == 3
        for batch, idx in zip(got, expected, strict=True):
            np.testing.assert_array_equal(batch["x"], x[idx])
            np.testing.assert_array_equal(batch["y"], y[idx])
        np.testing.assert_array_equal(data.order(epoch), _by_hand(3, epoch, 10))
    assert not np.array_equal(data.order(0), data.order(1))  # a new order each epoch
    # Without shuffle: in order; with drop_last: the last, partial batch left out.
    ordered = fg.Batches(x, y, batch_size=4, shuffle=False)
    assert [b["y"].tolist() for b in ordered.epoch(5)] == [[0, 10, 20, 30], [40, 50, 60, 70],
                                                           [80, 90]]
    dropped = fg.Batches(x, y, batch_size=4, seed=3, drop_last=True)
    assert len(dropped) == 2
    for batch, idx in zip(dropped.epoch(1), _runs(_by_hand(3, 1, 10), 4, stop=8), strict=True):
        np.testing.assert_array_equal(batch["y"], y[idx])


def test_any_pytree_is_batched_in_its_own_structure():
    x = {"image": np.arange(24.0).reshape(6, 2, 2), "meta": np.arange(6)}
    pair = fg.Batches(x, np.arange(6) + 100, batch_size=4, shuffle=False)
    as_dict = fg.Batches({"x": x, "y": np.arange(6) + 100}, batch_size=4, shuffle=False)
    for a, b in zip(pair.epoch(0), as_dict.epoch(0), strict=True):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(u, v)
    first = next(iter(fg.Batches((X, Y), batch_size=5, shuffle=False).epoch(0)))
    assert isinstance(first, tuple) and first[0].shape == (5, F) and first[1].shape == (5,)
    lists = fg.Batches([1.0, 2.0, 3.0], [0, 1, 0], batch_size=2, shuffle=False)  # a CSV's rows
    assert [b["x"].tolist() for b in lists.epoch(0)] == [[1.0, 2.0], [3.0]]
    assert repr(pair) == ("Batches(6 examples {'x': {'image': (6, 2, 2) float64, 'meta': (6,) "
                          "int64}, 'y': (6,) int64}, batch_size=4, seed=0, shuffle=False)")


@pytest.mark.parametrize("make, exc, match", [
    (lambda: fg.Batches(np.zeros((3, 1)), np.zeros(2), batch_size=1), ValueError,
     "x has 3 rows but y has 2"),
    (lambda: fg.Batches({"a": np.zeros(3), "b": np.zeros(4)}, batch_size=1), ValueError,
     r"data\['b'\] has 4 rows but data\['a'\] has 3: the leaves have different numbers"),
    (lambda: fg.Batches(np.zeros((3, 1)), np.zeros(3), batch_size=0), ValueError,
     "batch_size must be a positive int, got 0"),
    (lambda: fg.Batches(np.zeros(3), batch_size=True), ValueError,
     "batch_size must be a positive int, got True"),
    (lambda: fg.Batches(np.zeros(3), batch_size=1, seed=-1), ValueError,
     "seed must be an int >= 0, got -1"),
    (lambda: fg.Batches(np.zeros(3), batch_size=1, shuffle="yes"), TypeError,
     "shuffle must be True or False"),
    (lambda: fg.Batches(np.zeros(3), batch_size=4, drop_last=True), ValueError,
     "drop_last=True with 3 examples and batch_size=4 leaves no batch at all"),
    (lambda: fg.Batches(np.zeros((0, 2)), batch_size=4), ValueError, "no examples"),
    (lambda: fg.Batches({}, batch_size=4), ValueError, "data has no arrays"),
    (lambda: fg.Batches(np.float32(1.0), batch_size=4), ValueError, "is a scalar"),
    (lambda: fg.Batches(np.zeros(3), batch_size=1).epoch(-1), ValueError,
     "epoch must be an int >= 0"),
])
def test_bad_batches_are_refused_at_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def _loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _per_example(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(fg.mlp_apply(params, batch["x"]),
                                                           batch["y"])


def _setup(loss=_loss):
    step = fg.make_train_step(loss, optax.adam(1e-2))
    return step, step.init(fg.mlp_init(jax.random.key(0), (F, 16, C)))


def _hand_loader(seed, size, *, shuffle=True, drop_last=False):
    """The batches of each epoch, from indices computed here."""
    def loader(epoch):
        order = _by_hand(seed, epoch, N) if shuffle else np.arange(N)
        stop = N - N % size if drop_last else N
        return [{"x": X[idx], "y": Y[idx]} for idx in _runs(order, size, stop)]
    return loader


def _assert_close(a, b):
    assert len(a.history.step_loss) == len(b.history.step_loss)
    np.testing.assert_allclose(a.history.step_loss, b.history.step_loss, rtol=1e-5)
    for u, v in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", [{}, {"shuffle": False}, {"drop_last": True},
                                 {"shuffle": False, "drop_last": True}],
                         ids=["seeded", "in_order", "drop_last", "in_order_drop_last"])
def test_fit_trains_on_the_batches_computed_by_hand(how):
    # 48 rows in batches of 10: 5 steps an epoch (4 and a tail of 8), 4 with drop_last. The
    # device path (order drawn on the device), one call per batch and the hand-made loader.
    step, state = _setup()
    data = fg.Batches(X, Y, batch_size=10, seed=7, **how)
    device = fg.fit(step, state, data, epochs=3, progress=False)
    single = fg.fit(step, state, data, epochs=3, progress=False, options=fg.FitOptions(chunk=1))
    hand = fg.fit(step, state, _hand_loader(7, 10, **how), epochs=3, progress=False)
    assert int(device.state.step) == 3 * (4 if how.get("drop_last") else 5)
    _assert_close(device, hand)
    _assert_close(single, hand)


@pytest.mark.parametrize("k", [2, 3])
def test_drop_last_under_accumulation_groups_the_full_batches(k):
    # drop_last leaves 40 of the 48 rows an epoch: 4 micro-batches of 10. k=2: 2 whole groups;
    # k=3: a group of 3 and a partial group of 1 (applied, tail="apply"), its rows following
    # the full group's in the order, as a loader of the same batches groups them.
    step, state = _setup(fg.accumulate(_per_example, k))
    data = fg.Batches(X, Y, batch_size=10, seed=1, drop_last=True)
    device = fg.fit(step, state, data, epochs=2, progress=False)
    hand = fg.fit(step, state, _hand_loader(1, 10, drop_last=True), epochs=2, progress=False)
    assert int(device.state.step) == 2 * -(-4 // k)
    _assert_close(device, hand)


def test_resuming_with_another_order_is_refused(tmp_path):
    step, state = _setup()
    fg.fit(step, state, fg.Batches(X, Y, batch_size=10), epochs=1, progress=False,
           checkpoint=fg.Checkpointing(tmp_path))
    with pytest.raises(ValueError, match=r"shuffle False \(the run had True\)"):
        fg.fit(step, state, fg.Batches(X, Y, batch_size=10, shuffle=False), epochs=2,
               progress=False, checkpoint=fg.Checkpointing(tmp_path, resume=True))


def test_an_evaluation_split_as_batches_is_its_mean_loss():
    step, state = _setup()
    got = fg.fit(step, state, fg.Batches(X, Y, batch_size=8), epochs=1, progress=False,
                 evaluate=fg.Batches(X[:20], Y[:20], batch_size=6))  # 6 + 6 + 6 + 2 rows
    by_hand = float(_loss(got.state.params, {"x": X[:20], "y": Y[:20]}))  # one mean of 20
    assert got.history.epochs[0]["eval/loss"] == pytest.approx(by_hand, rel=1e-5)
