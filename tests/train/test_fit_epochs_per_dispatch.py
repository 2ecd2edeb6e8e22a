"""Several epochs per dispatch (issue 27): when nothing on the host needs an epoch's numbers
before the next (no evaluation, no progress bar, no checkpoint due), `fit` runs several
epochs in one jitted call, and the run is the same, bit for bit, as one epoch per dispatch.

Second method: the same run with one epoch per dispatch, forced by an `evaluate` that adds
nothing to the rows (fit must then read each epoch's state). Each test first checks that the
run did dispatch several epochs at once (the compiled program is there), so that it does not
compare a path with itself."""
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.train.checkpoint import latest_checkpoint_step

N, F, C = 48, 6, 3  # batches of 10: 4 full batches and a tail of 8 an epoch
_rng = np.random.default_rng(1)
X = _rng.standard_normal((N, F)).astype(np.float32)
X[3] *= 300.0  # one loud example: its batch's norm raises an explosion alert in every epoch
Y = _rng.integers(0, C, N).astype(np.int32)


def _loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _per_example(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(fg.mlp_apply(params, batch["x"]),
                                                           batch["y"])


def _setup(loss=_loss):
    params = fg.mlp_init(jax.random.key(0), (F, 16, C))
    tx = fg.make_optimizer("adam", optax.cosine_decay_schedule(1e-2, 100))
    step = fg.make_train_step(loss, optax.chain(fg.grad_monitor(warmup=2), tx))
    return step, step.init(params)


@pytest.fixture
def calls(monkeypatch):
    """The epochs of each call of several epochs that fit makes (launched ahead or not)."""
    from funcgrad.train.loop._chunks import ChunkRunner
    made, original = [], ChunkRunner.epochs

    def counted(self, state, data, key, first, count, **kw):
        made.append(int(count))
        return original(self, state, data, key, first, count, **kw)
    monkeypatch.setattr(ChunkRunner, "epochs", counted)
    return made


def _bits(tree):
    return [np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                       else a) for a in jax.tree.leaves(tree)]


def _assert_same_run(a, b):
    assert a.history.to_dict() == b.history.to_dict()
    assert a.history.epochs == b.history.epochs
    for u, v in zip(_bits(a.state), _bits(b.state), strict=True):
        np.testing.assert_array_equal(u, v)


def _both(step, state, data, **kw):
    """The run with several epochs per dispatch and with one; and their log lines."""
    lines_many, lines_one = [], []
    many = fg.fit(step, state, data, progress=lines_many.append, **kw)
    one = fg.fit(step, state, data, progress=lines_one.append, evaluate=lambda params: {},
                 **kw)
    return many, one, lines_many, lines_one


@pytest.mark.parametrize("step_kwargs", [{}, {"accumulate": 2}, {"accumulate": 2,
                                                                 "tail": "drop"}],
                         ids=["plain", "accumulate", "accumulate_drop"])
def test_several_epochs_per_dispatch_are_the_run_of_one_epoch_per_dispatch(step_kwargs,
                                                                          calls):
    loss = (fg.accumulate(_per_example, step_kwargs["accumulate"],
                          tail=step_kwargs.get("tail", "apply")) if step_kwargs else _loss)
    step, state = _setup(loss)
    many, one, lines_many, lines_one = _both(step, state, fg.Batches(X, Y, batch_size=10),
                                             epochs=4)
    assert calls == [4]  # the 4 epochs in one call (and none for one epoch per dispatch)
    _assert_same_run(many, one)
    assert lines_many == lines_one  # the same lines, alerts included, in the same order
    h = many.history
    assert len(h.epochs) == 4 and len(set(h.step_learning_rate)) == len(h.step_learning_rate)
    if not step_kwargs:  # alerts raised in the dispatch's later epochs too (5 steps each)
        assert {1, 2, 3} <= {a.step // 5 for a in h.alerts if a.kind == "explosion"}
    if step_kwargs.get("tail") == "drop":
        assert h.dropped_examples == 4 * 8  # each epoch's tail of 8, dropped, as one by one


def test_a_nan_in_a_later_epoch_of_a_dispatch_is_found_as_one_by_one(calls):
    def loss(params, batch):  # NaN once the last bias has moved past 0.06: in epoch 2
        drift = jnp.abs(params[1]["b"]).max()
        return _loss(params, batch) + jnp.where(drift > 0.06, jnp.nan, 0.0)

    step, state = _setup(loss)
    with pytest.warns(RuntimeWarning, match="non-finite value at step") as caught:
        many = fg.fit(step, state, fg.Batches(X, Y, batch_size=10), epochs=4, progress=False)
    assert calls == [4]  # dispatched together, then run again one by one
    with pytest.warns(RuntimeWarning, match="non-finite value at step") as caught_one:
        one = fg.fit(step, state, fg.Batches(X, Y, batch_size=10), epochs=4,
                     evaluate=lambda params: {}, progress=False)
    assert many.nonfinite.epoch == 2 and many.nonfinite.step > 5
    assert repr(many.nonfinite) == repr(one.nonfinite)  # step, batch, examples: all of it
    assert str(caught[0].message) == str(caught_one[0].message)
    _assert_same_run(many, one)


def test_checkpoints_cut_the_dispatches_and_resume_is_bit_for_bit(tmp_path, calls):
    step, state = _setup()
    data = fg.Batches(X, Y, batch_size=10)
    straight = fg.fit(step, state, data, epochs=6, progress=False)  # 6 epochs in one dispatch
    saved = []
    first = fg.fit(step, state, data, epochs=4, checkpoint=fg.Checkpointing(tmp_path, every=2),
                   progress=lambda line: line.startswith("epoch") and saved.append(
                       latest_checkpoint_step(tmp_path)))
    # Epochs 1-2 and 3-4 in two dispatches, each checkpointed at its end (5 steps an epoch);
    # the log lines of a dispatch come out after its last epoch is recorded.
    assert calls == [6, 2, 2]
    assert int(first.state.step) == 20 and latest_checkpoint_step(tmp_path) == 20
    assert saved == [None, None, 10, 10]
    resumed = fg.fit(step, state, data, epochs=6, progress=False,
                     checkpoint=fg.Checkpointing(tmp_path, every=2, resume=True))
    assert calls[3:] == [2]  # epochs 5-6
    _assert_same_run(resumed, straight)


def test_ctrl_c_stops_after_the_dispatch_and_keeps_its_epochs(tmp_path, calls):
    step, state = _setup()

    def log(line):  # Ctrl-C at the first line, which comes once epochs 1-2 are recorded
        if line.startswith("epoch   1"):
            os.kill(os.getpid(), signal.SIGINT)

    got = fg.fit(step, state, fg.Batches(X, Y, batch_size=10), epochs=6,
                 checkpoint=fg.Checkpointing(tmp_path / "ck", every=2), progress=log)
    assert calls[0] == 2  # epochs 1-2 in one call (the next one may be launched already)
    assert got.interrupted and [row["epoch"] for row in got.history.epochs] == [1, 2]
    assert int(got.state.step) == 10 == len(got.history.step_loss)
    assert latest_checkpoint_step(tmp_path / "ck") == 10
    # The two epochs are those of the run that was not stopped.
    whole = fg.fit(step, state, fg.Batches(X, Y, batch_size=10), epochs=2, progress=False)
    _assert_same_run(got._replace(interrupted=False), whole)


def test_one_program_serves_every_number_of_epochs(calls):
    # A new number of epochs must not compile a new program (seconds each on a CPU).
    step, state = _setup()
    runs = [fg.fit(step, state, fg.Batches(X, Y, batch_size=10), epochs=k, progress=False)
            for k in (2, 3)]
    assert calls == [2, 3]
    programs = [shape for runner in step._fit_runners.values() for shape in runner._programs]
    assert len(programs) == 1 and programs[0][0] == "epochs"
    assert runs[1].history.step_loss[:10] == runs[0].history.step_loss
