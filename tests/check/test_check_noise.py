"""The gradient checker's absolute floor follows the central difference's noise, not |f|; a jump
inside the step is not judged as curvature; full mode states each leaf's resolution (issue 12,
points 3 and 5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg

X = jnp.array([0.3, -1.2, 2.0, 0.9, -2.5, 1.4])  # |cos x| >= 0.13 at every element


def sin_with_rule(scale=None, add=None):
    """sin with a custom_vjp whose rule multiplies cos(x) by `scale` (a vector) and adds `add`
    (a vector): a planted bug; both None is the correct rule."""
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def bwd(x, g):
        d = jnp.cos(x)
        if scale is not None:
            d = d * scale
        if add is not None:
            d = d + add
        return (g * d,)

    f.defvjp(lambda x: (jnp.sin(x), x), bwd)
    return f


# --- point 5: the floor follows the noise of the difference, not |f| ----------------------

def test_a_constant_offset_does_not_hide_a_one_percent_bug():
    # f = sum(sin x) + 1e5. Round-off: ulp(1e5) = 1.46e-11, so D(1e-6) is off by at most
    # 1.46e-11 / 2e-6 = 7.3e-6 (the floor 4 u |f| / h = 4.4e-5 covers it). A 1% bug in element
    # 3 is 0.01 |cos 0.9| = 6.2e-3, 140x the floor. The old floor, atol * |f| = 1e-7 * 1e5 =
    # 1e-2, hid it.
    bug = jnp.ones(6).at[3].set(1.01)
    correct = fg.check_grads(lambda x: jnp.sum(sin_with_rule()(x)) + 1e5, X)
    assert correct.ok, str(correct)
    wrong = fg.check_grads(lambda x: jnp.sum(sin_with_rule(scale=bug)(x)) + 1e5, X)
    [row] = wrong.rows
    assert row.status == "fail" and row.worst_index == (3,), str(wrong)
    assert row.analytic - row.numeric == pytest.approx(0.01 * np.cos(0.9), rel=1e-2)
    # The resolution states it: at most 2 x 4.4e-5 + atol here, far below the bug.
    assert row.resolution < 1e-4 < 0.01 * np.cos(0.9)


def _cancelling(rule):
    # (a + sin x) - a with a = 5e5..9.75e5: f = sum(sin x) is O(1), but each term is rounded
    # at ulp(a) = 5.8e-11..1.2e-10, so D(1e-6) carries errors up to 1.2e-10 / 2e-6 = 5.8e-5
    # (measured 4.9e-5 at element 15), 500x the floor from |f| (4 u |f| / h = 1.4e-9 + atol).
    a = 5e5 * (1.0 + jnp.arange(20) / 20.0)
    return lambda x: jnp.sum((a + rule(x)) - a)


def test_heavy_cancellation_inside_fn_is_measured_not_failed():
    x = jax.random.uniform(jax.random.key(0), (20,), minval=-3, maxval=3)
    report = fg.check_grads(_cancelling(sin_with_rule()), x)
    [row] = report.rows
    assert report.ok and row.status == "ok", str(report)
    # Second method for what the check measured: the worst error it saw is the round-off
    # derived above (>= 1e-5), and the stated resolution covers it.
    assert 1e-5 < row.max_abs_error <= 5.8e-5 <= row.resolution
    # The measurement excuses round-off, not a bug above it: 2% of |cos| (>= 1e-3 at every x
    # here; 5.9e-3 at element 7) still fails, at the element it was planted in.
    bug = jnp.ones(20).at[7].set(1.02)
    wrong = fg.check_grads(_cancelling(sin_with_rule(scale=bug)), x)
    [bad] = wrong.rows
    assert bad.status == "fail" and bad.worst_index == (7,), str(wrong)


@pytest.mark.parametrize("offset", [0.0, 1e5])
def test_an_error_just_above_the_stated_resolution_is_reported(offset):
    # The contract of LeafCheck.resolution in full mode: an error e at element j is reported
    # when e > resolution + rtol |numeric_j|. Take the resolution from the correct function's
    # report and plant e = 1.05 x (resolution + rtol |cos x_j|) at each j in turn.
    fn = lambda rule: (lambda x: jnp.sum(rule(x)) + offset)
    correct = fg.check_grads(fn(sin_with_rule()), X)
    [row] = correct.rows
    assert row.ok and row.resolution is not None and row.resolution > correct.atol
    for j in range(X.shape[0]):
        e = 1.05 * (row.resolution + correct.rtol * abs(float(np.cos(X[j]))))
        wrong = fg.check_grads(fn(sin_with_rule(add=jnp.zeros(6).at[j].set(e))), X)
        assert wrong.rows[0].status == "fail" and wrong.rows[0].worst_index == (j,), str(wrong)


def test_the_report_prints_each_leafs_resolution():
    report = fg.check_grads(lambda x: jnp.sum(jnp.sin(x)), X)
    text = str(report)
    assert "resolution" in text.splitlines()[1]
    assert f"{report.rows[0].resolution:.2g}" in text.splitlines()[2]
    assert report.to_dict()["rows"][0]["resolution"] == report.rows[0].resolution


# --- point 3: a jump inside the step --------------------------------------------------------

def rem_with_rule(bug=0.0):
    """lax.rem(x, y) with JAX's own derivatives (d/dx = 1, d/dy = -trunc(x/y)), `bug` added to
    the y-derivative's quotient."""
    @jax.custom_jvp
    def rem(x, y):
        return jax.lax.rem(x, y)

    @rem.defjvp
    def _(primals, tangents):
        x, y = primals
        tx, ty = tangents
        return rem(x, y), tx - (jnp.trunc(x / y) + bug) * ty

    return rem


def _rem32(rule):
    # rem computed in float32, as in JAX's lax_autodiff_test (rand_default-like inputs).
    return lambda y: jnp.sum(rule(jnp.float32(3.0), y.astype(jnp.float32)))


# y0 = 0.3 + 3.8e-4: 3 / y0 = 9.988, so rem(3, y) = 3 - 9 y (d/dy = -9) on y > 0.3 and
# 3 - 10 y below: f jumps by 0.3 at y = 0.3, 3.8e-4 away. The float32 step 1e-3 crosses it
# (central difference (0.3 + ...)/2e-3 ~ 140); the re-probe step 1.25e-4 does not.
Y32 = jnp.array([0.3 + 3.8e-4, 0.7], jnp.float32)


def test_float32_rem_near_its_jump_is_judged_with_the_smaller_step():
    # Checked as computed, in float32 (lifted to float64, eps = 1e-6 would not reach the jump).
    as_computed = fg.CheckOptions(lift_precision=False)
    jax_rule = fg.check_grads(_rem32(jax.lax.rem), Y32, options=as_computed)
    assert jax_rule.ok and jax_rule.dtype_used == "float32", str(jax_rule)
    report = fg.check_grads(_rem32(rem_with_rule()), Y32, options=as_computed)
    [row] = report.rows
    assert row.ok and row.status == "ok", str(report)
    assert row.worst_index == (0,) and row.analytic == -9.0
    assert row.numeric == pytest.approx(-9.0, abs=1e-2)
    [note] = [n for n in row.notes if "discontinuity within the step" in n]
    assert "step 0.001" in note and "step 0.000125" in note


def test_a_wrong_rem_derivative_near_the_jump_still_fails():
    # -10 instead of -9 at y0 (and -5.29 instead of -4.29 at 0.7: 3/0.7 = 4.29, trunc 4).
    report = fg.check_grads(_rem32(rem_with_rule(bug=1.0)), Y32)
    [row] = report.rows
    assert row.status == "fail", str(report)
    assert row.analytic - row.numeric == pytest.approx(-1.0, abs=2e-2)


def sawtooth_with_rule(slope=1.0):
    """s(y) = y - floor(y), whose derivative is 1 off the integers; `slope` is the rule's."""
    @jax.custom_jvp
    def saw(y):
        return y - jnp.floor(y)

    saw.defjvp(lambda p, t: (saw(p[0]), slope * t[0]))
    return saw


def test_float64_sawtooth_near_its_jump_is_judged_with_the_smaller_step():
    # f(y) = s(7 y) at y0 = 1/7 + 4e-7: f' = 7, and f jumps by -1 at y = 1/7, 4e-7 below y0:
    # the step 1e-6 crosses it (central difference 1 / 2e-6 = 5e5), the step 1.25e-7 does not.
    with jax.enable_x64(True):
        y = jnp.asarray(np.array([1 / 7 + 4e-7, 0.3]))
        report = fg.check_grads(lambda y: jnp.sum(sawtooth_with_rule()(7.0 * y)), y)
        wrong = fg.check_grads(lambda y: jnp.sum(sawtooth_with_rule(1.1)(7.0 * y)), y)
    [row] = report.rows
    assert report.ok and row.status == "ok" and report.dtype_used == "float64", str(report)
    assert row.numeric == pytest.approx(7.0, rel=1e-6)
    assert any("discontinuity within the step" in n for n in row.notes)
    [bad] = wrong.rows
    assert bad.status == "fail" and bad.analytic - bad.numeric == pytest.approx(0.7, rel=1e-4)


def test_heavy_cancellation_passes_in_directional_mode_too():
    # Along a unit tangent all 20 terms move, so their roundings add: D(1e-6) is off by up to
    # 20 x 1.2e-10 / 2e-6 = 1.2e-3, typically sqrt(40) x 3.4e-11 / 2e-6 = 1.1e-4 (1.6e-4 seen),
    # 1000x the floor from |f|. The tangents that miss the floor are measured, not failed.
    x = jax.random.uniform(jax.random.key(0), (20,), minval=-3, maxval=3)
    report = fg.check_directional(_cancelling(sin_with_rule()), x)
    assert report.ok and report.rows[0].status == "ok", str(report)
    assert report.rows[0].max_abs_error > 1e-5  # the round-off was there to be measured
