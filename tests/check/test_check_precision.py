"""The gradient checker on low-precision code and at ties (issue 12, points 2, 4 and 6).

A function that computes in bfloat16 (or float32 under float64 inputs) is checked with its
low-precision casts lifted to float64, custom rules included, so a 10% (or 1%) error in a
custom rule fails instead of hiding under bfloat16 tolerances. At a tie, a custom rule is held
to JAX's own convention there (or a one-sided derivative), not to "anywhere between the
one-sided slopes".
"""
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

import funcgrad as fg

# --- a tanh with a hand-written backward pass, optionally wrong in one element -----------

def make_tanh(bug=None):
    """tanh with a custom_vjp; `bug = (index, factor)` multiplies that element of the input
    cotangent by `factor` (1.1: 10% wrong). The residual is tanh(h), saved in h's dtype."""
    @jax.custom_vjp
    def act(h):
        return jnp.tanh(h)

    def fwd(h):
        y = jnp.tanh(h)
        return y, y

    def bwd(y, g):
        d = g * (1 - y * y)  # tanh' = 1 - tanh^2
        return (d if bug is None else d.at[bug[0]].multiply(bug[1]),)

    act.defvjp(fwd, bwd)
    return act


def _point(m=4, n=3):
    w = jax.random.normal(jax.random.key(0), (m, n)) * 0.5
    x = jax.random.normal(jax.random.key(1), (1, m))
    c = jax.random.normal(jax.random.key(2), (1, n))
    return w, x, c


def bf16_layer(act):
    """A layer computed in bfloat16 by explicit casts, as mixed-precision code does."""
    def f(w, x, c):
        h = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
        return jnp.sum(act(h).astype(jnp.float32) * c)
    return f


def test_a_10_percent_wrong_custom_rule_in_bfloat16_code_fails():
    # Batch of one: the bug scales d(loss)/dh[0, 1] by 1.1, so column 1 of dL/dw = x^T d is
    # 10% too large: half bfloat16's rtol 0.2 (it passed), 1e5x float64's 1e-6.
    w, x, c = _point()
    report = fg.check_grads(bf16_layer(make_tanh(bug=((0, 1), 1.1))), w, x, c)
    assert not report.ok
    assert report.lifted_from == "bfloat16" and report.dtype_used == "float64"
    assert (report.eps, report.rtol, report.atol) == fg.check.TOLERANCES["float64"]
    [bad] = report.failures
    assert bad.path == "w" and bad.worst_index[1] == 1
    assert bad.analytic == pytest.approx(1.1 * bad.numeric, rel=1e-6)
    assert any("bfloat16" in n and "lifted" in n for n in report.notes)


def test_a_correct_bfloat16_function_passes_at_float64_tolerances():
    w, x, c = _point()
    report = fg.check_grads(bf16_layer(make_tanh()), w, x, c)
    assert report.ok, str(report)
    assert report.lifted_from == "bfloat16" and report.dtype_used == "float64"
    assert "lifted from bfloat16" in str(report)
    # The lifted check still saw the function: its numeric derivative is the float64 one,
    # x^T (c * tanh'(x w)) (by hand, at float64), element (2, 0):
    h = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    expected = np.asarray(x, np.float64).T @ (np.asarray(c, np.float64) * (1 - np.tanh(h) ** 2))
    [row] = report.rows
    if row.worst_index is not None:
        assert row.numeric == pytest.approx(expected[row.worst_index], rel=1e-6)


def test_opting_out_checks_as_computed_and_states_the_resolution():
    w, x, c = _point()
    report = fg.check_grads(bf16_layer(make_tanh(bug=((0, 1), 1.1))), w, x, c,
                            options=fg.CheckOptions(lift_precision=False))
    assert report.lifted_from is None and report.dtype_used == "bfloat16"
    assert report.ok  # the 10% bug hides under bfloat16 tolerances: what lifting is for
    assert any("relative errors below 0.2, and any error at all in a derivative smaller than 0.2"
               in n for n in report.notes)


def test_a_flax_bfloat16_dense_layer_with_a_wrong_custom_activation_fails():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        act: object

        @nn.compact
        def __call__(self, x):
            return self.act(nn.Dense(3, dtype=jnp.bfloat16)(x))

    x = jax.random.normal(jax.random.key(1), (1, 4))
    c = jax.random.normal(jax.random.key(2), (1, 3))
    params = Model(make_tanh()).init(jax.random.key(0), x)

    def loss(act):
        return lambda p: jnp.sum(Model(act).apply(p, x).astype(jnp.float32) * c)

    good = fg.check_grads(loss(make_tanh()), params)
    assert good.ok and good.lifted_from == "bfloat16", str(good)
    bad = fg.check_grads(loss(make_tanh(bug=((0, 2), 1.1))), params)
    assert not bad.ok and bad.lifted_from == "bfloat16"
    # dL/db_2 and dL/dkernel[:, 2] both carry the 10% error (batch of one).
    assert {r.path.split("[")[-1] for r in bad.failures} == {"'bias']", "'kernel']"}
    assert all(r.analytic == pytest.approx(1.1 * r.numeric, rel=1e-6) for r in bad.failures)


def test_a_custom_jvp_inside_a_bfloat16_scan_is_lifted_too():
    # sin with a jvp rule 10% wrong, iterated in a bfloat16 scan carry: d/dx of sin(sin(x))
    # is cos(sin x) cos x; the rule's 1.1 enters once per step.
    def make_sin(factor):
        @jax.custom_jvp
        def s(x):
            return jnp.sin(x)
        s.defjvp(lambda p, t: (jnp.sin(p[0]), factor * jnp.cos(p[0]) * t[0]))
        return s

    def f(sin):
        def g(x):
            y = jax.lax.scan(lambda c, _: (sin(c), None), x.astype(jnp.bfloat16), None,
                             length=2)[0]
            return jnp.sum(y.astype(jnp.float32))
        return g

    x = jnp.array([0.3, -0.7, 1.1])
    good = fg.check_grads(f(make_sin(1.0)), x)
    assert good.ok and good.lifted_from == "bfloat16", str(good)
    for mode in ("full", "directional"):
        bad = {"full": fg.check_grads, "directional": fg.check_directional}[mode](
            f(make_sin(1.1)), x)
        assert not bad.ok and bad.lifted_from == "bfloat16", mode
        # analytic = 1.1^2 x the true derivative (the rule runs at both steps), 1.1 as the
        # rule's bfloat16 trace stored it (1.1015625): a literal keeps its rounded value.
        [row] = bad.rows
        factor = float(jnp.asarray(1.1, jnp.bfloat16))
        assert row.analytic == pytest.approx(factor ** 2 * row.numeric, rel=1e-6)


def test_float64_inputs_with_a_float32_computation_see_a_1_percent_error():
    # Point 6: float32 tolerances (rtol 1e-2) cannot see a 1% error; lifted, float64's can.
    w, x, c = _point()

    def f(act):
        return lambda w, x, c: jnp.sum(act(x.astype(jnp.float32) @ w.astype(jnp.float32)) * c)
    assert fg.check_grads(f(make_tanh()), w, x, c).ok
    report = fg.check_grads(f(make_tanh(bug=((0, 0), 1.01))), w, x, c)
    assert not report.ok and report.lifted_from == "float32", str(report)
    [bad] = report.failures
    assert bad.worst_index[1] == 0 and bad.analytic == pytest.approx(1.01 * bad.numeric, rel=1e-6)


def test_where_lifting_cannot_reach_the_check_falls_back_and_says_what_it_could_see():
    # A primal computed on the host in float32 (pure_callback) with a jvp rule: the callback's
    # result types are fixed, so the path stays float32 and the check runs at float32's
    # tolerances, saying so; a correct rule passes.
    @jax.custom_jvp
    def host_sin(x):
        return jax.pure_callback(lambda v: np.sin(v).astype(np.float32),
                                 jax.ShapeDtypeStruct(x.shape, jnp.float32), x,
                                 vmap_method="sequential")
    host_sin.defjvp(lambda p, t: (host_sin(p[0]), jnp.cos(p[0]) * t[0]))

    report = fg.check_grads(lambda x: jnp.sum(host_sin(x.astype(jnp.float32))),
                            jnp.array([0.1, 0.5]))
    assert report.ok and report.lifted_from is None and report.dtype_used == "float32"
    assert any("relative errors below 0.01" in n for n in report.notes)
    # Weaker than asked, and said so: in the status line, in .weaker, and strict fails it.
    assert report.weaker and "float32" in report.weaker
    assert "WEAKER THAN ASKED" in str(report).splitlines()[0]
    report.raise_if_failed()  # the rows pass
    with pytest.raises(AssertionError, match="weaker than asked"):
        report.raise_if_failed(strict=True)
    # Opting out (lift_precision=False) is what was asked: not weaker.
    asked = fg.check_grads(lambda x: jnp.sum(host_sin(x.astype(jnp.float32))),
                           jnp.array([0.1, 0.5]), options=fg.CheckOptions(lift_precision=False))
    assert asked.ok and asked.weaker is None


def test_a_lift_that_breaks_inside_funcgrad_raises_instead_of_passing_at_low_precision(
        monkeypatch):
    # JAX 0.12 moved internals the lift read (a scan's num_consts, custom_vjp's bwd output):
    # the lift raised, the check fell back to bfloat16's tolerances, and a 10% wrong rule
    # passed. A lift that breaks for a reason of funcgrad's is an error now. Simulated here
    # by breaking the lifting interpreter's bind.
    from funcgrad.check import _lift

    def broken(eqn, ins):
        raise AttributeError("'list' object has no attribute 'aval'")

    monkeypatch.setattr(_lift, "_lifted_bind", broken)
    w, x, c = _point()
    with pytest.raises(fg.LiftError,
                       match=r"options=funcgrad\.CheckOptions\(lift_precision=False\)"):
        fg.check_grads(bf16_layer(make_tanh(bug=((0, 1), 1.1))), w, x, c)


# --- ties: a custom rule is held to JAX's convention -------------------------------------

def custom_maximum(share):
    """maximum(x, y) with a custom_vjp giving x the fraction `share` of the cotangent at a
    tie (JAX's own rule: 0.5)."""
    @jax.custom_vjp
    def mx(x, y):
        return jnp.maximum(x, y)

    def fwd(x, y):
        return mx(x, y), (x, y)

    def bwd(res, g):
        x, y = res
        wx = jnp.where(x > y, 1.0, jnp.where(x < y, 0.0, share))
        return g * wx, g * (1 - wx)

    mx.defvjp(fwd, bwd)
    return mx


def custom_max(share):
    """jnp.max over a vector with a custom_vjp: at a 2-way tie the first tied element gets
    `share` of the cotangent, the second 1 - share (JAX's own rule: 0.5 each)."""
    @jax.custom_vjp
    def mx(v):
        return jnp.max(v)

    def fwd(v):
        return mx(v), v

    def bwd(v, g):
        tied = (v == jnp.max(v)).astype(v.dtype)
        first = jnp.cumsum(tied) == 1
        w = jnp.where(tied.sum() > 1, jnp.where(first, share, 1 - share) * tied, tied)
        return (g * w,)

    mx.defvjp(fwd, bwd)
    return mx


def _max_tie(share, check=None):
    fn, args = lambda v: 2.0 * custom_max(share)(v), (jnp.array([1.0, 3.0, 3.0, -2.0]),)
    return check(fn, args) if check else fg.check_grads(fn, *args)


def _maximum_tie(share, check=None):
    fn = lambda x, y: jnp.sum(custom_maximum(share)(x, y) * jnp.array([1.0, 2.0]))
    args = (jnp.array([0.5, 1.0]), jnp.array([0.5, -1.0]))
    return check(fn, args) if check else fg.check_grads(fn, *args, argnums=(0, 1))


def _jax_check_grads(fn, args):
    """JAX's own checker (jax.test_util.check_grads, reverse mode, float64): True if it passes."""
    with jax.enable_x64(True):
        try:
            jax.test_util.check_grads(fn, tuple(a.astype(jnp.float64) for a in args), order=1,
                                      modes=["rev"])
        except AssertionError:
            return False
    return True


@pytest.mark.parametrize("share", [0.505, 0.55])
@pytest.mark.parametrize("case", [_maximum_tie, _max_tie], ids=["maximum", "max"])
def test_a_custom_rule_off_the_convention_at_a_tie_fails(case, share):
    # At the tie the one-sided derivatives are 0 and 1 (times the cotangent weight), JAX's
    # own rule gives half of it; `share` is neither: a wrong rule, as jax.test_util.check_grads
    # also finds.
    report = case(share)
    assert not report.ok, str(report)
    assert not case(share, check=_jax_check_grads)  # the second opinion agrees
    weight = 2.0 if case is _max_tie else 1.0
    bad = report.failures[0]
    # The worst element is either tied one: it got `share` or 1 - share of the weight.
    assert min(abs(bad.analytic - weight * share), abs(bad.analytic - weight * (1 - share))) < 1e-9
    assert bad.numeric == pytest.approx(weight * 0.5, rel=1e-6)
    assert any(f"JAX's own rule gives {weight * 0.5:.6g}" in n for n in bad.notes), str(report)


@pytest.mark.parametrize("case", [_maximum_tie, _max_tie], ids=["maximum", "max"])
def test_a_custom_rule_with_the_equal_share_passes_at_a_tie(case):
    report = case(0.5)
    assert report.ok, str(report)
    assert case(0.5, check=_jax_check_grads)
    assert "nondifferentiable_point" in [r.status for r in report.rows]


def test_a_custom_rule_taking_a_one_sided_derivative_at_a_tie_passes():
    # PyTorch's max gives the whole cotangent to one tied element: each element's value is
    # one of its one-sided derivatives (1: right, 0: left), a valid convention.
    report = _max_tie(1.0)
    assert report.ok, str(report)
    [row] = report.rows
    assert {k[4] for k in row.kinks} == {"the right derivative", "the left derivative"}


def test_a_three_way_tie_is_held_to_jax_s_own_share():
    # Three tied elements: JAX's rule gives 1/3 each (reduce_max's jvp divides by the count).
    # A custom rule giving 1/2, 1/4, 1/4 is no one-sided derivative, nor the mean of them
    # (1/2) for the last two, nor JAX's 1/3: it fails; 1/3 each passes.
    def make(weights):
        @jax.custom_vjp
        def mx(v):
            return jnp.max(v)
        mx.defvjp(lambda v: (mx(v), v),
                  lambda v, g: (g * jnp.where(v == jnp.max(v), jnp.asarray(weights), 0.0),))
        return mx
    v = jnp.array([2.0, 2.0, 2.0])
    assert fg.check_grads(make([1 / 3, 1 / 3, 1 / 3]), v).ok
    bad = fg.check_grads(make([0.5, 0.25, 0.25]), v)
    assert not bad.ok
    assert any("JAX's own rule gives 0.333333" in n for n in bad.rows[0].notes), str(bad)


def test_a_tie_in_directional_mode_is_held_to_the_convention_too():
    v = jnp.array([1.0, 3.0, 3.0, -2.0])
    assert fg.check_directional(custom_max(0.5), v).ok
    assert not fg.check_directional(custom_max(0.55), v).ok


def test_a_correct_bfloat16_flax_model_with_dropout_and_layernorm_passes_lifted():
    # Dropout's mask comes from random bits bitcast to float32: off the differentiated path,
    # it may stay float32 without stopping the lift. LayerNorm, max_pool (reduce_window),
    # flax's relu (a custom_jvp) and the bfloat16 dense layers are all lifted, so the
    # correct model passes at float64 tolerances, not bfloat16's 0.2.
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(8, dtype=jnp.bfloat16)(x))
            h = nn.max_pool(h[..., None], (1, 2), strides=(1, 2))[..., 0]
            h = nn.LayerNorm(dtype=jnp.bfloat16)(nn.Dropout(0.5, deterministic=False)(h))
            return nn.Dense(2, dtype=jnp.bfloat16)(h)

    x = jax.random.normal(jax.random.key(1), (3, 4))
    model = Model()
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(2)}, x)

    def loss(p):
        out = model.apply(p, x, rngs={"dropout": jax.random.key(3)})
        return jnp.mean(out.astype(jnp.float32) ** 2)

    report = fg.check_grads(loss, params)
    assert report.ok and report.lifted_from == "bfloat16", str(report)
    assert report.rtol == fg.check.TOLERANCES["float64"][1]


def _scan_with_float32_carry(scale):
    # h0 is made in float32 inside fn, as flax's nn.RNN makes its carry in the param dtype:
    # with w promoted to float64 the scan's carry would change type, which JAX refuses.
    @jax.custom_vjp
    def act(z):
        return jnp.tanh(z)
    act.defvjp(lambda z: (jnp.tanh(z), z),
               lambda z, g: (g * (1 - jnp.tanh(z) ** 2) * scale,))

    def f(w, xs):
        step = lambda h, x: (act(w * h + x), None)
        return jnp.sum(jax.lax.scan(step, jnp.zeros(3, jnp.float32), xs)[0])
    return f


def test_a_function_that_only_runs_in_its_own_dtype_is_checked_lifted():
    # 0.1 (and the promotion to float64) crashed with JAX's raw scan carry TypeError; now fn
    # gets its leaves in float32 and the check lifts its arithmetic to float64. A 1% error in
    # one element of the activation's rule fails at that element; the exact rule passes.
    w = jnp.array([0.5, -0.3, 0.8], jnp.float32)
    xs = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)
    good = fg.check_grads(_scan_with_float32_carry(1.0), w, xs)
    assert good.ok and good.lifted_from == "float32" and good.dtype_used == "float64", str(good)
    bad = fg.check_grads(_scan_with_float32_carry(jnp.array([1.0, 1.01, 1.0])), w, xs)
    assert not bad.ok and bad.rows[0].worst_index == (1,), str(bad)


def test_a_flax_rnn_is_checked():
    # flax.linen.RNN(GRUCell): jax.grad runs in float32; the check runs lifted and passes.
    nn = pytest.importorskip("flax.linen")
    model = nn.RNN(nn.GRUCell(4))
    x = jax.random.normal(jax.random.key(0), (2, 5, 3))
    params = model.init(jax.random.key(1), x)
    report = fg.check_grads(lambda p, x: jnp.mean(model.apply(p, x) ** 2), params, x)
    assert report.ok and report.lifted_from == "float32", str(report)
    assert len(report.rows) == len(jax.tree.leaves(params))


def test_a_float32_while_loop_under_rev_is_fn_s_own_error_not_a_lift_error():
    # JAX cannot reverse a while_loop, lifted or not: the error is about fn, in fn's terms.
    def f(w):
        body = lambda s: (s[0] * w.astype(jnp.float32), s[1] + 1)  # noqa: E731
        return jax.lax.while_loop(lambda s: s[1] < 3, body, (w.astype(jnp.float32), 0))[0].sum()

    with pytest.raises(ValueError, match="while_loop.*CheckOptions\\(modes=\\('fwd',\\)\\)"):
        fg.check_grads(f, jnp.ones(3, jnp.float32))


# --- the check is about fn as the user runs it -------------------------------------------

def _dropout_masks(key, shape):
    """jax.random.bernoulli(key, 0.5, shape) as a float32 program draws it (JAX's default,
    x64 off: 32 random bits per element) and as the same code traced under x64 draws it (64
    bits): two different masks from one key."""
    m32 = np.asarray(jax.random.bernoulli(key, 0.5, shape))
    with jax.enable_x64(True):
        m64 = np.asarray(jax.random.bernoulli(key, 0.5, shape))
    return m32, m64


def test_a_check_with_dropout_differentiates_the_users_mask():
    # f(v) = sum((keep * v * x)^2): df/dv_j = 2 v_j x_j^2 keep_j. The check traces fn with
    # float64 inputs; under x64 the mask is drawn with 64 bits and differs (issue 25 point 1:
    # the report's analytic and numeric agreed on another function's gradient). With v zero
    # except at an element j where the two masks differ, the only non-zero derivative is at j:
    # the row's worst element is j and its analytic value must be the user's gradient there.
    key = jax.random.key(0)
    m32, m64 = _dropout_masks(key, (16,))
    j = int(np.flatnonzero(m32 != m64)[0])
    v = np.zeros(16, np.float32)
    v[j] = 1.5
    x = np.linspace(-1.0, 1.5, 16).astype(np.float32)

    def f(v, x):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.sum(jnp.where(keep, v * x, 0.0) ** 2)

    users = np.asarray(jax.grad(f)(jnp.asarray(v), jnp.asarray(x)))  # as the user runs it
    assert users[j] == pytest.approx(2 * 1.5 * float(x[j]) ** 2 * m32[j], rel=1e-6)
    report = fg.check_grads(f, jnp.asarray(v), jnp.asarray(x))
    row = report.rows[0]
    assert report.ok and row.worst_index == (j,)
    assert row.analytic == pytest.approx(users[j], rel=1e-6)
    assert row.numeric == pytest.approx(users[j], rel=1e-5, abs=1e-6)
    assert report.lifted_from == "float32" and report.weaker is None
    assert any("as you run it" in n and "another mask" in n for n in report.notes)


def test_a_wrong_rule_under_dropout_is_caught_on_the_users_mask():
    # A custom square whose backward is 10% too large, applied after dropout: caught, and
    # the worst element is one the user's mask keeps (a dropped element has no gradient).
    key = jax.random.key(3)
    m32, _ = _dropout_masks(key, (12,))

    @jax.custom_vjp
    def square(h):
        return h * h
    square.defvjp(lambda h: (h * h, h), lambda h, g: (2.2 * h * g,))

    def f(v):
        keep = jax.random.bernoulli(key, 0.5, v.shape)
        return jnp.sum(square(jnp.where(keep, v, 0.0)))

    report = fg.check_grads(f, jnp.linspace(0.5, 2.0, 12, dtype=jnp.float32))
    assert not report.ok
    assert m32[report.rows[0].worst_index]
