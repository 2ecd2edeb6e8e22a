"""The functional train step: optimizers, clipping, the non-finite guard, masks, anomaly
detection in the step (concepts 10, 13)."""
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import half_squared_norm, mlp_problem

import funcgrad as fg


def test_step_equals_hand_written_step():
    # Second method: the plain jit(value_and_grad + optax update) loop users write by hand.
    params, batch, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    step = fg.make_train_step(loss_fn, tx)
    state = step.init(params)
    ref_params, ref_opt = params, tx.init(params)
    for _ in range(3):
        state, metrics = step(state, batch)
        ref_loss, grads = jax.value_and_grad(loss_fn)(ref_params, batch)
        updates, ref_opt = tx.update(grads, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
        # float32, same ops in a different fusion: agreement to a few ulps of values ~1.
        np.testing.assert_allclose(metrics["grad_norm"], np.linalg.norm(flat), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 3


@pytest.mark.parametrize("max_norm, expected", [
    # p = (3, 4): g = p, ||g|| = 5. Clipped to 0.5, g' = g * 0.5/5 = (0.3, 0.4); SGD lr=1 gives
    # p - g' = (2.7, 3.6): the same direction, shortened.
    (0.5, [2.7, 3.6]),
    # ||g|| = 5 <= 10: no clipping, p - g = (0, 0).
    (10.0, [0.0, 0.0]),
], ids=["clipped", "under_the_bound"])
def test_clip_by_global_norm_reports_preclip_norm(max_norm, expected):
    tx = optax.chain(fg.clip_by_global_norm(max_norm), optax.sgd(1.0))
    step = fg.make_train_step(half_squared_norm, tx)
    state, metrics = step(step.init({"p": jnp.array([3.0, 4.0])}), {})
    assert float(metrics["grad_norm"]) == pytest.approx(5.0, rel=1e-6)
    # The coefficient: min(1, max_norm / 5) = 0.1 clipped, 1 under the bound.
    assert float(metrics["clip_coef"]) == pytest.approx(min(1.0, max_norm / 5.0), rel=1e-6)
    np.testing.assert_allclose(state.params["p"], expected, rtol=1e-6, atol=1e-6)


def test_optimizers_by_name():
    assert isinstance(fg.make_optimizer("sgd", 0.1), optax.GradientTransformation)
    tx = optax.sgd(0.1)
    assert fg.make_optimizer(tx) is tx
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        fg.make_optimizer("rmsprop")
    with pytest.raises(ValueError, match="learning_rate must be a positive"):
        fg.make_optimizer("adam", -1.0)
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\)"):
        fg.make_optimizer("momentum", 0.1, momentum=1.5)
    # A string or bool learning rate passes float() but fails later inside optax: refused.
    with pytest.raises(ValueError, match=r"got '1e-3' \(a string: pass the number, e\.g\. 1e-3\)"):
        fg.make_optimizer("adam", "1e-3")
    with pytest.raises(ValueError, match="learning_rate must be a positive finite number"):
        fg.make_optimizer("sgd", True)
    assert isinstance(fg.make_optimizer("sgd", np.float32(0.1)), optax.GradientTransformation)
    assert isinstance(fg.make_optimizer("adam", optax.constant_schedule(1e-3)),
                      optax.GradientTransformation)
    with pytest.raises(TypeError, match="optimizer must be a name"):
        fg.make_optimizer(3)


def test_step_errors_are_clear():
    params, batch, loss_fn = mlp_problem()
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        fg.clip_by_global_norm(0.0)
    per_example = fg.make_train_step(lambda p, b: fg.mlp_apply(p, b["x"]).sum(axis=1),
                                     optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar, got shape \(5,\)"):
        per_example(per_example.init(params), batch)
    step = fg.make_train_step(loss_fn, optax.adam(1e-3))
    momentum = fg.make_train_step(loss_fn, optax.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match="not made by this optimizer"):
        step(momentum.init(params), batch)
    other = fg.mlp_init(jax.random.key(0), (6, 9, 3))  # same structure, other shapes
    with pytest.raises(ValueError, match="leaf shapes differ"):
        step(fg.TrainState(params, optax.adam(1e-3).init(other), jnp.zeros((), jnp.int32)), batch)
    tupled = fg.make_train_step(lambda p, b: (loss_fn(p, b), 0.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match="loss_fn returned a tuple of 2"):
        tupled(tupled.init(params), batch)
    with pytest.raises(TypeError, match="takes a TrainState"):
        step((params, None, 0), batch)
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        fg.fit(step, step.init(params),
               fg.Batches(np.zeros((2, 6)), np.zeros(2), batch_size=1), epochs=0)


def sqrt_problem(params, batch):
    # L = sum(w^2) + sum(sqrt(v)). At v = (0, 4): L is finite (0 + 2) but dL/dv = 1/(2 sqrt v)
    # is inf at v[0] = 0. dL/dw = 2w.
    del batch
    return jnp.sum(params["w"] ** 2) + jnp.sum(jnp.sqrt(params["v"]))


SQRT_PARAMS = {"w": jnp.array([1.0, -2.0]), "v": jnp.array([0.0, 4.0])}


def test_nonfinite_skip_leaves_the_state_bit_identical():
    step = fg.make_train_step(sqrt_problem, optax.adam(0.1))
    state = step.init(SQRT_PARAMS)
    new, metrics = step(state, {})
    assert int(metrics["skipped"]) == 1 and math.isinf(float(metrics["grad_norm"]))
    assert fg.train.step_was_skipped(metrics)
    for a, b in zip(jax.tree.leaves((new.params, new.opt_state)),
                    jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(a, b)   # params, Adam moments and Adam's count: untouched
    assert int(new.step) == 1                 # the call is counted; the skip is in the metrics


@pytest.mark.parametrize("max_norm", [None, 100.0])
def test_zero_nonfinite_applies_the_finite_leaves(max_norm):
    # The v leaf's gradient holds an inf: zeroed, so v stays. w's gradient 2w = (2, -4) is
    # applied with SGD lr = 0.1: w' = w - 0.2 w = (0.8, -1.6). ||(2, -4)|| = 4.47 < 100: no clip.
    clip = [] if max_norm is None else [fg.clip_by_global_norm(max_norm)]
    step = fg.make_train_step(sqrt_problem,
                              optax.chain(fg.zero_nonfinite(), *clip, optax.sgd(0.1)))
    new, metrics = step(step.init(SQRT_PARAMS), {})
    np.testing.assert_allclose(new.params["w"], [0.8, -1.6], rtol=1e-6)
    np.testing.assert_array_equal(new.params["v"], SQRT_PARAMS["v"])
    assert int(metrics["skipped"]) == 0 and int(metrics["nonfinite_leaves"]) == 1
    assert int(new.step) == 1
    if max_norm is not None:
        # With a clip after the zeroing, grad_norm is the pre-clip norm of the gradient
        # applied: ||(2, -4)|| = sqrt(20), the v leaf zeroed.
        np.testing.assert_allclose(metrics["grad_norm"], np.sqrt(20.0), rtol=1e-6)
        assert float(metrics["clip_coef"]) == 1.0
    else:
        # Without a clip, grad_norm is the raw gradient's: the v leaf's inf makes it inf.
        assert math.isinf(float(metrics["grad_norm"]))


def test_a_state_and_a_step_made_with_different_extras_are_refused():
    # A state carrying a monitor or a loss scale given to a step without one would carry them
    # along unchanged; a MultiSteps optimizer is pointed to accumulate=. The monitor's state is
    # in the optimizer state now: a monitored step's state fails the optimizer-state check.
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones(2)}
    loss = lambda p, b: jnp.sum(p["w"] ** 2)
    plain = fg.make_train_step(loss, tx)
    monitored = fg.make_train_step(loss, optax.chain(fg.grad_monitor(), tx))
    with pytest.raises(ValueError, match="not made by this optimizer"):
        plain(monitored.init(params), {})
    with pytest.raises(ValueError, match="not made by this optimizer"):
        monitored(plain.init(params), {})
    scaled = fg.make_train_step(
        fg.mixed_precision(loss, jnp.bfloat16, loss_scale=fg.dynamic_loss_scale()), tx)
    with pytest.raises(ValueError, match="has a loss-scale state but this step scales no loss"):
        plain(scaled.init(params), {})
    with pytest.raises(TypeError, match=r"MultiSteps.*accumulate=K.*gradient_transformation\(\)"):
        fg.make_train_step(loss, optax.MultiSteps(tx, 4))


def test_nonfinite_raise_makes_fit_raise():
    tx = optax.sgd(0.1)
    step = fg.make_train_step(lambda p, b: sqrt_problem(p, b) + 0.0 * jnp.sum(b["x"]), tx,
                              nonfinite="raise")
    x, y = np.ones((4, 2), np.float32), np.zeros(4, np.int32)
    with pytest.raises(FloatingPointError, match="non-finite value at step 0"):
        fg.fit(step, step.init(SQRT_PARAMS), fg.Batches(x, y, batch_size=2),
               epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('skip', 'raise'\)"):
        fg.make_train_step(sqrt_problem, tx, nonfinite="ignore")


def test_trainable_mask_in_the_step_freezes_exactly():
    # Layer 0 frozen: after 10 Adam steps it is bit-identical, and layer 1 equals a hand-written
    # loop that trains layer 1 alone (second method) with layer 0 held as a constant.
    params, batch, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    mask = fg.trainable_mask(params, freeze="0/*")
    step = fg.make_train_step(loss_fn, tx, trainable=mask)
    state = step.init(params)
    top, top_opt = params[1], tx.init(params[1])
    top_loss = lambda top: loss_fn([params[0], top], batch)
    for _ in range(10):
        state, metrics = step(state, batch)
        grads = jax.grad(top_loss)(top)
        updates, top_opt = tx.update(grads, top_opt, top)
        top = optax.apply_updates(top, updates)
    for a, b in zip(jax.tree.leaves(state.params[0]), jax.tree.leaves(params[0])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(state.params[1]), jax.tree.leaves(top)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # A state made without the mask is refused with a hint.
    with pytest.raises(ValueError, match=r"without the same mask: create it with this "
                                         r"step's step\.init\(params\)"):
        step(fg.make_train_step(loss_fn, tx).init(params), batch)


def test_detect_anomaly_names_the_line_and_costs_nothing_when_off():
    def loss_fn(params, batch):
        return jnp.mean(jnp.sqrt(batch["x"] @ params["w"]))    # sqrt of a negative: NaN
    params = {"w": jnp.ones((2,))}
    batch = {"x": jnp.array([[1.0, 1.0], [-3.0, 1.0]]), "y": jnp.zeros(2, jnp.int32)}
    tx = optax.sgd(0.1)
    plain = fg.make_train_step(loss_fn, tx)
    # off: a call goes straight to the plain jitted step
    assert isinstance(plain._built.call, type(jax.jit(lambda s, b: s)))
    step = fg.detect_anomaly(fg.make_train_step(loss_fn, tx))
    _, metrics = step(step.init(params), batch)
    report = metrics["anomaly"]
    assert (report.phase, report.primitive) == ("forward", "sqrt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = fg.fit(step, step.init(params),
                        fg.Batches(batch["x"], batch["y"], batch_size=2), epochs=1,
                        progress=False)
    assert result.nonfinite.anomaly.primitive == "sqrt" and "sqrt" in str(result.nonfinite)
    assert result.nonfinite.to_dict()["anomaly"]["phase"] == "forward"


@pytest.mark.float16
def test_detect_anomaly_evaluates_in_the_compute_dtype_and_skips_routine_overflows():
    # exp(12 w) at w = 1 is 162754.8: finite in float32, inf in float16 (max 65504). The step
    # runs in float16, so its loss is inf; located in float32 it would look fine, so the
    # report must come from a float16 evaluation: forward, exp, this file's line.
    def loss_fn(params, batch):
        return jnp.mean(jnp.exp(params["w"] * batch["x"]))

    tx = optax.sgd(0.1)
    scale = fg.dynamic_loss_scale(init_scale=2.0**4)
    step = fg.detect_anomaly(fg.make_train_step(fg.mixed_precision(loss_fn, jnp.float16,
                                                                   loss_scale=scale), tx))
    state = step.init({"w": jnp.ones((), jnp.float32)})
    _, metrics = step(state, {"x": jnp.array([12.0, 0.0])})
    report = metrics["anomaly"]
    assert (report.phase, report.primitive) == ("forward", "exp")
    assert report.file.endswith("test_train.py")
    # Found at scale 1 (the loss scale is not what overflows here), in float16.
    assert report.context[0] == "the loss as the step computes it: float16"
    # x = 8: exp(8) = 2981 is finite in float16, but the scaled backward overflows at a scale
    # of 2**15 (d/dw = x exp(w x) / 2 * 32768 = 8 * 2981 / 2 * 32768 ~ 3.9e8 > 65504): a
    # routine loss-scale skip, not an anomaly; the scale backs off and nothing is located.
    big = fg.dynamic_loss_scale(init_scale=2.0**15)
    step = fg.detect_anomaly(fg.make_train_step(fg.mixed_precision(loss_fn, jnp.float16,
                                                                   loss_scale=big), tx))
    state = step.init({"w": jnp.ones((), jnp.float32)})
    new_state, metrics = step(state, {"x": jnp.array([8.0, 0.0])})
    assert int(metrics["skipped"]) == 1 and "anomaly" not in metrics
    assert float(new_state.loss_scale.scale) == 2.0**14


@pytest.mark.float16
def test_detect_anomaly_locates_a_backward_nan_once_the_scale_cannot_back_off():
    # The gradient of sqrt(sum(b^2)) at b = 0 is 0/0 = NaN in the backward pass, while the
    # loss is finite. Under a loss scale at its floor (init = min = 1) the step is skipped
    # without backing off: not a routine overflow, so it is located (backward, sqrt, here).
    def loss_fn(params, batch):
        return jnp.mean(batch["x"] * params["w"]) + jnp.sqrt(jnp.sum(params["b"] ** 2))

    tx = optax.sgd(0.1)
    floor = fg.dynamic_loss_scale(init_scale=1.0, min_scale=1.0)
    step = fg.detect_anomaly(fg.make_train_step(fg.mixed_precision(loss_fn, jnp.float16,
                                                                   loss_scale=floor), tx))
    state = step.init({"w": jnp.ones(()), "b": jnp.zeros(2)})
    new_state, metrics = step(state, {"x": jnp.ones(4)})
    assert int(metrics["skipped"]) == 1 and float(new_state.loss_scale.scale) == 1.0
    report = metrics["anomaly"]
    assert (report.phase, report.primitive) == ("backward", "sqrt")
    assert report.file.endswith("test_train.py")


def test_half_precision_params_without_compute_dtype_warn_once():
    # bfloat16 has 8 significant bits, so small updates to a weight of 1 are lost. The step
    # trains as asked but warns once per trace.
    tx = optax.sgd(1e-4)
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    step = fg.make_train_step(lambda p, b: jnp.sum(p["w"].astype(jnp.float32) ** 2), tx)
    state = step.init(params)
    with pytest.warns(RuntimeWarning, match=r"params\['w'\] is bfloat16.*train "
                                             r"funcgrad\.mixed_precision\(loss_fn, "
                                             r"jnp\.bfloat16\)"):
        state, _ = step(state, {})
    # Hand: w - 1e-4 * 2w = 0.9998; the bfloat16 numbers around it are 1 - 2**-8 = 0.99609
    # and 1, and 0.9998 is nearer 1: the update rounds away, as the warning says.
    np.testing.assert_array_equal(np.asarray(state.params["w"], np.float32), np.ones(3))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call reuses the trace: no second warning
        step(state, {})
