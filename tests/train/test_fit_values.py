"""`fit`'s signature (at most 8 parameters) and the values that hold its former keywords:
`fg.Checkpointing`, `fg.Progress`, `fg.FitOptions` (and `fg.Batches`: test_batching.py). Each
former keyword raises a TypeError naming its new home; each value checks itself when made."""
import inspect
import os

import jax
import numpy as np
import optax
import pytest

import funcgrad as fg

N, F, C = 48, 6, 3  # batches of 8: 6 steps an epoch
_rng = np.random.default_rng(3)
DATA = fg.Batches(_rng.standard_normal((N, F)).astype(np.float32),
                  _rng.integers(0, C, N).astype(np.int32), batch_size=8)


def _setup():
    loss = lambda p, b: fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])
    step = fg.make_train_step(loss, optax.adam(1e-2))
    return step, step.init(fg.mlp_init(jax.random.key(0), (F, 16, C)))


def test_fit_has_eight_parameters():
    params = inspect.signature(fg.fit).parameters
    assert list(params) == ["step", "state", "data", "epochs", "evaluate", "checkpoint",
                            "progress", "options"]
    assert all(p.kind is not p.VAR_KEYWORD for p in params.values())


@pytest.mark.parametrize("keyword, value, home", [
    ("y", np.zeros(N), r"fg\.Batches\(x, y, batch_size=32\)"),
    ("batch_size", 8, r"fg\.Batches\(data, batch_size=32\)"),
    ("seed", 1, r"fg\.Batches\(data, batch_size=32, seed=0\)"),
    ("checkpoint_dir", "ck", r"checkpoint=fg\.Checkpointing\('runs/ck'"),
    ("every", 2, r"checkpoint=fg\.Checkpointing\(directory, every=5\)"),
    ("resume", True, r"checkpoint=fg\.Checkpointing\(directory, resume=True\)"),
    ("log", print, r"progress=print .*fg\.Progress\(print, bar=True\)"),
    ("on_nonfinite", "skip", r"options=fg\.FitOptions\(on_nonfinite='skip'\)"),
    ("chunk", 1, r"options=fg\.FitOptions\(chunk=1\)"),
    ("optimistic", False, r"options=fg\.FitOptions\(optimistic=False\)"),
])
def test_each_former_keyword_names_its_new_home(keyword, value, home):
    step, state = _setup()
    with pytest.raises(TypeError, match=rf"fit: {keyword}= is no longer a keyword; .*{home}"):
        fg.fit(step, state, DATA, epochs=1, progress=False, **{keyword: value})


def test_the_former_positional_y_names_batches():
    step, state = _setup()
    with pytest.raises(TypeError, match=r"y is no longer an argument: .*fg\.Batches\(x, y, "):
        fg.fit(step, state, DATA.data["x"], DATA.data["y"], epochs=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'epoch'"):  # a typo
        fg.fit(step, state, DATA, epoch=1)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: fg.Checkpointing(3), TypeError, "directory must be a str or a path, got int"),
    (lambda: fg.Checkpointing(""), ValueError, "directory is empty"),
    (lambda: fg.Checkpointing("ck", every=0), ValueError, "every must be a positive int"),
    (lambda: fg.Checkpointing("ck", every=1.5), ValueError, "every must be a positive int"),
    (lambda: fg.Checkpointing("ck", resume="yes"), TypeError, "resume must be True or False"),
    (lambda: fg.Checkpointing("ck", 2), TypeError, "positional"),  # every is keyword-only
    (lambda: fg.Progress("print"), TypeError, "lines must be a function of one string"),
    (lambda: fg.Progress(bar=1), TypeError, "bar must be True or False"),
    (lambda: fg.FitOptions(on_nonfinite="ignore"), ValueError,
     "on_nonfinite must be 'stop' or 'skip'"),
    (lambda: fg.FitOptions(chunk=0), ValueError, "chunk must be a positive int"),
    (lambda: fg.FitOptions(optimistic=None), TypeError, "optimistic must be True or False"),
])
def test_each_value_checks_itself_when_made(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize("kwargs, match", [
    ({"checkpoint": "runs/ck"}, r"checkpoint must be a funcgrad\.Checkpointing .* got str; "
                                r"e\.g\. checkpoint=fg\.Checkpointing"),
    ({"options": {"chunk": 1}}, r"options must be a funcgrad\.FitOptions .* got dict"),
    ({"progress": 2}, r"progress must be True, False, a function .* got int"),
])
def test_fit_names_a_value_of_the_wrong_kind(kwargs, match):
    step, state = _setup()
    with pytest.raises(TypeError, match=match):
        fg.fit(step, state, DATA, epochs=1, **kwargs)


def _steps_saved(directory):
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def test_checkpointing_saves_every_k_epochs_and_at_the_end(tmp_path):
    # 5 epochs of 6 steps, every=2: after epochs 2 and 4 (steps 12, 24) and at the end (30).
    step, state = _setup()
    got = fg.fit(step, state, DATA, epochs=5, progress=False,
                 checkpoint=fg.Checkpointing(tmp_path / "ck", every=2))
    assert int(got.state.step) == 30 and _steps_saved(tmp_path / "ck") == [12, 24, 30]
    # resume=True where there is no checkpoint yet starts the run: the same as no checkpoint.
    fresh = fg.fit(step, state, DATA, epochs=2, progress=False,
                   checkpoint=fg.Checkpointing(tmp_path / "new", resume=True))
    plain = fg.fit(step, state, DATA, epochs=2, progress=False)
    assert fresh.history.step_loss == plain.history.step_loss
    # Resumed from step 30 to 7 epochs: 12 more steps, equal bit for bit to 7 epochs straight.
    more = fg.fit(step, state, DATA, epochs=7, progress=False,
                  checkpoint=fg.Checkpointing(tmp_path / "ck", every=2, resume=True))
    straight = fg.fit(step, state, DATA, epochs=7, progress=False)
    assert int(more.state.step) == 42 and more.history.step_loss == straight.history.step_loss
    for u, v in zip(jax.tree.leaves(more.state.params), jax.tree.leaves(straight.state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_progress_shows_a_bar_lines_both_or_nothing(capsys):
    step, state = _setup()
    shown = {}
    for name, progress in [("bar", True), ("nothing", False), ("none", None),
                           ("lines", "list"), ("both", "both"), ("silent", fg.Progress())]:
        lines = []
        value = (lines.append if progress == "list" else fg.Progress(lines.append, bar=True)
                 if progress == "both" else progress)
        fg.fit(step, state, DATA, epochs=2, progress=value)
        shown[name] = (len(lines), "step" in capsys.readouterr().err)  # tqdm's unit: step
    assert shown == {"bar": (0, True), "nothing": (0, False), "none": (0, False),
                     "lines": (2, False), "both": (2, True), "silent": (0, False)}


def test_fit_options_skip_goes_on_past_a_nan_batch():
    step, state = _setup()
    x = np.array(DATA.data["x"])
    x[5, 0] = np.nan  # one row: one batch of each epoch
    data = fg.Batches(x, DATA.data["y"], batch_size=8)
    got = fg.fit(step, state, data, epochs=2, progress=False,
                 options=fg.FitOptions(on_nonfinite="skip", chunk=2))
    assert got.nonfinite is None and len(got.history.skipped_batches) == 2
    assert len(got.history.step_loss) == 2 * 6 - 2
