"""The train step's guard and what it sees: non-finite updates (issue 11, point 1), a freeze
declared through the optimizer (point 6: fg.train_only) and integer leaves in the params
(point 10)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
import funcgrad.train.masks

# --- point 1: a non-finite update from a finite gradient is never applied ---------------------

def unused_leaf_loss(params, batch):
    """Scalar loss sum(w**2); params["u"] is unused, so its gradient is exactly 0."""
    del batch
    return jnp.sum(params["w"] ** 2)


def unused_leaf_per_example(params, batch):
    """The same loss, once per example of the micro-batch (for accumulate=)."""
    return jnp.sum(params["w"] ** 2) * jnp.ones_like(batch["x"])


_RECORDS = (fg.ClipState, fg.ZeroNonfiniteState, fg.MonitorState)


def _without_records(opt_state):
    """The optimizer state with the records of funcgrad's transformations taken out: a skipped
    step keeps their new values (the monitor counts it, the clip reports its norm)."""
    return jax.tree.map(lambda x: None if isinstance(x, _RECORDS) else x, opt_state,
                        is_leaf=lambda x: isinstance(x, _RECORDS))


def _assert_unchanged(new, state):
    for a, b in zip(jax.tree.leaves((new.params, _without_records(new.opt_state))),
                    jax.tree.leaves((state.params, _without_records(state.opt_state))),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def _scaled(loss):  # w = [1, 2], its gradient [2, 4] and the loss 5 are exact in bfloat16
    return fg.mixed_precision(loss, jnp.bfloat16, loss_scale=fg.dynamic_loss_scale())


# (the loss's pieces, the transformations chained before the optimizer, the step's keywords)
VARIANTS = {
    "plain": (None, [], {}),
    "zero": (None, [fg.zero_nonfinite()], {}),
    "raise": (None, [], {"nonfinite": "raise"}),
    "clip": (None, [fg.clip_by_global_norm(1.0)], {}),
    "loss_scale": (_scaled, [], {}),
    "compute_dtype": (lambda loss: fg.mixed_precision(loss, jnp.bfloat16), [], {}),
    "monitor": (None, [fg.grad_monitor()], {}),
    "accumulate": (lambda loss: fg.accumulate(loss, 2), [], {}),
    "accumulate+loss_scale": (lambda loss: _scaled(fg.accumulate(loss, 2)), [], {}),
}


@pytest.mark.parametrize("pieces, chained, kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_a_nonfinite_update_from_a_finite_gradient_is_skipped(pieces, chained, kwargs):
    # Adam with eps=0: for the unused leaf u, g = 0, so m = v = 0 and the update
    # -lr * m_hat / (sqrt(v_hat) + eps) is 0/0 = NaN, although loss and gradient are finite:
    # loss = 1 + 4 = 5 and the global norm is ||2w|| = sqrt(4 + 16) = sqrt(20).
    params = {"w": jnp.array([1.0, 2.0]), "u": jnp.array([3.0])}
    tx = optax.adam(0.1, eps=0.0)
    updates, _ = tx.update({"w": 2 * params["w"], "u": jnp.zeros(1)}, tx.init(params), params)
    assert np.isnan(updates["u"]).all() and np.isfinite(updates["w"]).all()  # the premise
    loss = fg.as_loss(unused_leaf_loss) if pieces is None else pieces(unused_leaf_loss)
    if loss.accumulation is not None:  # accumulation takes one loss per example
        loss = pieces(unused_leaf_per_example)
    step = fg.make_train_step(loss, optax.chain(*chained, tx) if chained else tx, **kwargs)
    state = step.init(params)
    if step.accumulate:
        batch = {"x": jnp.ones((2, 3))}  # 2 micro-batches of 3 examples: one update
        new, metrics = step(state, batch)
        metrics = jax.tree.map(lambda a: a[0], {k: v for k, v in metrics.items()
                                               if k not in ("examples", "dropped_examples")})
    else:
        batch = {"x": jnp.ones(3)}
        new, metrics = step(state, batch)
    _assert_unchanged(new, state)  # nothing applied (before: u became NaN)
    if step.monitor is not None:  # the monitor's record counts the skipped step
        assert int(fg.recorded(new.opt_state)["monitor_state"].step) == 1
    assert float(metrics["loss"]) == pytest.approx(5.0)
    assert float(metrics["grad_norm"]) == pytest.approx(math.sqrt(20.0))
    assert int(metrics["skipped"]) == 1 and fg.train.step_was_skipped(metrics)
    if step.loss_scale is not None:  # not an overflow of the scaled gradient: the scale stays
        assert float(new.loss_scale.scale) == float(state.loss_scale.scale)
    # which leaf: params['u'] alone (w's update -lr * sign(g) is finite)
    text = step.explain_skipped_update(state, batch)
    assert "params['u']" in text and "params['w']" not in text and "holds NaN/inf" in text


@pytest.mark.float16
def test_float16_params_with_adam_are_not_corrupted():
    # The case: make_optimizer("adam") has eps=1e-8, which is 0 in float16 (the
    # smallest float16 subnormal is 2**-24 ~ 6e-8), so the unused leaf's update is 0/0.
    assert float(jnp.float16(1e-8)) == 0.0
    params = {"w": jnp.array([1.0, 2.0], jnp.float16), "u": jnp.array([3.0], jnp.float16)}
    tx = fg.make_optimizer("adam")
    step = fg.make_train_step(unused_leaf_loss, tx)
    state = step.init(params)
    with pytest.warns(RuntimeWarning, match="float16"):
        new, metrics = step(state, {})
    _assert_unchanged(new, state)
    assert math.isfinite(float(metrics["loss"])) and math.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["skipped"]) == 1
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(new.params))


@pytest.mark.float16
def test_fit_stops_and_names_the_leaf_and_the_fix():
    params = {"w": jnp.array([1.0, 2.0], jnp.float16), "u": jnp.array([3.0], jnp.float16)}
    tx = fg.make_optimizer("adam")
    x, y = np.ones((8, 2), np.float32), np.zeros(8, np.int32)
    with pytest.warns(RuntimeWarning) as caught:
        step = fg.make_train_step(unused_leaf_loss, tx)
        result = fg.fit(step, step.init(params), fg.Batches(x, y, batch_size=4), epochs=1)
    report = result.nonfinite
    assert report is not None and report.step == 0
    assert math.isfinite(report.loss) and math.isfinite(report.grad_norm)
    text = str(report)
    assert "params['u'] (float16): its update holds NaN/inf" in text
    assert "funcgrad.mixed_precision(loss_fn, jnp.float16" in text and "eps=1e-4" in text
    assert any("params['u']" in str(w.message) for w in caught)
    for a, b in zip(jax.tree.leaves(result.state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)  # nothing was applied


@pytest.mark.float16
def test_an_update_that_overflows_the_params_is_skipped():
    # float16 holds at most 65504: w = 60000, loss = -w (gradient -1), SGD with lr 10000
    # gives the finite update +10000 and the new value 70000 -> inf.
    params = {"w": jnp.array([60000.0], jnp.float16)}
    tx = optax.sgd(1e4)
    step = fg.make_train_step(lambda p, b: -jnp.sum(p["w"]).astype(jnp.float32), tx)
    state = step.init(params)
    with pytest.warns(RuntimeWarning, match="float16"):
        new, metrics = step(state, {})
    _assert_unchanged(new, state)
    assert float(metrics["loss"]) == -60000.0 and float(metrics["grad_norm"]) == 1.0
    assert int(metrics["skipped"]) == 1
    assert "its update is finite but the new value overflows" in step.explain_skipped_update(
        state, {})


def test_a_finite_step_is_applied_and_explains_nothing():
    params = {"w": jnp.array([1.0, 2.0]), "u": jnp.array([3.0])}
    tx = optax.sgd(0.1)
    step = fg.make_train_step(unused_leaf_loss, tx)
    state = step.init(params)
    new, metrics = step(state, {})
    assert int(metrics["skipped"]) == 0
    np.testing.assert_allclose(new.params["w"], [1.0 - 0.1 * 2.0, 2.0 - 0.1 * 4.0])  # w - lr*2w
    assert step.explain_skipped_update(state, {}) == ""


# --- point 6: fg.train_only(optimizer, mask) is seen by the step ------------------------------

def _frozen_problem():
    """Two leaves; "big" is frozen and has gradient 1000 per element, "w" has gradient 2w."""
    params = {"w": jnp.array([0.3, 0.4]), "big": jnp.array([1.0, 1.0])}
    loss_fn = lambda p, b: jnp.sum(p["w"] ** 2) + 1000.0 * jnp.sum(p["big"])
    return params, loss_fn, fg.trainable_mask(params, freeze="big")


@pytest.mark.parametrize("how", ["train_only", "trainable", "both"])
def test_the_clip_and_the_monitor_see_only_the_applied_gradient(how):
    # grad w = 2w = (0.6, 0.8), norm 1.0 exactly up to rounding; big's gradient (1000, 1000)
    # is not applied, so clipping to 0.5 halves w's gradient: SGD(1) moves w by -(0.3, 0.4),
    # an update of norm 0.5. Over all leaves the norm would be ~1414 and the update ~3e4 x
    # too small. The monitor and the clip are in the chain that fg.train_only (or trainable=)
    # wraps: they see the trained leaf w only.
    params, loss_fn, mask = _frozen_problem()
    tx = optax.chain(fg.grad_monitor(), fg.clip_by_global_norm(0.5), optax.sgd(1.0))
    opt = fg.train_only(tx, mask) if how in ("train_only", "both") else tx
    trainable = mask if how in ("trainable", "both") else None
    step = fg.make_train_step(loss_fn, opt, trainable=trainable)
    state = step.init(params)
    new, metrics = step(state, {})
    assert float(metrics["grad_norm"]) == pytest.approx(1.0, rel=1e-6)
    assert float(metrics["clip_coef"]) == pytest.approx(0.5, rel=1e-6)
    assert float(metrics["monitor"].grad_norm) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(new.params["w"], [0.0, 0.0], atol=1e-6)
    np.testing.assert_array_equal(new.params["big"], params["big"])


def test_train_only_and_trainable_together_train_the_leaves_both_allow():
    # Gradients 1, 2, 3 per element of a, b, c (2 elements each). fg.train_only freezes a and
    # trainable= freezes b, so only c trains: grad_norm = ||(3, 3)|| = 3 sqrt(2), and SGD(0.1)
    # moves c by -0.3 while a and b keep their values.
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2), "c": jnp.zeros(2)}
    loss_fn = lambda p, _: jnp.sum(p["a"]) + 2 * jnp.sum(p["b"]) + 3 * jnp.sum(p["c"])
    tx = fg.train_only(optax.sgd(0.1), fg.trainable_mask(params, freeze="a"))
    mask = fg.trainable_mask(params, freeze="b")
    step = fg.make_train_step(loss_fn, tx, trainable=mask)
    new, metrics = step(step.init(params), {})
    assert float(metrics["grad_norm"]) == pytest.approx(3 * math.sqrt(2), rel=1e-6)
    np.testing.assert_array_equal(new.params["a"], [0.0, 0.0])
    np.testing.assert_array_equal(new.params["b"], [0.0, 0.0])
    np.testing.assert_allclose(new.params["c"], [-0.3, -0.3], rtol=1e-6)


def test_train_only_carries_its_mask():
    params, _, mask = _frozen_problem()
    frozen = fg.train_only(optax.adam(1e-3), mask)
    assert isinstance(frozen, optax.GradientTransformation) and frozen.trainable is mask
    assert funcgrad.train.masks.frozen_masks(fg.train_only(frozen, True)) == (True, mask)
    assert funcgrad.train.masks.frozen_masks(optax.chain(frozen)) == ()  # hidden inside a chain


# --- point 10: integer leaves --------------------------------------------------------------

def _counter_problem():
    """An MLP-like weight plus an int32 step counter and an int32 index table in the params."""
    params = {"w": jnp.array([1.0, -2.0]), "count": jnp.array(7),
              "index": jnp.array([1, 0], jnp.int32)}
    loss_fn = lambda p, b: jnp.sum(p["w"][p["index"]] ** 2)  # = sum(w**2), gradient 2w
    return params, loss_fn


def test_an_integer_leaf_is_named_with_the_fix():
    params, loss_fn = _counter_problem()
    tx = optax.sgd(0.1)
    step = fg.make_train_step(loss_fn, tx)
    with pytest.raises(TypeError, match=r"params\['count'\] has dtype int32.*freeze='count'"):
        step(step.init(params), {})


@pytest.mark.parametrize("kwargs", [{}, {"chain": fg.clip_by_global_norm(1.0)},
                                    {"chain": fg.grad_monitor()}, {"chain": fg.zero_nonfinite()},
                                    {"through": "train_only"}, {"bfloat16": True}],
                         ids=["plain", "clip", "monitor", "zero", "train_only", "bfloat16"])
def test_a_frozen_integer_leaf_trains(kwargs):
    # SGD(0.1) on sum(w**2): w <- w - 0.1 * 2w = 0.8 w, i.e. (0.8, -1.6); the gradient norm
    # is ||2w|| = sqrt(4 + 16); clipped to 1 the update is 0.1 * 2w / sqrt(20).
    params, loss_fn = _counter_problem()
    mask = fg.trainable_mask(params, freeze=["count", "index"])
    kwargs = dict(kwargs)
    tx = optax.sgd(0.1)
    if (piece := kwargs.pop("chain", None)) is not None:
        tx = optax.chain(piece, tx)
    if kwargs.pop("through", None) == "train_only":
        tx, trainable = fg.train_only(tx, mask), None
    else:
        trainable = mask
    if kwargs.pop("bfloat16", False):
        loss_fn = fg.mixed_precision(loss_fn, jnp.bfloat16)
    step = fg.make_train_step(loss_fn, tx, trainable=trainable, **kwargs)
    new, metrics = step(step.init(params), {})
    norm = math.sqrt(20.0)
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-2)
    scale = 1.0 / norm if "clip_coef" in metrics else 1.0
    np.testing.assert_allclose(new.params["w"], np.array([1.0, -2.0]) * (1 - 0.2 * scale),
                               rtol=1e-2 if step.compute_dtype is not None else 1e-6)
    assert new.params["count"].dtype == jnp.int32 and int(new.params["count"]) == 7
    np.testing.assert_array_equal(new.params["index"], [1, 0])
