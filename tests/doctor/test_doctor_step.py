"""``fg.doctor(step, state, data, *, checks, options, progress)``: the doctor examines the step
the user trains with (its loss's pieces, optimizer, mask, clipping) at the params, model state
and key of its state; a model file may define that step. Each doctor run here runs only the
checks it is about (compilation is most of the time)."""
import inspect
import pathlib
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.doctor import DoctorOptions, ModelFileError, doctor, doctor_file

from . import _small
from ._modelfile import load

MODELS = pathlib.Path(__file__).parent / "models"


def _step_and_state(loss=_small.loss, clip_norm=None, **step_kwargs):
    tx = optax.adam(1e-3)
    if clip_norm is not None:
        tx = optax.chain(fg.clip_by_global_norm(clip_norm), tx)
    step = fg.make_train_step(loss, tx, **step_kwargs)
    return step, step.init(_small.params())


# --- the signature and its errors ---------------------------------------------------------------

def test_doctor_and_doctor_file_take_at_most_8_parameters():
    # Every parameter counts, **moved too (issue 33's target for the public entry points).
    for f in (fg.doctor, doctor, doctor_file):
        assert len(inspect.signature(f).parameters) <= 8, (f, inspect.signature(f))
    # fg.doctor is the package and the function: its signature is the function's.
    assert inspect.signature(fg.doctor) == inspect.signature(doctor)
    assert list(inspect.signature(doctor).parameters) == ["step", "state", "data", "checks",
                                                          "options", "progress", "moved"]
    assert fg.DoctorOptions is DoctorOptions is fg.doctor.DoctorOptions


@pytest.mark.parametrize("name, value, new_place", [
    ("model_state", {}, "step.init(params, model_state="),
    ("key", jax.random.key(0), "step.init(params, key=key)"),
    ("optimizer", optax.sgd(0.1), "fg.make_train_step(loss_fn, optimizer)"),
    ("step_kwargs", {"clip_norm": 1.0}, "fg.make_train_step(loss, optax.chain("),
    ("skip", ["memory"], "checks=[c for c in fg.doctor.CHECKS if c not in skip]"),
    ("source", "model.py", "doctor_file(path)"),
    ("classes", 3, "options=fg.DoctorOptions(classes=...)"),
    ("eval_loss", _small.loss, "options=fg.DoctorOptions(eval_loss=...)"),
    ("evaluate", lambda p: {}, "options=fg.DoctorOptions(evaluate=...)"),
    ("steps", 10, "options=fg.DoctorOptions(steps=...)"),
    ("overfit_steps", 10, "options=fg.DoctorOptions(overfit_steps=...)"),
    ("seed", 1, "options=fg.DoctorOptions(seed=...)"),
    ("batch_size", 16, "options=fg.DoctorOptions(batch_size=...)"),
    ("clip_quantile", 0.8, "options=fg.DoctorOptions(clip_quantile=...)"),  # a former threshold
    ("tiny_rows", 4, "options=fg.DoctorOptions(tiny_rows=...)"),
], ids=lambda v: v if isinstance(v, str) and v.isidentifier() else "")
def test_each_former_keyword_names_its_new_place(name, value, new_place):
    step, state = _step_and_state()
    with pytest.raises(TypeError, match=f"doctor: {name}= is no longer a keyword") as error:
        doctor(step, state, _small.data(), **{name: value})
    assert new_place in str(error.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'"):
        doctor(step, state, _small.data(), stepz=3)


def test_a_loss_function_where_the_step_goes_shows_make_train_step():
    params, data = _small.params(), _small.data()
    with pytest.raises(TypeError, match=r"step = fg.make_train_step\(loss, optax.adam") as error:
        fg.doctor(_small.loss, params, data)  # the former doctor(loss, params, data)
    assert "fg.doctor(step, step.init(params), data)" in str(error.value)
    with pytest.raises(TypeError, match="got the function per_example"):
        fg.doctor(fg.Loss(_small.per_example), params, data)
    with pytest.raises(TypeError, match="a funcgrad.TrainStep .* got dict"):
        fg.doctor({"loss": _small.loss}, params, data)


def test_params_options_and_a_state_of_another_loss_are_refused():
    step, state = _step_and_state()
    with pytest.raises(TypeError, match=r"TrainState .* got MLPParams: pass step.init\(params"):
        fg.doctor(step, _small.params(), _small.data())
    with pytest.raises(TypeError, match="options must be a funcgrad.DoctorOptions"):
        fg.doctor(step, state, _small.data(), options={"steps": 5})

    def with_state(params, batch, *, model_state):
        return _small.loss(params, batch), model_state
    stateful = fg.make_train_step(fg.Loss(with_state, has_state=True), optax.adam(1e-3))
    with pytest.raises(ValueError, match="declares model state but the state has none"):
        fg.doctor(stateful, state, _small.data())  # the state of the plain step
    with pytest.raises(ValueError, match="unknown check"):
        fg.doctor(step, state, _small.data(), checks=["dat"])


def test_doctor_options_are_checked_when_made():
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'"):
        DoctorOptions(stepz=3)
    for bad in ({"steps": 0}, {"classes": 1}, {"seed": -1}, {"clip_quantile": 1.5},
                {"overfit_ratio": 1.0}, {"init_loss_ratio": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DoctorOptions(**bad)
    for bad in ({"steps": 2.0}, {"batch_size": True}, {"evaluate": 3}, {"eval_loss": "f"}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            DoctorOptions(**bad)
    assert DoctorOptions(classes=10).steps == 100  # the other fields keep their defaults


# --- the step's pieces are what the checks examine ------------------------------------------

def test_a_planted_fault_is_found_at_its_place_through_the_step():
    # detached_mlp_head: stop_gradient on the readout weight. Its gradient is exactly zero (by
    # jax.grad, the second method), and grad_flow names that leaf through fg.doctor(step, ...)
    # as through doctor_file on the file.
    m = load(MODELS / "detached_mlp_head.py")
    with jax.numpy_rank_promotion("allow"):  # the file is user code: x @ w + b
        grads = jax.grad(m.bound())(m.params, m.batch(8))
        assert float(jnp.max(jnp.abs(grads["readout"]["w"]))) == 0.0
        assert float(jnp.max(jnp.abs(grads["hidden"]["w"]))) > 0.0
        direct = fg.doctor(m.step, m.step.init(m.params), m.data, checks=["grad_flow"])
        from_file = doctor_file(m.path, checks=["grad_flow"])
    found = [r.by_check("grad_flow") for r in (direct, from_file)]
    assert [f.verdict for f in found] == ["fail", "fail"]
    assert found[0].place["leaf"] == found[1].place["leaf"] == "params['readout']['w']"


def test_the_state_key_is_the_loss_key():
    # A dropout loss: the init_loss check's loss on the first 64 rows is the loss under the
    # state's key (computed here by hand), not under a key of the doctor's.
    def dropout_loss(params, batch, *, key):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        return _small.loss(params, {"x": jnp.where(keep, 2 * batch["x"], 0.0), "y": batch["y"]})

    step = fg.make_train_step(fg.Loss(dropout_loss, takes_key=True), optax.adam(1e-3))
    rows = jax.tree.map(lambda x: x[:64], _small.data())
    params = _small.params()
    values = []
    for seed in (0, 7):
        state = step.init(params, key=jax.random.key(seed))
        f = fg.doctor(step, state, _small.data(), checks=["init_loss"]).by_check("init_loss")
        by_hand = float(jax.jit(dropout_loss)(params, rows, key=jax.random.key(seed)))
        assert f.evidence["loss"] == pytest.approx(by_hand, rel=1e-6)  # float32, both jitted
        values.append(by_hand)
    assert values[0] != values[1]  # the key matters, so the comparison above means something


def test_the_steps_clipping_is_read_from_the_step():
    clipped, state = _step_and_state(clip_norm=0.5)
    report = fg.doctor(clipped, state, _small.data(), checks=["training"],
                       options=DoctorOptions(steps=20, classes=_small.K))
    f = report.by_check("training")
    norms = np.asarray(report.curves["grad_norm"])  # pre-clip norms, one per step
    assert f.evidence["clipped_fraction"] == pytest.approx(float(np.mean(norms > 0.5)),
                                                           rel=1e-12)
    plain, state = _step_and_state()
    f = fg.doctor(plain, state, _small.data(), checks=["training"],
                  options=DoctorOptions(steps=20, classes=_small.K)).by_check("training")
    assert "clipped_fraction" not in f.evidence


def test_an_accumulating_step_overfits_one_batch_as_its_mean_loss():
    # Under fg.accumulate(per_example, 4) the overfit check runs one batch without accumulation:
    # its first loss is the mean per-example loss of the first 16 rows at the initial params.
    step = fg.make_train_step(fg.accumulate(_small.per_example, 4), optax.adam(1e-2))
    params = _small.params()
    report = fg.doctor(step, step.init(params), _small.data(), checks=["overfit", "semantics"],
                       options=DoctorOptions(overfit_steps=40, classes=_small.K))
    rows = jax.tree.map(lambda x: x[:16], _small.data())
    by_hand = float(jnp.mean(_small.per_example(params, rows)))
    overfit = report.by_check("overfit")
    assert overfit.evidence["loss_first"] == pytest.approx(by_hand, rel=1e-6)
    assert overfit.verdict == "pass", overfit.summary
    assert report.by_check("semantics").evidence["accumulate"]["micro_batches"] == 4


def test_a_data_parallel_or_unjitted_step_is_examined_on_one_device_jitted():
    step, state = _step_and_state()
    options = DoctorOptions(steps=5, classes=_small.K)
    plain = fg.doctor(step, state, _small.data(), checks=["training"], options=options)
    mesh_step = fg.data_parallel(step, fg.data_mesh())
    on_mesh = fg.doctor(mesh_step, state, _small.data(), checks=["training"], options=options)
    assert on_mesh.curves["loss"] == plain.curves["loss"]  # the same program, same batches
    unjitted = fg.make_train_step(_small.loss, optax.adam(1e-3), jit=False)
    f = fg.doctor(unjitted, state, _small.data(), checks=["memory"]).by_check("memory")
    assert f.verdict == "pass" and f.evidence["peak_bytes"] > 0, f.summary


# --- model files: `step` ----------------------------------------------------------------------

PIECES = '''
import numpy as np, optax, funcgrad as fg
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype(np.float32)
y = np.argmax(x @ rng.normal(size=(8, 3)), axis=1).astype(np.int32)
data = {"x": x, "y": y}
classes = 3
optimizer = optax.adam(1e-3)

def init(key):
    return fg.mlp_init(key, (8, 16, 3), activation="tanh")

def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"], activation="tanh"),
                                    batch["y"])
'''


def _file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_file_defining_step_gives_the_findings_of_the_same_pieces(tmp_path):
    pieces = _file(tmp_path, "pieces.py", PIECES)
    stepped = _file(tmp_path, "stepped.py", PIECES + "step = fg.make_train_step(loss, optimizer)\n")
    checks = ["init_loss", "grad_flow", "training", "overfit", "semantics"]
    options = DoctorOptions(steps=20, overfit_steps=20)
    a, b = (doctor_file(p, checks=checks, options=options) for p in (pieces, stepped))
    assert [(f.check, f.verdict) for f in a.findings] == [(f.check, f.verdict)
                                                          for f in b.findings]
    # The same programs on the same batches: the training and overfit curves agree exactly.
    assert a.curves["loss"] == b.curves["loss"] and len(a.curves["loss"]) == 20
    assert a.curves["overfit_loss"] == b.curves["overfit_loss"]
    assert a.by_check("init_loss").evidence == b.by_check("init_loss").evidence


def test_a_files_step_is_examined_with_its_pieces_and_without_a_loss(tmp_path):
    # The file's own step with clipping, and no module-level `loss`: the semantics check checks
    # the clipping it reads from that step (skipped for a step without it).
    text = PIECES.replace("def loss(", "def _loss(") + \
        "step = fg.make_train_step(_loss, optax.chain(fg.clip_by_global_norm(0.5), optimizer))\n"
    report = doctor_file(_file(tmp_path, "clipped.py", text), checks=["semantics"],
                         options=DoctorOptions(steps=5))
    f = report.by_check("semantics")
    assert f.verdict == "pass" and "clip_by_global_norm(0.5)" in f.summary, f.summary
    assert "TrainStep(Loss(_loss" in report.subject


def test_a_files_classes_fill_the_options_the_caller_leaves_none(tmp_path):
    path = _file(tmp_path, "model.py", PIECES)
    f = doctor_file(path, checks=["init_loss"]).by_check("init_loss")
    assert (f.evidence["classes"], f.evidence["classes_from"]) == (3, "classes")
    f = doctor_file(path, checks=["init_loss"],
                    options=DoctorOptions(classes=4)).by_check("init_loss")
    assert f.evidence["classes"] == 4


def test_model_file_errors_for_step_kwargs_and_a_step_that_is_not_one(tmp_path):
    old = _file(tmp_path, "old.py", PIECES + 'step_kwargs = {"clip_norm": 1.0}\n')
    with pytest.raises(ModelFileError, match="step_kwargs is no longer read") as error:
        doctor_file(old)
    assert "step = fg.make_train_step(loss, optimizer), with clipping" in str(error.value)
    hand = _file(tmp_path, "hand.py", PIECES + "def step(state, batch):\n    return state, {}\n")
    with pytest.raises(ModelFileError, match="`step` must be a funcgrad.TrainStep"):
        doctor_file(hand)
    no_init = _file(tmp_path, "no_init.py", PIECES.replace("def init(", "def _init(")
                    + "step = fg.make_train_step(loss, optimizer)\n")
    with pytest.raises(ModelFileError, match="does not define init "):
        doctor_file(no_init)
