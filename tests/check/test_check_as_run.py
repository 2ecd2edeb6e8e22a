"""check_grads checks fn as the user runs it (x64 off): a remat block with dropout (issue 33).

The check traces fn with float64 inputs; a dropout mask drawn under x64 differs from the user's,
so the check is rebuilt on fn's program as the user runs it and lifted to float64
(`funcgrad.check.grads._as_the_user_runs_it`).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg

_KEEP = 0.8


def _block(w, x, key):
    """A dense layer with dropout: sum((keep * tanh(x @ w) / 0.8)^2), keep ~ Bernoulli(0.8)."""
    h = jnp.tanh(x @ w)
    keep = jax.random.bernoulli(key, _KEEP, h.shape)
    return jnp.sum(jnp.where(keep, h / _KEEP, 0.0) ** 2)


def _block_point():
    w = np.asarray(jax.random.normal(jax.random.key(0), (4, 3)))
    x = np.asarray(jax.random.normal(jax.random.key(1), (5, 4)))
    return w, x, jax.random.key(2)


def _block_loss64(w, x, keep):
    """_block in float64 NumPy with the user's mask `keep` (bool, (5, 3))."""
    return float(np.sum(np.where(keep, np.tanh(x @ w) / _KEEP, 0.0) ** 2))


def _block_grad64(w, x, keep):
    # L = sum_ij keep_ij (t_ij / 0.8)^2 with t = tanh(x @ w), so
    # dL/dw = x^T [keep * 2 t / 0.8^2 * (1 - t^2)]  (tanh' = 1 - tanh^2).
    t = np.tanh(x @ w)
    return x.T @ np.where(keep, 2 * t / _KEEP ** 2 * (1 - t * t), 0.0)


def test_remat_block_with_dropout_is_checked_on_the_users_mask():
    # fg.remat's custom_vjp keeps a jax.vjp closure as a residual: traced at float64
    # cotangents it refused them (LiftError inside the as-run guard). The gradient wrt w must
    # pass, lifted to float64, on the mask the user's program draws (x64 off, 32 bits).
    w, x, key = _block_point()
    keep = np.asarray(jax.random.bernoulli(key, _KEEP, (5, 3)))  # the user's mask
    with jax.enable_x64(True):
        assert not np.array_equal(np.asarray(jax.random.bernoulli(key, _KEEP, (5, 3))), keep)
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    want = _block_grad64(w64, x64, keep)
    # The hand gradient against float64 central differences (h = 1e-6: truncation ~1e-12,
    # round-off ~1e-16·|L|/h ~1e-10 for |L| ~ 10): 1e-7 is far above both.
    for i in np.ndindex(w.shape):
        e = np.zeros_like(w64)
        e[i] = 1e-6
        numeric = (_block_loss64(w64 + e, x64, keep) - _block_loss64(w64 - e, x64, keep)) / 2e-6
        assert numeric == pytest.approx(want[i], abs=1e-7)
    # As the user runs it, remat changes nothing: the same gradient in float32, to float32's
    # rounding (u = 6e-8) of sums of 5 terms of size up to ~2, some of them cancelling
    # (w[2, 1]: -0.051 from terms of ~0.5): atol 1e-5 covers ~100 such roundings.
    users = np.asarray(jax.grad(fg.remat(_block))(jnp.asarray(w), jnp.asarray(x), key))
    np.testing.assert_allclose(users, want, rtol=1e-5, atol=1e-5)

    report = fg.check_grads(fg.remat(_block), jnp.asarray(w), jnp.asarray(x), key)
    assert report.ok and report.weaker is None
    assert report.lifted_from == "float32" and report.dtype_used == "float64"
    assert any("as you run it" in n and "lifted to float64" in n for n in report.notes)
    [row] = report.rows
    # Its analytic value is the user's program's (its float32 literal 0.8 is 1.5e-8 relative
    # from 0.8, squared: 3e-8), not another mask's: rel 1e-6.
    assert row.analytic == pytest.approx(want[row.worst_index], rel=1e-6)
    assert row.numeric == pytest.approx(want[row.worst_index], rel=1e-6, abs=1e-7)


def test_a_wrong_rule_inside_a_remat_block_with_dropout_fails():
    # The same block with tanh's backward 10% too large in every element: the check of w,
    # through remat's custom_vjp and lifted to float64, must fail (10% >> rtol 1e-6).
    @jax.custom_vjp
    def act(h):
        return jnp.tanh(h)
    act.defvjp(lambda h: (jnp.tanh(h), jnp.tanh(h)), lambda t, g: (1.1 * g * (1 - t * t),))

    def block(w, x, key):
        keep = jax.random.bernoulli(key, _KEEP, (5, 3))
        return jnp.sum(jnp.where(keep, act(x @ w) / _KEEP, 0.0) ** 2)

    w, x, key = _block_point()
    report = fg.check_grads(fg.remat(block), jnp.asarray(w), jnp.asarray(x), key)
    assert not report.ok and report.lifted_from == "float32"
    [bad] = report.failures
    assert bad.analytic == pytest.approx(1.1 * bad.numeric, rel=1e-6)

