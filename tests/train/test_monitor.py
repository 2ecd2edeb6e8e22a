"""The gradient monitor: statistics against NumPy, dead ReLUs by construction, alerts on
hand-scripted norm sequences. Every expected value is derived in the comment next to it."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
import funcgrad.train._monitor_sums as monitor_sums
import funcgrad.train.alerts as alerts_module
import funcgrad.train.monitor as monitor_module
from funcgrad.train.alerts import Alert, monitor_alerts
from funcgrad.train.monitor import (
    DeadReLU,
    GradMonitor,
    MonitorMetrics,
    MonitorState,
    with_dead_relu,
)


def _mlp_loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _digits_batch(n=32):
    data = fg.load_digits(seed=0)
    return {"x": jnp.asarray(data.x_train[:n]), "y": jnp.asarray(data.y_train[:n])}


def _run(monitor, grads_seq, *, losses=None, trainable=None):
    """Feeds a scripted sequence of gradient pytrees through the jitted update; returns the
    metrics of every step (on host) and the final state."""
    state = monitor.init(grads_seq[0], trainable=trainable)
    update = jax.jit(lambda s, g, loss: monitor.measure(s, g, loss=loss))
    out = []
    for i, grads in enumerate(grads_seq):
        loss = jnp.float32(1.0 if losses is None else losses[i])
        state, metrics = update(state, grads, loss)
        out.append(jax.device_get(metrics))
    return out, state


def _alerts(metrics_seq):
    return [(a.step, a.kind, a.where) for m in metrics_seq for a in monitor_alerts(m)]


# --- statistics -----------------------------------------------------------------------------

@pytest.mark.parametrize("matrix_limit", [None, 0, 2048], ids=["one_matrix", "per_leaf", "mixed"])
def test_leaf_and_layer_statistics_equal_numpy_on_the_gradients(matrix_limit, monkeypatch):
    # Second method: NumPy in float64 on the gradients jax.grad returns. float32 sums of up to
    # 8192 terms carry relative error ~ n*eps ~ 1e-3 in the worst case and ~sqrt(n)*eps ~ 1e-5
    # in practice (pairwise/blocked summation); the one-pass std adds eps*E[g^2]/(2 var),
    # negligible here because every leaf's mean is small against its std. Hence rtol 1e-5.
    # The limit of the padded matrix decides which leaves are reduced together: all four
    # (default), none (0), or the three smallest (2048 elements: 10 + 128 + 1280) while the
    # 8192-element first-layer weights are reduced alone.
    if matrix_limit is not None:
        monkeypatch.setattr(monitor_sums, "_MATRIX_LIMIT", matrix_limit)
    params = fg.mlp_init(jax.random.key(0), (64, 128, 10))
    batch = _digits_batch()
    grads = jax.grad(_mlp_loss)(params, batch)
    monitor = GradMonitor()
    _, m = jax.jit(monitor.measure)(monitor.init(params), grads)
    m = jax.device_get(m)
    leaves = [np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)]
    assert m.leaf_names == ("params[0]['b']", "params[0]['w']", "params[1]['b']",
                            "params[1]['w']")
    assert m.layer_names == ("params[0]", "params[1]")
    np.testing.assert_allclose(m.leaf_norm, [np.linalg.norm(g) for g in leaves], rtol=1e-5)
    # The last layer's bias gradient sums to zero in exact arithmetic (softmax cross-entropy:
    # sum_c (p_c - y_c) = 0 for every example), so its float32 mean is pure rounding: a sum
    # of n float32 terms is off by up to about n * eps * max|g|, its mean by eps * max|g|.
    # Hence an absolute tolerance of a few eps * max|g| per leaf beside the relative one.
    for got, g in zip(m.leaf_mean, leaves):
        np.testing.assert_allclose(got, g.mean(), rtol=1e-5,
                                   atol=4 * np.finfo(np.float32).eps * np.abs(g).max())
    np.testing.assert_allclose(m.leaf_std, [g.std() for g in leaves], rtol=1e-5)
    # A layer's norm: root-sum-of-squares of its two leaves; the global norm: of all four.
    layer_norms = [np.sqrt(np.sum(leaves[0] ** 2) + np.sum(leaves[1] ** 2)),
                   np.sqrt(np.sum(leaves[2] ** 2) + np.sum(leaves[3] ** 2))]
    np.testing.assert_allclose(m.layer_norm, layer_norms, rtol=1e-5)
    np.testing.assert_allclose(m.grad_norm, np.sqrt(sum(np.sum(g ** 2) for g in leaves)),
                               rtol=1e-5)
    # ... and the same global norm as the train step's own (clipping.global_norm).
    np.testing.assert_allclose(m.grad_norm, fg.global_norm(grads), rtol=1e-6)


def test_statistics_of_a_hand_sized_tree(strict_dtypes):
    # w = [3, 4]: norm 5, mean 3.5, std |3 - 3.5| = 0.5. b = [-1, 1, -1, 1]: norm 2, mean 0,
    # std 1. Sizes not multiples of the 512-element rows test the zero padding. Exact in
    # float32: every sum is of small integers.
    grads = {"b": jnp.array([-1.0, 1.0, -1.0, 1.0]), "w": jnp.array([3.0, 4.0])}
    monitor = GradMonitor()
    _, m = jax.jit(monitor.measure)(monitor.init(grads), grads)
    assert m.leaf_names == ("params['b']", "params['w']") and m.layer_names == ("params",)
    assert m.leaf_norm.tolist() == [2.0, 5.0]
    assert m.leaf_mean.tolist() == [0.0, 3.5]
    assert m.leaf_std.tolist() == [1.0, 0.5]
    # One layer (the dict holding both leaves): sqrt(4 + 25) = sqrt(29).
    assert float(m.layer_norm[0]) == pytest.approx(29 ** 0.5, rel=1e-7)
    assert float(m.grad_norm) == pytest.approx(29 ** 0.5, rel=1e-7)


@pytest.mark.float16
def test_half_precision_is_summed_in_float32():
    # 70000 elements of 1.0 in float16: the sum of squares, 70000, is above float16's largest
    # finite value 65504, so a float16 sum would be inf; in float32 it is exact.
    grads = {"w": jnp.ones((70000,), jnp.float16)}
    monitor = GradMonitor()
    _, m = jax.jit(monitor.measure)(monitor.init(grads), grads)
    assert m.values.dtype == jnp.float32
    assert float(m.grad_norm) == pytest.approx(70000 ** 0.5, rel=1e-6)
    assert not bool(m.nonfinite)


# --- dead ReLUs ------------------------------------------------------------------------------

def _relu_net(params, x):
    h = jax.nn.relu(x @ params["w0"] + params["b0"][None])         # site 0: jax.nn.relu
    h = jnp.maximum(h @ params["w1"] + params["b1"][None], 0.0)    # site 1: max(x, 0)
    return jnp.sum(h ** 2)


def test_dead_fraction_of_a_hand_built_layer():
    # Inputs in [0, 1) and weights in [-1, 1): a pre-activation x.w + b lies within
    # b +- 4 (4 inputs). Layer 0: 16 units, bias -1000 on units 0..5 (pre-activation < -996
    # for every example: dead), +1000 on the rest (> 996: alive). Dead fraction 6/16 = 0.375.
    # Layer 1: 8 units fed by h0 in [0, 1004]. w1 = 0 and bias 0 on units 0..1 (pre-activation
    # exactly 0 everywhere: dead, relu'(0) = 0), bias -1 on units 2..4 (dead), +1 on units
    # 5..7 (alive): 5/8 = 0.625.
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.uniform(kx, (8, 4))
    params = {"w0": jax.random.uniform(kw, (4, 16), minval=-1, maxval=1),
              "b0": jnp.where(jnp.arange(16) < 6, -1000.0, 1000.0),
              "w1": jnp.zeros((16, 8)),
              "b1": jnp.array([0.0, 0.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0])}
    loss, dead = jax.jit(with_dead_relu(_relu_net))(params, x)
    assert len(dead.names) == 2
    assert dead.names[0].startswith("relu 0 at test_monitor.py:")
    assert dead.names[1].startswith("relu 1 at test_monitor.py:")
    assert dead.dead[0].tolist() == [True] * 6 + [False] * 10
    assert dead.dead[1].tolist() == [True] * 5 + [False] * 3
    assert dead.fraction.tolist() == [0.375, 0.625]
    # Through the monitor: the fractions land in the metrics under the same names.
    monitor = GradMonitor()
    _, m = jax.jit(monitor.measure)(monitor.init(params), jax.grad(_relu_net)(params, x),
                                   dead_relu=dead)
    assert m.relu_names == dead.names and m.dead_fraction.tolist() == [0.375, 0.625]


def test_a_unit_positive_for_one_example_is_alive():
    # Pre-activations (3 examples x 2 units): unit 0 is positive only for example 1 (alive);
    # unit 1 is <= 0 for all (dead). Fraction 1/2.
    z = jnp.array([[-1.0, -2.0], [0.5, 0.0], [-3.0, -0.1]])
    _, dead = with_dead_relu(lambda z: jax.nn.relu(z).sum())(z)
    assert dead.dead[0].tolist() == [False, True] and dead.fraction.tolist() == [0.5]


def test_with_dead_relu_keeps_values_gradients_and_custom_rules():
    # Same primitives in the same order: the loss and its gradients are bit-identical to the
    # plain function's. jax.nn.relu is a custom_jvp with relu'(0) = 0 (max(x, 0) alone would
    # give 0.5 at 0); keeping the rule shows in d/dx sum(relu(x)) at x = 0, which must be 0.
    params = fg.mlp_init(jax.random.key(1), (64, 32, 32, 10))
    batch = _digits_batch()
    (loss, dead), grads = jax.jit(jax.value_and_grad(with_dead_relu(_mlp_loss), has_aux=True))(
        params, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_mlp_loss))(params, batch)
    assert float(loss) == float(ref_loss)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_array_equal(g, r)
    assert [n.split(" at ")[1] for n in dead.names] == [dead.names[0].split(" at ")[1]] * 2
    assert dead.names[0].startswith("relu 0 at mlp.py:")            # ordered, with the line
    g0 = jax.grad(lambda x: with_dead_relu(lambda x: jax.nn.relu(x).sum())(x)[0])(
        jnp.zeros(3))
    assert g0.tolist() == [0.0, 0.0, 0.0]


def test_relus_inside_jit_and_checkpoint_are_found_and_a_function_without_is_fine():
    inner = jax.jit(lambda z: jax.nn.relu(z))
    remat = jax.checkpoint(lambda z: jnp.maximum(z, 0.0) * 2)

    def fn(z):
        return inner(z).sum() + remat(z - 1).sum()

    z = jnp.array([[1.0, -1.0, 3.0]])
    # inner: z > 0 for units 0 and 2: 1/3 dead. remat: z - 1 = [0, -2, 2]: units 0, 1 dead.
    _, dead = jax.jit(with_dead_relu(fn))(z)
    assert dead.fraction.tolist() == pytest.approx([1 / 3, 2 / 3], rel=1e-7)
    value, none = with_dead_relu(lambda z: jnp.tanh(z).sum())(z)
    assert none.names == () and none.dead == () and none.fraction.shape == (0,)
    assert float(value) == pytest.approx(float(jnp.tanh(z).sum()))


# --- alerts on scripted sequences ------------------------------------------------------------

def _norms(values):
    """One single-leaf gradient per step whose global norm is |value| (sqrt(v*v) is exact for
    these small integers in float32)."""
    return [{"w": jnp.array([v], jnp.float32)} for v in values]


def test_explosion_fires_above_k_times_baseline():
    # warmup 2, k = 10. Step 0 has no baseline (nan). Step 1 is compared with the mean so far,
    # 1: 3 < 10, no alert, and it joins the baseline, now ready: (1 + 3) / 2 = 2, threshold
    # 10 * 2 = 20. Step 2: 30 > 20 alert; step 3: 19 no; step 4: 21 alert; step 5: 20 is not
    # above 20, no alert.
    monitor = GradMonitor(warmup=2, explode_factor=10.0)
    metrics, state = _run(monitor, _norms([1, 3, 30, 19, 21, 20]))
    assert _alerts(metrics) == [(2, "explosion", "global"), (4, "explosion", "global")]
    assert [float(m.baseline) for m in metrics[1:]] == [1.0] + [2.0] * 4
    assert np.isnan(float(metrics[0].baseline))
    alert = monitor_alerts(metrics[2])[0]
    assert (alert.value, alert.threshold) == (30.0, 20.0)
    assert str(alert) == ("step 2: explosion at global: value 30, threshold 20 "
                          "(grad_norm > 10 x baseline 2)")
    # The baseline froze after warmup: its sum and count are those of steps 0-1.
    assert (float(state.baseline_total), int(state.baseline_steps), int(state.step)) == (4.0, 2, 6)


def test_an_explosion_from_the_second_step_is_reported_and_kept_out_of_the_baseline():
    # A far too large learning rate: the norm jumps at step 1 and stays up. warmup 3, k = 10.
    # Step 0: 2, baseline nan, joins it. Steps 1, 2 (50, 60) exceed 10 x 2 = 20: alerts, and
    # they stay out of the baseline. Step 3: 3 < 20, joins: (2 + 3) / 2 = 2.5. Step 4: 2 <
    # 25, joins: the baseline is ready with 3 norms, total 2 + 3 + 2 = 7.
    monitor = GradMonitor(warmup=3, explode_factor=10.0)
    metrics, state = _run(monitor, _norms([2, 50, 60, 3, 2]))
    assert _alerts(metrics) == [(1, "explosion", "global"), (2, "explosion", "global")]
    assert [float(m.baseline) for m in metrics[1:]] == [2.0, 2.0, 2.0, 2.5]
    assert (float(state.baseline_total), int(state.baseline_steps)) == (7.0, 3)


def test_a_nonfinite_step_raises_an_alert_and_stays_out_of_the_baseline():
    # Step 0 is nan: nonfinite alert, and it does not count toward the baseline, so the
    # baseline is the mean of steps 1-2 = (1 + 3) / 2 = 2; step 3 (30 > 20) explodes.
    # Step 4 has a finite gradient but an inf loss: nonfinite too.
    monitor = GradMonitor(warmup=2, explode_factor=10.0)
    metrics, _ = _run(monitor, _norms([np.nan, 1, 3, 30, 2]),
                      losses=[1.0, 1.0, 1.0, 1.0, np.inf])
    assert _alerts(metrics) == [(0, "nonfinite", "global"), (3, "explosion", "global"),
                                (4, "nonfinite", "global")]
    assert float(metrics[3].baseline) == 2.0
    text = str(monitor_alerts(metrics[0])[0])
    assert text.startswith("step 0: nonfinite at global: value nan") and "loss 1" in text
    # An inf inside one leaf of a larger tree: the global norm is inf, the alert fires.
    bad = {"a": jnp.array([1.0, jnp.inf]), "b": jnp.ones(3)}
    m, _ = _run(GradMonitor(), [bad])
    assert _alerts(m) == [(0, "nonfinite", "global")] and np.isinf(float(m[0].grad_norm))


def test_vanishing_fires_once_per_streak_and_a_streak_survives_short_gaps():
    # floor 1e-3, 3 steps, ratio 0.01. Layer params[1] stays at 1, so the global norm is
    # ~1 and a params[0] norm of 1e-4 is below both the floor and 0.01 x 1 ("small").
    # params[0]:  1e-4 1e-4  1   1e-4 1e-4 1e-4 1e-4 1e-3  1  1e-4  1    1    1   1e-4 1e-4 1e-4
    # small:        y    y   n    y    y    y    y    n   n   y    n    n    n   y    y    y
    # clear:        0    0   1    0    0    0    0    1   2   0    1    2    3   0    0    0
    # streak:       1    2   0    1    2    3!   4    5   6   7    8    9    0   1    2    3!
    # Before it reaches 3 a clear step resets the streak (step 2); once reached (step 5, the
    # alert) it goes on through the gaps of 1 and 2 clear steps and ends at the 3rd clear step
    # in a row (step 12); a new streak of 3 raises the second alert (step 15). 1e-3 is not
    # below 1e-3 (step 7). Under the old rule the gap at steps 7-8 restarted the count: a
    # second alert at step 11 would not be one per streak.
    first = [1e-4, 1e-4, 1, 1e-4, 1e-4, 1e-4, 1e-4, 1e-3, 1, 1e-4, 1, 1, 1, 1e-4, 1e-4, 1e-4]
    seq = [[{"w": jnp.array([a], jnp.float32)}, {"w": jnp.array([1.0])}] for a in first]
    monitor = GradMonitor(vanish_floor=1e-3, vanish_steps=3)
    metrics, state = _run(monitor, seq)
    assert [int(m.below_floor[0]) for m in metrics] == [1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0,
                                                         1, 2, 3]
    assert [int(m.clear_steps[0]) for m in metrics] == [0, 0, 1, 0, 0, 0, 0, 1, 2, 0, 1, 2, 3,
                                                        0, 0, 0]
    assert _alerts(metrics) == [(5, "vanishing", "params[0]"), (15, "vanishing", "params[0]")]
    alert = monitor_alerts(metrics[5])[0]
    assert alert.threshold == pytest.approx(1e-3) and alert.value == pytest.approx(1e-4)
    assert str(alert).startswith("step 5: vanishing at params[0]: value 0.0001, threshold 0.001")
    assert "< 0.01 x the global norm for 3 steps" in str(alert)
    assert state.below_floor.tolist() == [3, 0] and state.clear_steps.tolist() == [0, 16]


def test_a_layer_small_only_because_every_layer_is_small_is_not_vanishing():
    # Both layers at 1e-4 (floor 1e-3): the global norm is sqrt(2) * 1e-4, and each layer is
    # 1/sqrt(2) ~ 0.71 of it, not below 0.01 x it: a converged model, all gradients small
    # together, raises nothing. With params[1] at 0.1 instead, params[0] is 1e-4 / ~0.1 =
    # ~1e-3 of the global norm: attenuated, vanishing from step 2 (3 steps).
    both = [[{"w": jnp.array([1e-4])}, {"w": jnp.array([1e-4])}]] * 4
    assert _alerts(_run(GradMonitor(vanish_floor=1e-3, vanish_steps=3), both)[0]) == []
    attenuated = [[{"w": jnp.array([1e-4])}, {"w": jnp.array([0.1])}]] * 4
    assert _alerts(_run(GradMonitor(vanish_floor=1e-3, vanish_steps=3), attenuated)[0]) == [
        (2, "vanishing", "params[0]")]
    # vanish_ratio=1 leaves the absolute floor: both layers at 1e-4 are each below their
    # global norm 1.41e-4, so both streaks reach 3 on step 2.
    ratio_one = GradMonitor(vanish_floor=1e-3, vanish_steps=3, vanish_ratio=1.0)
    assert _alerts(_run(ratio_one, both)[0]) == [(2, "vanishing", "params[0]"),
                                                  (2, "vanishing", "params[1]")]


def test_a_frozen_layer_is_not_reported_as_vanishing():
    # Layer 0 frozen (trainable False): its gradient is exactly 0 by design; never an alert,
    # its streak reads -1. Layer 1 trainable with gradient 0 for 2 steps while layer 2 trains
    # (norm 1): alert on step 1.
    seq = [[{"w": jnp.zeros(2)}, {"w": jnp.zeros(2)}, {"w": jnp.ones(1)}]] * 3
    monitor = GradMonitor(vanish_floor=1e-6, vanish_steps=2)
    metrics, _ = _run(monitor, seq, trainable=[False, True, True])
    assert _alerts(metrics) == [(1, "vanishing", "params[1]")]
    assert [m.below_floor.tolist() for m in metrics] == [[-1, 1, 0], [-1, 2, 0], [-1, 3, 0]]


def test_dead_relu_alert_fires_when_a_site_crosses_the_threshold():
    layout = monitor_module.MonitorLayout((), ("params",), ("relu 0 at net.py:3 (f)",), 10, 10.0,
                                          1e-6, 10, 0.5)

    def metrics(step, fraction):
        # values: the update count (step + 1, as int32 bits), grad_norm**2, loss,
        # baseline_steps, baseline, baseline_total, (no leaves), layer_norm, below_floor; then
        # the dead units of the one site (4 units, 4 * fraction of them dead).
        values = np.array([0.0, 1.0, 1.0, 0.0, np.nan, 0.0, 1.0, 0.0], np.float32)
        values[:1] = np.array([step + 1], np.int32).view(np.float32)
        return MonitorMetrics(values, (np.arange(4) < 4 * fraction,), layout)

    # Threshold 0.5: 0.25 -> no; 0.5 reaches it -> alert; 0.75 stays above: with `previous`
    # no new alert, without it the level is reported again.
    seq = [metrics(0, 0.25), metrics(1, 0.5), metrics(2, 0.75)]
    with_previous = [a for prev, m in zip([None, *seq], seq)
                     for a in monitor_alerts(m, previous=prev)]
    assert [(a.step, a.kind, a.value) for a in with_previous] == [(1, "dead_relu", 0.5)]
    assert len(monitor_alerts(seq[2])) == 1
    assert str(with_previous[0]) == ("step 1: dead_relu at relu 0 at net.py:3 (f): value 0.5, "
                                     "threshold 0.5 (50% of units dead for the whole batch)")


# --- the monitor inside a jitted train step ----------------------------------------------------

def test_the_monitor_runs_inside_a_jitted_step_and_under_scan():
    # A plain jitted SGD step with the monitor: the metrics come back with their names, the
    # state advances, and the same run under lax.scan (the whole loop compiled) agrees.
    params = fg.mlp_init(jax.random.key(0), (64, 16, 10))
    batch = _digits_batch()
    monitor = GradMonitor(warmup=2)

    def step(carry, _):
        params, mstate = carry
        (loss, dead), grads = jax.value_and_grad(with_dead_relu(_mlp_loss), has_aux=True)(
            params, batch)
        mstate, m = monitor.measure(mstate, grads, loss=loss, dead_relu=dead)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return (params, mstate), m

    carry = (params, monitor.init(params))
    jitted = jax.jit(step)
    looped = []
    for _ in range(4):
        carry, m = jitted(carry, None)
        looped.append(m)
    (_, mstate), stacked = jax.lax.scan(step, (params, monitor.init(params)), length=4)
    assert int(mstate.step) == 4 and int(carry[1].step) == 4
    np.testing.assert_allclose(stacked.grad_norm, [float(m.grad_norm) for m in looped],
                               rtol=1e-6)
    d = looped[3].to_dict()
    assert d["step"] == 3 and d["baseline"] == pytest.approx(
        (float(looped[0].grad_norm) + float(looped[1].grad_norm)) / 2, rel=1e-6)
    assert list(d["layer_norm"]) == ["params[0]", "params[1]"]
    assert list(d["dead_fraction"])[0].startswith("relu 0 at mlp.py:")


def test_the_update_count_is_exact_beyond_float32_integers():
    # The count rides in the packed float vector as the bits of an int32: 2**24 + 1 is not a
    # float32 number, yet it must come back and advance exactly.
    monitor = GradMonitor()
    grads = {"w": jnp.array([3.0, 4.0])}
    state = monitor.init(grads)
    values = np.array(state.values)
    values[:1] = np.array([2**24 + 1], np.int32).view(np.float32)
    state, m = jax.jit(monitor.measure)(MonitorState(jnp.asarray(values), state.layers), grads)
    assert int(m.step) == 2**24 + 1 and int(state.step) == 2**24 + 2
    assert float(m.grad_norm) == 5.0


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"warmup": 0}, "warmup"), ({"explode_factor": 1.0}, "explode_factor"),
    ({"vanish_floor": -1.0}, "vanish_floor"), ({"vanish_steps": 2.5}, "vanish_steps"),
    ({"vanish_ratio": 0.0}, "vanish_ratio"), ({"vanish_ratio": 1.5}, "vanish_ratio"),
    ({"dead_threshold": 0.0}, "dead_threshold")], ids=lambda v: str(v))
def test_settings_out_of_range_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradMonitor(**kwargs)


def test_state_for_other_params_and_integer_gradients_are_refused():
    monitor = GradMonitor()
    state = monitor.init([{"w": jnp.ones(2)}])
    with pytest.raises(ValueError, match="made for 1 layers, but the gradients have 2"):
        monitor.measure(state, [{"w": jnp.ones(2)}, {"w": jnp.ones(2)}])
    with pytest.raises(TypeError, match=r"params\[0\]\['w'\] has dtype int32"):
        monitor.measure(state, [{"w": jnp.ones(2, jnp.int32)}])
    with pytest.raises(TypeError, match="callable"):
        with_dead_relu(3)


def test_types_are_pytrees_and_public():
    tx = fg.grad_monitor(warmup=3)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert tx.monitor == GradMonitor(warmup=3)
    assert isinstance(tx.init({"w": jnp.ones(1)}), MonitorState)
    leaves, tree = jax.tree.flatten(DeadReLU((jnp.ones(2, bool),), ("relu 0 at ?",)))
    assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves).names == ("relu 0 at ?",)
    assert Alert(1, "explosion", "global", 2.0, 1.0, "x").kind in alerts_module.ALERT_KINDS


# --- fg.grad_monitor() in the optimizer's chain, and fit ---------------------------------

def test_make_train_step_returns_the_monitor_metrics_and_the_same_global_norm():
    # The step's "grad_norm" now comes from the monitor's sums: it must still equal the global
    # norm of jax.grad's gradients (second method: funcgrad.global_norm, a separate reduction;
    # float32, different summation order: rtol 1e-6).
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    batch = _digits_batch()
    tx = fg.make_optimizer("adam", 1e-3)
    monitor = fg.grad_monitor(warmup=3)
    step = fg.make_train_step(_mlp_loss, optax.chain(monitor, tx))
    state = step.init(params)
    new_state, metrics = step(state, batch)
    expected = fg.global_norm(jax.grad(_mlp_loss)(params, batch))
    assert float(metrics["grad_norm"]) == pytest.approx(float(expected), rel=1e-6)
    m = metrics["monitor"]
    assert float(m.grad_norm) == float(metrics["grad_norm"]) and int(m.step) == 0
    # The jitted step returns the packed values once, in the state (see MonitorState).
    assert m.values is fg.recorded(new_state.opt_state)["monitor_state"].values
    assert m.relu_names[0].startswith("relu 0 at mlp.py:") and m.dead_fraction.shape == (1,)
    assert int(fg.recorded(new_state.opt_state)["monitor_state"].step) == 1
    with pytest.raises(ValueError, match="not made by this optimizer"):
        step(fg.make_train_step(_mlp_loss, tx).init(params), batch)


def test_fit_logs_the_alerts_of_a_net_whose_relus_are_all_dead():
    # Hidden biases -1000: every unit's pre-activation is below 0 for every example (inputs are
    # standardised, |x.w| is far below 1000), so the dead fraction is 1 from step 0 (one
    # dead_relu alert, on that crossing) and layer 0's gradient is exactly 0: the vanishing
    # alert fires when the streak reaches vanish_steps = 3, i.e. on step 2.
    params = fg.mlp_init(jax.random.key(0), (64, 16, 10))
    params[0]["b"] = jnp.full((16,), -1000.0)
    data = fg.load_digits(seed=0)
    tx = fg.make_optimizer("sgd", 0.1)
    monitor = fg.grad_monitor(vanish_steps=3)
    lines = []
    step = fg.make_train_step(_mlp_loss, optax.chain(monitor, tx))
    result = fg.fit(step, step.init(params),
                    fg.Batches(data.x_train[:128], data.y_train[:128], batch_size=32), epochs=1,
                    progress=lines.append)
    alerts = [(a.step, a.kind, a.where) for a in result.history.alerts]
    assert [(s, k) for s, k, _ in alerts] == [(0, "dead_relu"), (2, "vanishing")]
    assert alerts[0][2].startswith("relu 0 at mlp.py:") and alerts[1][2] == "params[0]"
    assert [line for line in lines if line.startswith("monitor: ")] == [
        f"monitor: {a}" for a in result.history.alerts]
    h = result.history
    assert h.layer_names == ("params[0]", "params[1]") and len(h.step_layer_norm) == 4
    assert [row[0] for row in h.step_layer_norm] == [0.0] * 4
    d = h.to_dict()
    assert d["steps"]["layer_norm"]["params[0]"] == [0.0] * 4
    assert [a["kind"] for a in d["alerts"]] == ["dead_relu", "vanishing"]


def test_a_frozen_layer_is_not_vanishing_and_accumulation_reports_per_update():
    # Layer 0 frozen: its gradient is exactly 0 every step by design. The monitor is in the
    # step's chain, which trainable= wraps in fg.train_only: it sees the trained leaves only,
    # so layer 0 is not among its layers and raises no vanishing alert (as one of its layers,
    # vanish_steps 2 would fire on step 1).
    # With accumulate=2 each call is one update: fit sees one MonitorMetrics per call, 4 calls
    # for 256 examples in batches of 32; the monitor's step counts updates: 0, 1, 2, 3.
    params = fg.mlp_init(jax.random.key(0), (64, 16, 10))
    mask = fg.trainable_mask(params, freeze="0/*")
    data = fg.load_digits(seed=0)
    tx = fg.make_optimizer("sgd", 0.1)

    def per_example_loss(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            fg.mlp_apply(params, batch["x"]), batch["y"])

    step = fg.make_train_step(fg.accumulate(per_example_loss, 2),
                              optax.chain(fg.grad_monitor(vanish_steps=2), tx), trainable=mask)
    recorded = lambda state: fg.recorded(state.opt_state)["monitor_state"]
    assert recorded(step.init(params)).names[1] == ("params[1]",)
    result = fg.fit(step, step.init(params),
                    fg.Batches(data.x_train[:256], data.y_train[:256], batch_size=32),
                    epochs=1, progress=False)
    assert result.history.alerts == []
    assert result.history.layer_names == ("params[1]",)
    assert int(recorded(result.state).step) == 4
    # Dead ReLUs are not measured under accumulation, and the metrics say so.
    _, metrics = step(step.init(params), fg.stack_microbatches([_digits_batch(), _digits_batch()]))
    assert "funcgrad.accumulate" in metrics["monitor"].dead_relu_note


def test_params_without_leaves_get_a_clear_error():
    with pytest.raises(ValueError, match="params has no array leaves"):
        fg.grad_monitor().init({})


def _streak_alerts(layer_norms, floor, steps):
    """The old absolute rule in plain Python: (step, layer) where a run of `steps` norms below
    `floor` completes."""
    out, run = [], [0] * len(layer_norms[0])
    for i, row in enumerate(layer_norms):
        run = [r + 1 if n < floor else 0 for r, n in zip(run, row)]
        out += [(i, j) for j, r in enumerate(run) if r == steps]
    return out


def test_a_converged_model_raises_no_vanishing_alert():
    # 32 digits learnt to a loss far below 1e-4 by a 64-32-10 ReLU MLP (full batch, Adam 3e-2,
    # 300 steps). The gradient shrinks with the loss in every layer together. The floor is
    # raised to 1e-4 so that the run converges past it in 300 steps rather than ~10,000 (the
    # rule is the same at 1e-6): every layer ends below it for many steps, so the absolute rule
    # (recomputed below in plain Python) raised alerts; each layer's share of the global norm
    # stays ordinary (> 0.1), so none is vanishing.
    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    tx = fg.make_optimizer("adam", 3e-2)
    monitor = fg.grad_monitor(vanish_floor=1e-4, vanish_steps=10)
    step = fg.make_train_step(_mlp_loss, optax.chain(monitor, tx))
    result = fg.fit(step, step.init(params),
                    fg.Batches(data.x_train[:32], data.y_train[:32], batch_size=32), epochs=300,
                    progress=False)
    h = result.history
    assert h.step_loss[-1] < 1e-4 < 2.0 < h.step_loss[0]          # converged
    norms = np.asarray(h.step_layer_norm)
    assert np.all(norms[-10:] < 1e-4)                              # below the floor at the end
    assert len(_streak_alerts(norms, 1e-4, 10)) >= 2              # what the old rule raised
    assert np.min(norms / np.asarray(h.step_grad_norm)[:, None]) > 0.1
    assert [a for a in h.alerts if a.kind == "vanishing"] == []


def test_a_deep_sigmoid_net_still_raises_vanishing_alerts():
    # 12 sigmoid layers of 32 (examples/17_monitor.py): sigmoid' <= 1/4, so the cotangent
    # shrinks layer by layer; the first layers get < 1e-6, a ~1e-7 share of the global norm,
    # while the loss stays near log(10) = 2.30. Second method: jax.grad at the start.
    data = fg.load_digits(seed=0)
    rng = np.random.default_rng(1)
    sizes = (64,) + (32,) * 12 + (10,)
    params = [{"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
               "b": jnp.zeros(b)} for a, b in zip(sizes[:-1], sizes[1:])]

    def loss_fn(params, batch):
        logits = fg.mlp_apply(params, batch["x"], activation="sigmoid")
        return fg.softmax_cross_entropy(logits, batch["y"])

    batch = _digits_batch(256)
    grads = jax.grad(loss_fn)(params, batch)
    first, total = float(fg.global_norm(grads[0])), float(fg.global_norm(grads))
    assert first < 1e-6 and first < 0.01 * total
    tx = fg.make_optimizer("sgd", 0.1)
    monitor = fg.grad_monitor(vanish_steps=5)
    step = fg.make_train_step(loss_fn, optax.chain(monitor, tx))
    result = fg.fit(step, step.init(params),
                    fg.Batches(data.x_train[:256], data.y_train[:256], batch_size=256),
                    epochs=30, progress=False)
    vanishing = [(a.step, a.where) for a in result.history.alerts if a.kind == "vanishing"]
    assert (4, "params[0]") in vanishing                 # the 5th step completes the streak
    assert len(vanishing) == len(set(w for _, w in vanishing))   # one alert per layer's streak
    assert min(result.history.step_loss) > 2.0
