"""The gradient transformations that record what they did (funcgrad.train.transforms):
fg.clip_by_global_norm, fg.zero_nonfinite and fg.grad_monitor used with plain optax
(``tx.init``, ``tx.update``), `fg.recorded`, and what a train step does with them."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg


def _update(tx, grads, params=None):
    """One ``tx.update`` from ``tx.init``, as a hand-written loop does: (updates, state)."""
    params = jax.tree.map(jnp.zeros_like, grads) if params is None else params
    return tx.update(grads, tx.init(params), params)


# --- fg.clip_by_global_norm ------------------------------------------------------------------

def test_clip_records_the_preclip_norm_and_the_coefficient_by_hand():
    # ||(3, 4)|| = 5 (3-4-5). max_norm 1: coefficient min(1, 1/5) = 0.2, the gradient becomes
    # (0.6, 0.8), of norm 1 and the same direction. Under the bound (max_norm 10) the
    # coefficient is 1 and the gradient passes unchanged.
    tx = fg.clip_by_global_norm(1.0)
    grads = {"a": jnp.array([3.0, 4.0])}
    before = tx.init(grads)
    assert isinstance(before, fg.ClipState)
    assert np.isnan(before.grad_norm) and np.isnan(before.clip_coef)  # no update yet
    clipped, state = _update(tx, grads)
    assert isinstance(state, fg.ClipState)
    assert float(state.grad_norm) == 5.0
    assert float(state.clip_coef) == pytest.approx(0.2, rel=1e-7)
    np.testing.assert_allclose(clipped["a"], [0.6, 0.8], rtol=1e-6)
    same, state = _update(fg.clip_by_global_norm(10.0), grads)
    assert (float(state.grad_norm), float(state.clip_coef)) == (5.0, 1.0)
    np.testing.assert_array_equal(same["a"], grads["a"])
    assert state.grad_norm.dtype == jnp.float32


@pytest.mark.parametrize("max_norm", [0.5, 2.0, 100.0], ids=["clipped", "clipped_less", "under"])
def test_clip_equals_optax_clip_by_global_norm(max_norm):
    # Second method: optax's own clipping of the same tree (a 2-layer tree of norm
    # sqrt(1 + 4 + 9 + 16 + 0.25) ~ 5.5). optax divides each element by the norm where funcgrad
    # multiplies by one coefficient: equal up to rounding (a float32 ulp or two).
    grads = {"w": jnp.array([[1.0, -2.0], [3.0, 4.0]]), "b": jnp.array([0.5])}
    ours, state = _update(fg.clip_by_global_norm(max_norm), grads)
    ref, _ = _update(optax.clip_by_global_norm(max_norm), grads)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    norm = float(optax.tree.norm(grads))
    assert float(state.grad_norm) == pytest.approx(norm, rel=1e-6)
    assert float(state.clip_coef) == pytest.approx(min(1.0, max_norm / norm), rel=1e-6)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_clip_refuses_a_max_norm_that_is_not_a_finite_positive_number(max_norm):
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        fg.clip_by_global_norm(max_norm)


# --- fg.zero_nonfinite -----------------------------------------------------------------------

def test_zero_nonfinite_counts_and_zeroes_the_nonfinite_leaves():
    # Leaves a (a NaN) and b (an inf) are replaced by zeros whole; c is finite and passes
    # unchanged: 2 leaves zeroed.
    grads = {"a": jnp.array([1.0, jnp.nan]), "b": jnp.array([jnp.inf, 2.0]),
             "c": jnp.array([3.0, 4.0])}
    tx = fg.zero_nonfinite()
    assert int(tx.init(grads).nonfinite_leaves) == 0
    kept, state = _update(tx, grads)
    assert isinstance(state, fg.ZeroNonfiniteState) and int(state.nonfinite_leaves) == 2
    assert state.nonfinite_leaves.dtype == jnp.int32
    np.testing.assert_array_equal(kept["a"], [0.0, 0.0])
    np.testing.assert_array_equal(kept["b"], [0.0, 0.0])
    np.testing.assert_array_equal(kept["c"], [3.0, 4.0])
    # A finite gradient: nothing zeroed, nothing counted.
    kept, state = _update(tx, {"c": jnp.array([3.0, 4.0])})
    assert int(state.nonfinite_leaves) == 0 and kept["c"].tolist() == [3.0, 4.0]


# --- fg.recorded -----------------------------------------------------------------------------

def test_recorded_finds_the_records_at_any_depth_of_a_chain():
    # Chains inside chains: the monitor sees the raw gradient (a NaN in b: its norm is NaN),
    # zero_nonfinite zeroes b (1 leaf), the clip sees a = (3, 4) alone: norm 5, coefficient
    # 1/5 = 0.2 at max_norm 1; SGD(1) then moves a by -(0.6, 0.8).
    tx = optax.chain(optax.chain(fg.grad_monitor(), fg.zero_nonfinite()),
                     optax.chain(fg.clip_by_global_norm(1.0), optax.sgd(1.0)))
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([jnp.nan, 1.0])}
    assert fg.recorded(optax.chain(optax.sgd(1.0)).init(grads)) == {}
    updates, state = _update(tx, grads)
    got = fg.recorded(state)
    assert set(got) == {"grad_norm", "clip_coef", "max_norm", "nonfinite_leaves",
                        "monitor_state"}
    assert float(got["max_norm"]) == 1.0
    assert float(got["grad_norm"]) == 5.0
    assert float(got["clip_coef"]) == pytest.approx(0.2, rel=1e-7)
    assert int(got["nonfinite_leaves"]) == 1
    monitor = got["monitor_state"]
    assert isinstance(monitor, fg.MonitorState) and int(monitor.step) == 1
    np.testing.assert_allclose(updates["a"], [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], [0.0, 0.0])
    # Two clips: the first one's record (in jax.tree.leaves order), norm 5 under max_norm 10.
    _, state = _update(optax.chain(fg.clip_by_global_norm(10.0), fg.clip_by_global_norm(1.0)),
                       {"a": jnp.array([3.0, 4.0])})
    assert (float(fg.recorded(state)["grad_norm"]), float(fg.recorded(state)["clip_coef"])) == (
        5.0, 1.0)


def test_recorded_inside_train_only_sees_the_trained_leaves():
    # b is frozen: fg.train_only's partition gives the chain a alone, so the clip's norm is
    # ||(3, 4)|| = 5 and not ||(3, 4, 100, 100)|| ~ 141; a's update is -(0.6, 0.8), b's zero.
    tx = fg.train_only(optax.chain(fg.clip_by_global_norm(1.0), optax.sgd(1.0)),
                       {"a": True, "b": False})
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([100.0, 100.0])}
    updates, state = _update(tx, grads)
    got = fg.recorded(state)
    assert float(got["grad_norm"]) == 5.0
    assert float(got["clip_coef"]) == pytest.approx(0.2, rel=1e-7)
    np.testing.assert_allclose(updates["a"], [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], [0.0, 0.0])


# --- in a train step -------------------------------------------------------------------------

def _sqrt_problem(params, batch):
    # L = sum(w^2) + sum(sqrt(v)). At v = (0, 4) the loss is finite (0 + 2) but dL/dv =
    # 1/(2 sqrt v) is inf at v[0] = 0; dL/dw = 2w.
    del batch
    return jnp.sum(params["w"] ** 2) + jnp.sum(jnp.sqrt(params["v"]))


_SQRT_PARAMS = {"w": jnp.array([1.0, -2.0]), "v": jnp.array([0.0, 4.0])}


def test_a_step_with_zero_nonfinite_applies_the_finite_leaves_and_skips_nothing():
    # Each step v's gradient holds an inf: zeroed (1 leaf), so v stays at (0, 4) and its
    # gradient stays inf. w's gradient 2w is applied with SGD(0.1): w <- 0.8 w, so after 3
    # steps w = 0.8**3 (1, -2) = (0.512, -1.024). Without fg.zero_nonfinite the same step
    # skips every update (second method: the plain step, params unchanged).
    step = fg.make_train_step(_sqrt_problem, optax.chain(fg.zero_nonfinite(), optax.sgd(0.1)))
    plain = fg.make_train_step(_sqrt_problem, optax.sgd(0.1))
    state, plain_state = step.init(_SQRT_PARAMS), plain.init(_SQRT_PARAMS)
    for _ in range(3):
        state, metrics = step(state, {})
        plain_state, plain_metrics = plain(plain_state, {})
        assert int(metrics["skipped"]) == 0 and int(metrics["nonfinite_leaves"]) == 1
        assert int(plain_metrics["skipped"]) == 1
        # No clip follows the zeroing: "grad_norm" is the raw gradient's, inf.
        assert math.isinf(float(metrics["grad_norm"]))
    np.testing.assert_allclose(state.params["w"], [0.512, -1.024], rtol=1e-6)
    np.testing.assert_array_equal(state.params["v"], _SQRT_PARAMS["v"])
    np.testing.assert_array_equal(plain_state.params["w"], _SQRT_PARAMS["w"])
    assert int(state.step) == 3


@pytest.mark.float16
def test_zero_nonfinite_with_a_dynamic_loss_scale_is_refused_at_make_train_step():
    # An overflowed scaled gradient must be skipped whole (and the scale lowered): zeroing
    # its leaves would apply the rest. Refused where the step is made, nested or not.
    scaled = fg.mixed_precision(_sqrt_problem, jnp.float16, loss_scale=fg.dynamic_loss_scale())
    for tx in (optax.chain(fg.zero_nonfinite(), optax.sgd(0.1)),
               optax.chain(optax.chain(fg.grad_monitor(), fg.zero_nonfinite()),
                           optax.sgd(0.1))):
        with pytest.raises(ValueError, match=r"funcgrad\.zero_nonfinite\(\) and the loss has "
                                             r"funcgrad\.mixed_precision's loss scale"):
            fg.make_train_step(scaled, tx)
    # Without the loss scale the pair is allowed (float16 compute, nothing to back off).
    fg.make_train_step(fg.mixed_precision(_sqrt_problem, jnp.float16),
                       optax.chain(fg.zero_nonfinite(), optax.sgd(0.1)))


def test_the_monitor_state_is_kept_and_counted_on_a_skipped_step():
    # Step 0: v's gradient is inf, the step is skipped (params and SGD's state unchanged),
    # but the monitor's record takes its new value: it counts the step (1) and raises the
    # non-finite flag, which is the alert. Step 1, from v = (1, 4) (a finite gradient), is
    # applied and counted: 2.
    step = fg.make_train_step(_sqrt_problem,
                              optax.chain(fg.grad_monitor(warmup=2), optax.sgd(0.1)))
    state0 = step.init(_SQRT_PARAMS)
    assert int(fg.recorded(state0.opt_state)["monitor_state"].step) == 0
    state1, metrics = step(state0, {})
    assert int(metrics["skipped"]) == 1
    np.testing.assert_array_equal(state1.params["w"], _SQRT_PARAMS["w"])
    assert int(fg.recorded(state1.opt_state)["monitor_state"].step) == 1
    m = metrics["monitor"]
    assert int(m.step) == 0 and bool(m.nonfinite) and math.isinf(float(m.grad_norm))
    assert [a.kind for a in fg.monitor_alerts(m)] == ["nonfinite"]
    finite = state1._replace(params={"w": _SQRT_PARAMS["w"], "v": jnp.array([1.0, 4.0])})
    state2, metrics = step(finite, {})
    assert int(metrics["skipped"]) == 0
    assert int(fg.recorded(state2.opt_state)["monitor_state"].step) == 2


def _relu_net(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w"] + params["b"][None, :])
    return jnp.mean((h @ params["v"]).astype(jnp.float32) ** 2)


def test_dead_relu_fractions_under_bfloat16_equal_the_float32_ones():
    # 4 hidden units, z_j = x . w_j + b_j over 3 examples with x0 in {1.1, 2.1, 3.1} and
    # x1 in {-2.1, 3.1, 4.1}:
    #   unit 0: w = 0, b = -10: z = -10, dead;       unit 1: w = 0, b = 10: z = 10, alive;
    #   unit 2: z = x0 - 6 in {-4.9, -3.9, -2.9}: dead (<= 0 for every example);
    #   unit 3: z = x1 in {-2.1, 3.1, 4.1}: alive (> 0 for two examples).
    # Dead fraction 2/4 = 0.5. Why bfloat16 cannot change it: a unit is dead when z <= 0 for
    # every example, so only the signs of z matter. bfloat16 keeps 8 significant bits, so a
    # number in [4, 8) is within half an ulp, 2**(2 - 7) / 2 = 0.016, of its bfloat16 value
    # (less below 4). x (|x| <= 4.1) rounds by at most 0.016; w (0 or 1) and b (integers) are
    # exact, so units 0 and 1 are exact and units 2 and 3 (|z| < 8, one product each) round
    # once more by at most 0.016: |error| < 0.04, while every |z| >= 2.1. No sign changes:
    # the same dead units as in float32.
    params = {"w": jnp.array([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]),
              "b": jnp.array([-10.0, 10.0, -6.0, 0.0]), "v": jnp.ones((4, 1))}
    batch = {"x": jnp.array([[1.1, -2.1], [2.1, 3.1], [3.1, 4.1]])}
    z = np.asarray(batch["x"] @ params["w"]) + np.asarray(params["b"])
    assert np.abs(z).min() >= 2.1 - 1e-6  # the margin the derivation uses
    fractions = {}
    for name, loss in (("float32", _relu_net),
                       ("bfloat16", fg.mixed_precision(_relu_net, jnp.bfloat16))):
        step = fg.make_train_step(loss, optax.chain(fg.grad_monitor(), optax.sgd(0.0)))
        _, metrics = step(step.init(params), batch)
        m = metrics["monitor"]
        assert m.dead_relu_note == ""  # measured, also under mixed precision
        fractions[name] = [float(f) for f in m.dead_fraction]
        assert [np.asarray(d).tolist() for d in m.dead] == [[True, False, True, False]]
    assert fractions["bfloat16"] == fractions["float32"] == [0.5]


def test_a_step_refuses_an_unknown_nonfinite_policy_also_through_dataclasses_replace():
    step = fg.make_train_step(_sqrt_problem, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('skip', 'raise'\), got "
                                         r"'bogus'"):
        dataclasses.replace(step, nonfinite="bogus")
    # "zero" is a piece of the optimizer now, and the message says which.
    with pytest.raises(ValueError, match=r"optax\.chain\(funcgrad\.zero_nonfinite\(\)"):
        dataclasses.replace(step, nonfinite="zero")
    with pytest.raises(ValueError, match=r"optax\.chain\(funcgrad\.zero_nonfinite\(\)"):
        fg.make_train_step(_sqrt_problem, optax.sgd(0.1), nonfinite="zero")
    assert dataclasses.replace(step, nonfinite="raise").nonfinite == "raise"
