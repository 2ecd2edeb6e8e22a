"""funcgrad.doctor: each check on a healthy model and on a small hand-made fault, the report's
outputs, and a check that crashes. Each doctor run here runs only the checks it is about
(compilation is most of the time)."""
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.doctor import CHECKS, DoctorReport, Finding, ModelFileError, doctor

from . import _small


def run(loss=_small.loss, params=None, data=None, *, step=None, optimizer=None, checks=None,
        **options):
    """The doctor on the small model (classes=K and `options`): `step`, by default
    make_train_step(loss, optimizer or Adam 1e-3), at its init from `params`."""
    if step is None:
        step = fg.make_train_step(loss, optimizer or fg.make_optimizer("adam", 1e-3))
    state = step.init(_small.params() if params is None else params)
    return doctor(step, state, _small.data() if data is None else data, checks=checks,
                  options=fg.DoctorOptions(classes=_small.K, **options))


def test_the_checks_are_the_interface_names():
    assert CHECKS == ("data", "init_loss", "grad_flow", "fd_audit", "nonfinite", "grad_stats",
                      "training", "overfit", "baseline", "semantics", "memory")
    assert fg.doctor.CHECKS is CHECKS and callable(fg.doctor)
    assert issubclass(ModelFileError, ValueError)


def test_a_healthy_model_passes_every_check():
    report = run()
    assert [f.check for f in report.findings] == list(CHECKS)
    verdicts = {f.check: f.verdict for f in report.findings}
    assert verdicts == {**{c: "pass" for c in CHECKS}, "semantics": "skipped"}, report.table()
    assert report.exit_code == 0
    assert all(f.seconds > 0 for f in report.findings if f.verdict != "skipped")
    # The loss at init of a near-uniform classifier is about log(3) = 1.0986.
    init = report.by_check("init_loss")
    assert init.evidence["expected"] == pytest.approx(math.log(3), rel=1e-12)
    assert 0.5 < init.evidence["ratio"] < 2.0


def test_data_shifted_labels_fail_and_name_the_label_leaf():
    d = _small.data()
    d["y"] = d["y"] + 1  # 1..3 for K = 3
    report = run(data=d, checks=["data"])
    f = report.by_check("data")
    assert f.verdict == "fail" and "shifted" in f.summary, f.summary
    assert f.place["leaf"] == "data['y']"
    assert report.exit_code == 1


def test_data_nan_feature_fails_naming_its_rows():
    d = _small.data()
    d["x"][[5, 17], 2] = np.nan
    f = run(data=d, checks=["data"]).by_check("data")
    assert f.verdict == "fail" and f.evidence["nonfinite"]["rows"] == [5, 17]
    assert f.evidence["nonfinite"]["features"] == [2]


def test_data_constant_input_fails_and_a_zero_column_passes():
    d = _small.data()
    d["x"][:, 3] = 0.0  # a blank pixel: not a fault
    assert run(data=d, checks=["data"]).by_check("data").verdict == "pass"
    d["x"][:] = 1.5
    f = run(data=d, checks=["data"]).by_check("data")
    assert f.verdict == "fail" and "same for every example" in f.summary


def test_data_a_nonzero_constant_column_passes_and_constant_tokens_fail():
    d = _small.data()
    d["x"][:, 3] = -0.0373  # a blank pixel after standardisation: harmless to the gradients
    f = run(data=d, checks=["data"]).by_check("data")
    assert f.verdict == "pass", f.summary
    d["x"][:, :6] = 0.25    # most of the input constant: the input was lost
    f = run(data=d, checks=["data"]).by_check("data")
    assert f.verdict == "warn" and "6 of the 8 features" in f.summary, f.summary

    def token_loss(params, batch):
        x = jax.nn.one_hot(batch["tokens"], 8).sum(axis=1)
        return _small.loss(params, {"x": x, "y": batch["y"]})
    d = _small.data()
    tokens = np.zeros((len(d["y"]), 5), np.int32)
    f = run(token_loss, data={"tokens": tokens, "y": d["y"]}, checks=["data"]).by_check("data")
    assert f.verdict == "fail" and f.place["leaf"] == "data['tokens']", f.summary
    tokens[::2, 1] = 3
    f = run(token_loss, data={"tokens": tokens, "y": d["y"]}, checks=["data"]).by_check("data")
    assert f.verdict == "pass", f.summary


def test_data_coupling_through_the_batch_is_found():
    # Centring the logits on the batch mean couples every example with every other one; the
    # plain mean of per-example losses has a block-diagonal Hessian in the inputs (exactly 0
    # across examples).
    healthy = run(checks=["data"]).by_check("data")
    assert healthy.evidence["coupling"]["coupled"] is False
    assert healthy.evidence["coupling"]["relative_cross_term"] == 0.0
    f = run(_small.mean_logits_loss, checks=["data"]).by_check("data")
    assert f.verdict == "warn" and "coupled" in f.summary


def test_data_coupling_probe_works_through_a_custom_vjp():
    @jax.custom_vjp
    def square(x):
        return x * x

    square.defvjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))

    def loss(params, batch):
        return _small.loss(params, {"x": square(batch["x"]), "y": batch["y"]})
    f = run(loss, checks=["data"]).by_check("data")
    assert f.verdict == "pass", f.summary
    assert f.evidence["coupling"]["coupled"] is False


def test_init_loss_warns_on_large_initial_logits():
    params = _small.params()
    params = [params[0], {"w": params[1]["w"] * 100.0, "b": params[1]["b"]}]
    f = run(params=params, checks=["init_loss"]).by_check("init_loss")
    assert f.verdict == "warn" and f.evidence["ratio"] > 2.0


def test_init_loss_words_the_cause_by_the_evidence():
    def summed(params, batch):
        return _small.loss(params, batch) * batch["y"].shape[0]
    f = run(summed, checks=["init_loss"]).by_check("init_loss")
    assert f.verdict == "warn" and "looks summed" in f.summary, f.summary

    def scaled(params, batch):
        return _small.loss(params, batch) * 1024.0
    f = run(scaled, checks=["init_loss"]).by_check("init_loss")
    assert f.verdict == "warn" and "multiplied by a constant" in f.summary, f.summary
    assert "large and confident" not in f.summary

    params = _small.params()
    params[1]["w"] = params[1]["w"] * 300.0  # one layer drawn far too large
    f = run(params=params, checks=["init_loss"]).by_check("init_loss")
    assert f.verdict == "warn" and f.place["layer"] == "params[1]", (f.summary, f.place)


def test_grad_flow_names_a_detached_and_an_unused_leaf():
    def detached(params, batch):
        frozen = [params[0], {"w": jax.lax.stop_gradient(params[1]["w"]), "b": params[1]["b"]}]
        return _small.loss(frozen, batch)

    f = run(detached, checks=["grad_flow"]).by_check("grad_flow")
    assert f.verdict == "fail" and f.place["leaf"] == "params[1]['w']"
    assert "blocked_by_stop_gradient" in f.summary
    assert f.place["line"].startswith("test_doctor.py:")
    params = {"net": _small.params(), "extra": jnp.ones(4)}
    f = run(lambda params, batch: _small.loss(params["net"], batch), params=params,
            checks=["grad_flow"]).by_check("grad_flow")
    assert f.verdict == "fail" and f.place["leaf"] == "params['extra']" and "unused" in f.summary


@jax.custom_vjp
def _scaled_tanh(x):
    return jnp.tanh(x)


def _fwd(x):
    return jnp.tanh(x), x


def _bwd(x, g):
    return (1.1 * g * (1 - jnp.tanh(x) ** 2),)  # 10% too large


_scaled_tanh.defvjp(_fwd, _bwd)


def test_fd_audit_names_a_wrong_custom_rule():
    def loss(params, batch):
        h = _scaled_tanh(batch["x"] @ params[0]["w"] + params[0]["b"][None])
        return fg.softmax_cross_entropy(h @ params[1]["w"] + params[1]["b"][None], batch["y"])

    f = run(loss, checks=["fd_audit"]).by_check("fd_audit")
    assert f.verdict == "fail", f.summary
    assert "_scaled_tanh" in f.summary or "_bwd" in f.summary or "_scaled_tanh" in f.fix
    assert run(checks=["fd_audit"]).by_check("fd_audit").verdict == "pass"


def test_fd_audit_does_not_fail_a_correct_gradient_at_a_relu_kink():
    # healthy_aux's check rows put a ReLU pre-activation 6.6e-7 from its kink: the gradient is
    # right, and the disagreement goes away on other rows (a wrong rule's would not).
    from funcgrad.doctor import doctor_file

    path = pathlib.Path(__file__).parent / "models" / "healthy_aux.py"
    with jax.numpy_rank_promotion("allow"):
        f = doctor_file(path, checks=["fd_audit"]).by_check("fd_audit")
    assert f.verdict == "pass", f.summary
    assert f.evidence["recheck"]["still_failing"] == []


def test_fd_audit_skips_a_non_finite_loss():
    d = _small.data()
    d["x"][0, 0] = np.nan
    f = run(data=d, checks=["fd_audit"]).by_check("fd_audit")
    assert f.verdict == "skipped" and "not finite" in f.summary, f.summary


def test_nonfinite_locates_the_log_of_zero():
    def loss(params, batch):
        probs = jax.nn.softmax(fg.mlp_apply(params, batch["x"], activation="tanh") * 0.0)
        return -jnp.mean(jnp.log(probs - probs))  # log(0): -inf, its gradient inf

    f = run(loss, checks=["nonfinite"]).by_check("nonfinite")
    assert f.verdict == "fail" and f.place.get("primitive") == "log", f.summary
    assert f.place["line"].startswith("test_doctor.py:")


def _dead_relu_loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"][None])
    return fg.softmax_cross_entropy(h @ params["out"]["w"], batch["y"])


def test_grad_stats_names_the_layer_feeding_dead_relu_units():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"hidden": {"w": jax.random.normal(k1, (8, 16)) * 0.3, "b": jnp.full(16, -20.0)},
              "out": {"w": jax.random.normal(k2, (16, _small.K)) * 0.25}}
    f = run(_dead_relu_loss, params=params, checks=["grad_stats"]).by_check("grad_stats")
    assert f.verdict == "warn" and "dead" in f.summary, f.summary
    assert f.place["layer"] == "params['hidden']", f.place
    assert "params['hidden']['w']" in f.summary


def test_training_fails_when_the_learning_rate_is_far_too_high():
    f = run(optimizer=fg.make_optimizer("sgd", 300.0), checks=["training"],
            steps=40).by_check("training")
    assert f.verdict == "fail", f.summary


def test_training_advises_clipping_from_the_observed_norms():
    f = run(checks=["training"], steps=30).by_check("training")
    norms = np.asarray(run(checks=["training"], steps=30).curves["grad_norm"])
    assert f.verdict == "pass"
    # The 90th percentile of the observed norms, as numpy computes it from the same curve.
    assert f.evidence["grad_norm_p90"] == pytest.approx(float(np.quantile(norms, 0.9)),
                                                        rel=1e-12)
    assert f"fg.clip_by_global_norm({f.evidence['grad_norm_p90']:.3g})" in f.fix


def test_overfit_fails_when_the_labels_cannot_be_reached():
    # The logits are detached from the params: the loss cannot move at all.
    def loss(params, batch):
        logits = jax.lax.stop_gradient(fg.mlp_apply(params, batch["x"], activation="tanh"))
        return fg.softmax_cross_entropy(logits, batch["y"]) + 0.0 * params[0]["b"].sum()

    f = run(loss, checks=["overfit"], overfit_steps=30).by_check("overfit")
    assert f.verdict == "fail" and f.evidence["loss_last"] == pytest.approx(
        f.evidence["loss_first"], rel=1e-6)


def test_baseline_warns_when_the_model_ignores_its_input():
    def loss(params, batch):  # the input never reaches the logits: only the bias learns
        logits = fg.mlp_apply(params, batch["x"] * 0.0, activation="tanh")
        return fg.softmax_cross_entropy(logits, batch["y"])

    f = run(loss, checks=["baseline"], steps=60).by_check("baseline")
    assert f.verdict == "warn", f.summary


def test_baseline_of_a_regression_is_the_mean_target_and_keeps_the_target():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (np.sin(x[:, 0]) + 0.5 * x[:, 1]).astype(np.float32)

    def loss(params, batch):
        return fg.mean_squared_error(fg.mlp_apply(params, batch["x"])[:, 0], batch["y"])

    params = fg.mlp_init(jax.random.key(0), (8, 16, 1), activation="tanh")
    step = fg.make_train_step(loss, fg.make_optimizer("adam", 1e-2))
    f = doctor(step, step.init(params), {"x": x, "y": y}, checks=["baseline"],
               options=fg.DoctorOptions(steps=150)).by_check("baseline")
    assert f.verdict == "pass", f.summary
    held = y[-64:]  # the check's held-out rows
    assert f.evidence["baselines"]["mean_target"] == pytest.approx(float(np.var(held)), rel=1e-3)
    assert f.evidence["baselines"]["mean_input"] > 0.5 * f.evidence["baselines"]["mean_target"]


def test_semantics_accumulation_divided_by_the_micro_batch_count_fails():
    def divided(params, batch):  # the PyTorch habit loss / accum_steps, under accumulate=4
        return _small.per_example(params, batch) / 4.0

    good = run(fg.accumulate(_small.per_example, 4),
               checks=["semantics"]).by_check("semantics")
    assert good.verdict == "pass", good.summary
    assert good.evidence["accumulate"]["relative_error"] < 1e-5
    # Both gradients come from the same divided loss, so they agree: dividing is not visible
    # to this comparison... but a loss normalised by its own batch size is.
    def normalised(params, batch):
        losses = _small.per_example(params, batch)
        return losses / losses.shape[0]

    f = run(fg.accumulate(normalised, 4), checks=["semantics"]).by_check("semantics")
    assert f.verdict == "fail" and "accumulate=4" in f.summary
    assert f.evidence["accumulate"]["norm_ratio"] == pytest.approx(4.0, rel=1e-4)
    assert run(fg.accumulate(divided, 4),
               checks=["semantics"]).by_check("semantics").verdict == "pass"


def test_semantics_frozen_leaves_stay_put_and_clipping_uses_the_true_norm():
    params = _small.params()
    mask = fg.trainable_mask(params, freeze="0/*")
    step = fg.make_train_step(_small.loss, optax.chain(fg.clip_by_global_norm(0.5),
                                                       fg.make_optimizer("adam", 1e-3)),
                              trainable=mask)
    f = run(params=params, step=step,
            checks=["semantics"]).by_check("semantics")
    assert f.verdict == "pass", f.summary
    assert f.evidence["trainable"]["frozen"] == ["params[0]['b']", "params[0]['w']"]
    assert f.evidence["trainable"]["frozen_moved"] == []


def test_semantics_a_freeze_inside_the_optimizer_undone_by_weight_decay_fails():
    import optax

    params = _small.params()
    mask = jax.tree.unflatten(jax.tree.structure(params), [True, True, False, False])
    leaky = optax.chain(optax.masked(optax.set_to_zero(), mask),
                        optax.add_decayed_weights(1e-2), optax.sgd(0.1))
    f = run(optimizer=leaky, checks=["semantics"]).by_check("semantics")
    assert f.verdict == "fail" and "frozen inside the optimizer" in f.summary, f.summary
    assert f.place["leaf"] == "params[0]['w']"
    tight = optax.chain(optax.add_decayed_weights(1e-2),
                        optax.masked(optax.set_to_zero(), mask), optax.sgd(0.1))
    f = run(optimizer=tight, checks=["semantics"]).by_check("semantics")
    assert f.verdict == "skipped", f.summary
    # Adam's first step is -lr * sign(g): a one-element leaf must not look gradient-blind.
    params = {"w": jnp.ones((8, 3)) * 0.1, "b": jnp.zeros(1)}

    def loss(p, batch):
        return fg.softmax_cross_entropy(batch["x"] @ p["w"] + p["b"][0], batch["y"])
    for seed in range(4):  # (random probe gradients: several draws)
        f = run(loss, params=params, checks=["semantics"], seed=seed).by_check("semantics")
        assert f.verdict == "skipped", f.summary


def test_a_crashing_check_is_an_error_and_the_others_still_run(monkeypatch):
    from funcgrad.doctor.checks import init_loss

    def broken(ctx):
        raise RuntimeError("boom")
    monkeypatch.setattr(init_loss, "check", broken)
    report = run(checks=["init_loss", "grad_flow"])
    assert report.by_check("init_loss").verdict == "error"
    assert "RuntimeError: boom" in report.by_check("init_loss").summary
    assert report.by_check("grad_flow").verdict == "pass"
    assert report.exit_code == 3  # no fail, but the checklist is incomplete


def test_a_linen_model_file_whose_call_needs_train_is_loaded_in_training_mode():
    from funcgrad.doctor import load_model_file

    path = pathlib.Path(__file__).parent / "models" / "bn_stats_linen_momentum.py"
    pieces = load_model_file(path)
    loss, state = pieces["step"].loss, pieces["state"]
    batch = jax.tree.map(lambda x: x[:4], pieces["data"])
    out = loss.bind(state.model_state)(state.params, batch)
    assert np.isfinite(float(out)) and loss.has_state
    # Evaluation in the inference mode: running statistics, so the loss of a batch is the mean
    # of its examples' losses (in training mode, batch statistics couple them).
    held = pieces["eval_loss"].bind(state.model_state)
    rows = [float(held(state.params, jax.tree.map(lambda x, i=i: x[i:i + 1], batch)))
            for i in range(4)]
    assert float(held(state.params, batch)) == pytest.approx(np.mean(rows), rel=1e-5)


LINEN_WITHOUT_TRAIN = """
import flax.linen as nn, jax, numpy as np, funcgrad as fg
from funcgrad.interop import from_linen

class Net(nn.Module):                    # the usual linen model: no `train` keyword
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.gelu(nn.LayerNorm()(nn.Dense(32)(x))))

d = fg.load_digits(seed=0)
data = {"x": d.x_train[:64], "y": d.y_train[:64]}
model = from_linen(Net(), Net().init(jax.random.key(0), data["x"][:1]))
objective = lambda logits, batch: fg.softmax_cross_entropy(logits, batch["y"])
"""


def test_a_linen_model_file_whose_call_takes_no_train_is_loaded_plainly(tmp_path):
    # from_linen names its library "flax.linen"; the fallback once compared with "linen" and
    # a linen module without `train` (the usual kind) stopped with a usage error (exit 2).
    from funcgrad.doctor import load_model_file

    path = tmp_path / "net.py"
    path.write_text(LINEN_WITHOUT_TRAIN)
    pieces = load_model_file(path)
    batch = jax.tree.map(lambda x: x[:4], pieces["data"])
    loss, state = pieces["step"].loss, pieces["state"]
    value = loss.bind(state.model_state, jax.random.key(0))(state.params, batch)
    # The same loss by flax's own apply and optax's cross-entropy (a second method).
    logits = pieces_model_apply(path, batch["x"])
    expected = fg.softmax_cross_entropy(logits, batch["y"])
    assert float(value) == pytest.approx(float(expected), rel=1e-6)


def pieces_model_apply(path, x):
    import runpy

    names = runpy.run_path(str(path))
    module, variables = names["Net"](), {"params": names["model"].params}
    return module.apply(variables, x)


def test_bad_pieces_are_model_file_errors():
    with pytest.raises(ModelFileError, match="different numbers of examples"):
        run(data={"x": np.zeros((10, 8), np.float32), "y": np.zeros(9, np.int32)})
    with pytest.raises(ModelFileError, match="the loss does not run"):
        run(data={"x": np.zeros((10, 7), np.float32), "y": np.zeros(10, np.int32)})
    with pytest.raises(ValueError, match="unknown check"):
        run(checks=["dat"])


def test_report_outputs(tmp_path):
    report = run(checks=["init_loss", "training"], steps=20)
    table = report.table()
    assert table.splitlines()[1].split() == ["check", "verdict", "time", "summary"]
    assert "init_loss" in table and "exit status 0" in table
    data = json.loads(pathlib.Path(report.to_json(tmp_path / "r.json")).read_text())
    assert [f["check"] for f in data["findings"]] == ["init_loss", "training"]
    assert len(data["curves"]["loss"]) == 20
    page = pathlib.Path(report.to_html(tmp_path / "r.html")).read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("data:image/png;base64,") >= 1
    assert "src='http" not in page and "<script" not in page  # self-contained


def test_findings_order_worst_first_in_the_table():
    report = DoctorReport([Finding("data", "pass", "ok"), Finding("memory", "fail", "bad"),
                           Finding("overfit", "warn", "hmm")])
    rows = report.table().splitlines()[2:5]
    assert [r.split()[0] for r in rows] == ["memory", "overfit", "data"]
    assert report.exit_code == 1
    with pytest.raises(ValueError, match="verdict"):
        Finding("data", "ok", "x")
