"""check_grads checks fn as the user runs it (x64 off), once per function and signature.

The check traces fn with float64 inputs; a dropout mask drawn under x64 differs from the user's,
so the check is rebuilt on fn's program as the user runs it and lifted to float64
(`funcgrad.check._as_run`): a remat block with dropout (issue 33). Those programs are built
once per function object and argument signature, as jax.jit caches (issue 33 point 5): a
repeated check compiles nothing, and another function, shape, dtype or has_aux gets its own.
"""
import logging

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


# --- the as-run programs are built once per function and argument signature -------------

def _dropout_fn(key, counter):
    """f(v, x) = sum((keep * v * x)^2), keep ~ Bernoulli(0.5) from `key` (closed over);
    counter[0] counts fn's traces."""
    def f(v, x):
        counter[0] += 1
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.sum(jnp.where(keep, v * x, 0.0) ** 2)
    return f


def _plain_fn(counter):
    def f(v, x):
        counter[0] += 1
        return jnp.sum(jnp.sin(v) * x ** 2)
    return f


def _compiles(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]


@pytest.mark.parametrize("make", [_plain_fn, lambda c: _dropout_fn(jax.random.key(0), c)],
                         ids=["plain", "dropout_rebuilt_on_the_users_program"])
def test_a_repeated_check_compiles_nothing_and_traces_fn_only_to_set_up(make, caplog):
    # The second check of the same fn at arguments of the same shapes and dtypes traces fn
    # exactly twice, both abstractly in the check's set-up under x64 (grads._setup:
    # jax.eval_shape for the output's structure, jax.make_jaxpr for the floats it computes
    # in), and compiles nothing: fn's program as the user runs it, its checked and lifted
    # outputs, the guard's primal and the full-mode kernels are all reused (on the dropout
    # fn the check is rebuilt on the user's program, whose kernels are reused too).
    # Before, every call traced fn a third time and compiled the guard's three programs.
    counter = [0]
    fn = make(counter)
    v, x = jnp.linspace(0.5, 2.0, 10), jnp.linspace(-1.0, 1.0, 10)
    first = fg.check_grads(fn, v, x)
    assert first.ok
    counter[0] = 0
    caplog.clear()
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        again = fg.check_grads(fn, v, x)
    assert again.ok and again.rows[0].analytic == first.rows[0].analytic
    assert again.notes == first.notes
    assert counter[0] == 2
    assert _compiles(caplog) == []


def test_a_closure_over_another_key_is_not_served_a_stale_program():
    # Two closures of one code object over two keys are two functions. With v zero except at
    # an element j kept by the first mask and dropped by the second (both as the user draws
    # them, x64 off), the only non-zero gradient of the first is at j (2 v_j x_j^2) and the
    # second's gradient is zero everywhere: a check of the second served the first's program
    # would report the first's value at j.
    # (v is zero but at j, so the check's own float64 program may agree with the user's and
    # not be rebuilt: the user's value is compared with the as-run program either way.)
    key_a, key_b = jax.random.key(1), jax.random.key(2)
    m_a = np.asarray(jax.random.bernoulli(key_a, 0.5, (16,)))
    m_b = np.asarray(jax.random.bernoulli(key_b, 0.5, (16,)))
    j = int(np.flatnonzero(m_a & ~m_b)[0])
    v = np.zeros(16, np.float32)
    v[j] = 1.5
    x = np.linspace(-1.0, 1.5, 16).astype(np.float32)
    f_a, f_b = _dropout_fn(key_a, [0]), _dropout_fn(key_b, [0])
    assert f_a.__code__ is f_b.__code__
    want = 2 * 1.5 * float(x[j]) ** 2  # exact in float64; the check's lifted value: rel 1e-6
    for f, kept in ((f_a, True), (f_b, False), (f_a, True)):
        report = fg.check_grads(f, jnp.asarray(v), jnp.asarray(x))
        [row] = report.rows
        assert report.ok
        if kept:
            assert row.worst_index == (j,)
            assert row.analytic == pytest.approx(want, rel=1e-6)
        else:  # every element's gradient is zero: no worst error anywhere
            assert row.max_abs_error == 0.0 and row.analytic == 0.0


def test_other_shapes_dtypes_or_has_aux_get_their_own_programs():
    # One fn, called at another shape (another mask: bernoulli draws per element) and with
    # has_aux the other way round; each check's analytic value is the user's gradient.
    key = jax.random.key(3)

    def f(v):
        keep = jax.random.bernoulli(key, 0.5, v.shape)
        y = jnp.where(keep, v, 0.0)
        return jnp.sum(y * y), y

    def users_grad(v):  # as the user runs it (x64 off): d/dv sum(y^2) = 2 y keep
        return np.asarray(jax.grad(lambda v: f(v)[0])(v), np.float64)

    for n in (12, 16, 12):
        v = jnp.linspace(0.5, 2.0, n)
        report = fg.check_grads(f, v, has_aux=True)
        [row] = report.rows
        assert report.ok and row.shape == (n,) and report.lifted_from == "float32"
        assert row.analytic == pytest.approx(users_grad(v)[row.worst_index], rel=1e-6)
    # Without has_aux the pair is checked whole (uᵀJ of 1 + 12 outputs): had the has_aux
    # programs been reused, the user's value would have 1 element against the check's 13 and
    # the check would fall back to float32 tolerances (weaker).
    report = fg.check_grads(f, jnp.linspace(0.5, 2.0, 12))
    assert report.ok and report.weaker is None and report.lifted_from == "float32"
    assert any("output has 13 elements" in n for n in report.notes)


def test_another_dtype_gets_its_own_program():
    # g draws its mask in v's dtype: bfloat16 and float32 draws from one key differ. With v
    # zero except at an element j that the bfloat16 mask keeps and the float32 mask drops, g's
    # gradient at bfloat16 v is 2 v_j = 3 at j (exact: 1.5 is a bfloat16) and zero elsewhere;
    # served the float32 program (checked first), the check would see a zero gradient.
    key = jax.random.key(3)

    def g(v):
        keep = jax.random.uniform(key, v.shape, v.dtype) < 0.5
        return jnp.sum(jnp.where(keep, v, 0.0) ** 2)

    m32 = np.asarray(jax.random.uniform(key, (16,), jnp.float32) < 0.5)
    m16 = np.asarray(jax.random.uniform(key, (16,), jnp.bfloat16) < 0.5)
    j = int(np.flatnonzero(m16 & ~m32)[0])
    v = np.zeros(16, np.float32)
    v[j] = 1.5
    assert fg.check_grads(g, jnp.asarray(v)).rows[0].analytic == 0.0  # float32: j dropped
    report = fg.check_grads(g, jnp.asarray(v, jnp.bfloat16))
    [row] = report.rows
    assert report.ok  # (the check's float64 mask may keep j too: then it is not rebuilt)
    assert row.worst_index == (j,) and row.analytic == pytest.approx(3.0, rel=1e-6)
