"""`fit` on any data, in chunks of steps on the device, with the first non-finite step found
exactly, a run that survives Ctrl-C and a resume that is bit for bit (issue 15).

Second methods: one call per step (``chunk=1``, the plain jitted step) for the scanned chunks;
the arrays' own run for a loader and for another pytree layout of the same data; the
uninterrupted run for a resumed one; a hand computation for the evaluation split's loss."""
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.train.checkpoint import latest_checkpoint_step

N, F, C = 48, 6, 3  # 48 examples, 6 features, 3 classes: batches of 8 make 6 steps an epoch
_rng = np.random.default_rng(0)
X = _rng.standard_normal((N, F)).astype(np.float32)
Y = _rng.integers(0, C, N).astype(np.int32)


def _loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _setup(monitor=None, max_norm=None):
    """The step (Adam, after the monitor and the clip when given) and its initial state."""
    params = fg.mlp_init(jax.random.key(0), (F, 16, C))
    pieces = ([] if monitor is None else [monitor]) + (
        [] if max_norm is None else [fg.clip_by_global_norm(max_norm)])
    tx = optax.chain(*pieces, optax.adam(1e-2)) if pieces else optax.adam(1e-2)
    step = fg.make_train_step(_loss, tx)
    return step, step.init(params)


def _assert_trees(a, b, exact=False, rtol=1e-5):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(jnp.result_type(u), jax.dtypes.prng_key):
            u, v = jax.random.key_data(u), jax.random.key_data(v)
        if exact:
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
        else:  # float32: the scan body and the lone step are compiled apart (fusion, rounding)
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=1e-6)


def test_chunks_of_steps_equal_one_call_per_step_with_the_monitor_and_clipping():
    monitor = fg.grad_monitor(warmup=2)
    step, state = _setup(monitor=monitor, max_norm=0.5)
    data = fg.Batches(X, Y, batch_size=10)  # 48 = 4 x 10 + a tail of 8
    kw = dict(epochs=2, progress=False)
    chunked = fg.fit(step, state, data, **kw)
    single = fg.fit(step, state, data, options=fg.FitOptions(chunk=1), **kw)
    h1, h2 = chunked.history, single.history
    assert len(h1.step_loss) == len(h2.step_loss) == 10  # 5 steps (4 full + tail) x 2 epochs
    np.testing.assert_allclose(h1.step_loss, h2.step_loss, rtol=1e-5)
    np.testing.assert_allclose(h1.step_grad_norm, h2.step_grad_norm, rtol=1e-5)
    np.testing.assert_allclose(h1.step_layer_norm, h2.step_layer_norm, rtol=1e-5)
    assert [str(a) for a in h1.alerts] == [str(a) for a in h2.alerts]
    _assert_trees(chunked.state.params, single.state.params)
    assert int(chunked.state.step) == 10
    # The chunks run unguarded first (optimistic): the guarded chunks give the same run.
    guarded = fg.fit(step, state, data, options=fg.FitOptions(optimistic=False), **kw)
    np.testing.assert_allclose(guarded.history.step_loss, h1.step_loss, rtol=1e-6)
    _assert_trees(guarded.state.params, chunked.state.params, rtol=1e-6)
    # The caller's state is untouched (the chunks donate a copy of it).
    np.testing.assert_array_equal(state.params[0]["w"], _setup()[1].params[0]["w"])


def test_a_loader_and_another_pytree_layout_train_as_the_arrays():
    step, state = _setup()
    data = fg.Batches(X, Y, batch_size=8, seed=4)
    arrays = fg.fit(step, state, data, epochs=3, progress=False)
    # The same batches from a loader: Batches.epoch yields the order fit draws on the device.
    loader = fg.fit(step, state, data.epoch, epochs=3, progress=False)
    np.testing.assert_allclose(loader.history.step_loss, arrays.history.step_loss, rtol=1e-5)
    _assert_trees(loader.state.params, arrays.state.params)
    # A (features, labels) tuple with a loss that reads it so: the same run.
    tuple_step = fg.make_train_step(lambda p, b: _loss(p, {"x": b[0], "y": b[1]}),
                                    optax.adam(1e-2))
    as_tuple = fg.fit(tuple_step, state, fg.Batches((X, Y), batch_size=8, seed=4), epochs=3,
                      progress=False)
    np.testing.assert_allclose(as_tuple.history.step_loss, arrays.history.step_loss,
                               rtol=1e-5)
    # A list of batches (re-iterable) and a generator for one epoch.
    listed = list(data.epoch(0))
    one = fg.fit(step, state, listed, epochs=1, progress=False)
    gen = fg.fit(step, state, (b for b in listed), epochs=1, progress=False)
    np.testing.assert_allclose(one.history.step_loss, arrays.history.step_loss[:6], rtol=1e-5)
    np.testing.assert_allclose(gen.history.step_loss, one.history.step_loss, rtol=1e-6)


def _nan_rows(rows):
    x = X.copy()
    x[rows, 0] = np.nan
    return x


def test_a_nan_inside_a_chunk_is_located_to_its_step_and_examples():
    step, state = _setup()
    bad_row = 29
    x = _nan_rows([bad_row])
    with pytest.warns(RuntimeWarning, match="non-finite value at step"):
        got = fg.fit(step, state, fg.Batches(x, Y, batch_size=8), epochs=1, progress=False)
    report = got.nonfinite
    assert bad_row in report.examples and len(report.examples) == 8
    # The batch with the NaN row in the host order of epoch 0 is the one reported.
    batches = [np.flatnonzero(np.isnan(b["x"][:, 0])).size for b in
               fg.Batches(x, Y, batch_size=8, seed=0).epoch(0)]
    assert report.batch == batches.index(1) == report.step
    # The state returned is the state before that step: the same as one call per step.
    with pytest.warns(RuntimeWarning, match="non-finite value at step"):
        single = fg.fit(step, state, fg.Batches(x, Y, batch_size=8), epochs=1, progress=False,
                        options=fg.FitOptions(chunk=1))
    assert single.nonfinite.step == report.step and single.nonfinite.examples == report.examples
    assert int(got.state.step) == report.step
    _assert_trees(got.state.params, single.state.params)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(got.state.params))
    assert f"examples (rows of the data): {report.examples[0]}" in str(report)


def test_skip_trains_past_non_finite_batches_and_names_them():
    step, state = _setup()
    x = _nan_rows([5])
    got = fg.fit(step, state, fg.Batches(x, Y, batch_size=8), epochs=3, progress=False,
                 options=fg.FitOptions(on_nonfinite="skip"))
    assert got.nonfinite is None and len(got.history.epochs) == 3
    skipped = got.history.skipped_batches
    assert [s["epoch"] for s in skipped] == [1, 2, 3]  # row 5 is in one batch of each epoch
    assert all(5 in s["examples"] for s in skipped)
    assert len(got.history.step_loss) == 3 * 6 - 3 and int(got.state.step) == 18
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(got.state.params))


def test_ctrl_c_stops_after_the_chunk_and_keeps_the_run(tmp_path):
    step, state = _setup()
    epochs_seen = []

    def evaluate(params):  # Ctrl-C while epoch 2 is evaluated
        epochs_seen.append(1)
        if len(epochs_seen) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return {}

    got = fg.fit(step, state, fg.Batches(X, Y, batch_size=8), epochs=5, evaluate=evaluate,
                 checkpoint=fg.Checkpointing(tmp_path / "ck"), progress=False)
    assert got.interrupted and len(got.history.epochs) == 2 and int(got.state.step) == 12
    assert latest_checkpoint_step(tmp_path / "ck") == 12


def test_resume_after_a_stop_is_bit_for_bit_the_run_that_never_stopped(tmp_path):
    monitor = fg.grad_monitor(warmup=2)
    step, state = _setup(monitor=monitor)
    data = fg.Batches(X, Y, batch_size=8)
    # 10 epochs straight, against 5 epochs, a checkpoint, a restore and 5 more epochs.
    straight = fg.fit(step, state, data, epochs=10, progress=False)
    first = fg.fit(step, state, data, epochs=5, checkpoint=fg.Checkpointing(tmp_path),
                   progress=False)
    assert int(first.state.step) == 30
    resumed = fg.fit(step, state, data, epochs=10, progress=False,
                     checkpoint=fg.Checkpointing(tmp_path, resume=True))
    _assert_trees(resumed.state, straight.state, exact=True)
    assert resumed.history.step_loss == straight.history.step_loss
    assert resumed.history.epochs == straight.history.epochs


def test_resume_mid_epoch_from_a_loader(tmp_path):
    # A loader of 6 batches an epoch, one call per batch; Ctrl-C while batch 3 of epoch 2 is
    # made: the run stops before training on it (6 + 3 = 9 steps applied; the batch in hand
    # is not), and the resumed run skips the 3 batches epoch 2 already trained on.
    step, state = _setup()
    interrupt = [True]

    def loader(epoch):
        for i, b in enumerate(fg.Batches(X, Y, batch_size=8, seed=1).epoch(epoch)):
            if epoch == 1 and i == 3 and interrupt[0]:
                interrupt[0] = False
                os.kill(os.getpid(), signal.SIGINT)
            yield b

    kw = dict(epochs=3, options=fg.FitOptions(chunk=1), progress=False)
    stopped = fg.fit(step, state, loader, checkpoint=fg.Checkpointing(tmp_path), **kw)
    assert stopped.interrupted and int(stopped.state.step) == 9
    resumed = fg.fit(step, state, loader, checkpoint=fg.Checkpointing(tmp_path, resume=True),
                     **kw)
    straight = fg.fit(step, state, loader, **kw)
    _assert_trees(resumed.state, straight.state, exact=True)
    assert resumed.history.step_loss == straight.history.step_loss


def test_an_evaluation_split_gives_its_mean_loss():
    step, state = _setup()
    got = fg.fit(step, state, fg.Batches(X, Y, batch_size=8), epochs=1,
                 evaluate={"x": X[:20], "y": Y[:20]}, progress=False)
    params = got.state.params
    by_hand = float(_loss(params, {"x": X[:20], "y": Y[:20]}))  # mean over the 20 rows
    assert got.history.epochs[0]["eval/loss"] == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda s, st: fg.fit(s, st, fg.Batches({"x": X, "y": Y[:5]}, batch_size=8), epochs=1),
     r"data\['y'\] has 5 rows but data\['x'\] has 48"),
    (lambda s, st: fg.fit(s, st, {"x": X, "y": Y[:5]}, epochs=1),  # the shape first, then
     r"fit: data\['y'\] has 5 rows but data\['x'\] has 48"),  # how to batch it
    (lambda s, st: fg.fit(s, st, {"x": X, "y": Y}, epochs=1),
     r"fit: data is a pytree of arrays.*fg.Batches\(data, batch_size=32\)"),
    (lambda s, st: fg.fit(s, st, iter([{"x": X, "y": Y}]), epochs=2),
     r"an iterator .* used up after one pass, and epochs=2"),
    (lambda s, st: fg.fit(s, st, [{"x": X[:8], "y": Y[:8]}, {"x": X[:8]}], epochs=1,
                          progress=False),
     r"batch 1 of epoch 1 of the loader has the structure"),
    (lambda s, st: fg.fit(s, st, [{"x": X[:8], "y": Y[:7]}], epochs=1, progress=False),
     r"batch 0 of epoch 1 of the loader: batch\['y'\] has 7 rows but batch\['x'\] has 8"),
])
def test_bad_data_is_refused_clearly(call, match):
    step, state = _setup()
    with pytest.raises(ValueError, match=match):
        call(step, state)


def test_accumulation_one_call_per_step_and_a_ctrl_c_at_an_epochs_end():
    # accumulate=2 with chunk=1 (one call per update): 48 rows in micro-batches of 8 make 3
    # updates an epoch, as the chunked run does (allclose: compiled apart).
    per_example = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        fg.mlp_apply(p, b["x"]), b["y"])
    params = fg.mlp_init(jax.random.key(0), (F, 16, C))
    tx = optax.adam(1e-2)
    step = fg.make_train_step(fg.accumulate(per_example, 2), tx)
    state = step.init(params)
    single = fg.fit(step, state, fg.Batches(X, Y, batch_size=8), epochs=1, progress=False,
                    options=fg.FitOptions(chunk=1))
    chunked = fg.fit(step, state, fg.Batches(X, Y, batch_size=8), epochs=1, progress=False)
    assert int(single.state.step) == int(chunked.state.step) == 3
    np.testing.assert_allclose(single.history.step_loss, chunked.history.step_loss, rtol=1e-5)
    # Ctrl-C while the last batch of epoch 1 is made: the epoch completes (its row is kept),
    # and the run stops before epoch 2.
    plain, state = _setup()
    batches = list(fg.Batches(X, Y, batch_size=16).epoch(0))

    def loader(epoch):
        for i, b in enumerate(batches):
            if epoch == 0 and i == len(batches) - 1:
                os.kill(os.getpid(), signal.SIGINT)
            yield b

    got = fg.fit(plain, state, loader, epochs=3, progress=False)
    assert got.interrupted and len(got.history.epochs) == 1 and int(got.state.step) == 3


def test_a_second_ctrl_c_still_keeps_the_run(tmp_path):
    # Two SIGINTs: the second raises KeyboardInterrupt at once, which carries the run so far
    # (the 6 steps of epoch 1) and leaves it checkpointed.
    step, state = _setup()

    def evaluate(params):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return {}

    with pytest.raises(KeyboardInterrupt) as error:
        fg.fit(step, state, fg.Batches(X, Y, batch_size=8), epochs=3, evaluate=evaluate,
               checkpoint=fg.Checkpointing(tmp_path), progress=False)
    assert int(error.value.fit_result.state.step) == 6
    assert latest_checkpoint_step(tmp_path) == 6


def test_resuming_with_other_settings_is_refused(tmp_path):
    step, state = _setup()
    x = _nan_rows([40])  # stops mid-epoch, checkpointed
    with pytest.warns(RuntimeWarning, match="non-finite"):
        fg.fit(step, state, fg.Batches(x, Y, batch_size=8), epochs=2,
               checkpoint=fg.Checkpointing(tmp_path), progress=False)
    with pytest.raises(ValueError, match=r"seed 1 \(the run had 0\), batch_size 16 \(the run "
                                         r"had 8\).*visit other examples"):
        fg.fit(step, state, fg.Batches(x, Y, batch_size=16, seed=1), epochs=2,
               checkpoint=fg.Checkpointing(tmp_path, resume=True), progress=False)


@pytest.mark.parametrize("call, exc, match", [
    (lambda s, st: fg.fit(s, st, [], epochs=1, progress=False), ValueError,
     r"the loader yielded no batches in epoch 1"),
    (lambda s, st: fg.fit(s, st.params, fg.Batches(X, Y, batch_size=8), epochs=1), TypeError,
     r"state must be a TrainState, from step\.init\(params\)"),
    (lambda s, st: fg.fit(s, st, X, Y, epochs=1), TypeError,
     r"y is no longer an argument: .*fg.Batches\(x, y, batch_size=32\)"),
])
def test_empty_loaders_and_misplaced_arguments_are_named(call, exc, match):
    step, state = _setup()
    with pytest.raises(exc, match=match):
        call(step, state)
