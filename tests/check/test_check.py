"""The gradient checker: passes correct code, names the leaf and element of planted bugs,
reports kinks and stop_gradient instead of failing them, checks second order (concept 19)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg
from funcgrad.check.testing import assert_grads_close

#: The two checks, by the mode their reports name.
CHECKS = {"full": fg.check_grads, "directional": fg.check_directional}

# --- a dense layer with a hand-written backward, optionally wrong ------------------------

def make_dense(bug=None):
    """y = x @ w + b with a custom_vjp; `bug` plants one error in the backward pass:
    ("double", (i, j)) doubles dW[i, j]; "sign_b" flips db; None is correct."""
    @jax.custom_vjp
    def dense(w, b, x):
        return x @ w + b[None, :]

    def fwd(w, b, x):
        return dense(w, b, x), (w, x)

    def bwd(res, g):
        w, x = res
        dw, db, dx = x.T @ g, g.sum(axis=0), g @ w.T
        if bug and bug[0] == "double":
            dw = dw.at[bug[1]].multiply(2.0)
        if bug == "sign_b":
            db = -db
        return dw, db, dx

    dense.defvjp(fwd, bwd)
    return dense


def mlp_loss(params, x, y, dense=None):
    # `dense` (possibly buggy) for the first layer, a correct one for the second.
    h = jnp.tanh((dense or make_dense())(params[0]["w"], params[0]["b"], x))
    logits = make_dense()(params[1]["w"], params[1]["b"], h)
    return fg.softmax_cross_entropy(logits, y)


def _mlp(sizes=(5, 4, 3), seed=0, batch=6, dtype=jnp.float32):
    params = fg.mlp_init(jax.random.key(seed), sizes, activation="tanh", dtype=dtype)
    params = [dict(p, b=jnp.full_like(p["b"], 0.1)) for p in params]
    x = jax.random.normal(jax.random.key(seed + 1), (batch, sizes[0]), dtype)
    y = jnp.arange(batch) % sizes[-1]
    return params, x, y


# --- correct functions pass -------------------------------------------------------------

def plain_loss(params, x, y):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, x, activation="tanh"), y)


STRUCTURES = {
    "list_of_dicts": lambda p: p,
    "dict": lambda p: {"first": p[0], "second": p[1]},
    "nested": lambda p: {"layers": [p[0], {"inner": p[1]}]},
}


def _as_list(tree):
    if isinstance(tree, list):
        return tree
    if "layers" in tree:
        return [tree["layers"][0], tree["layers"][1]["inner"]]
    return [tree["first"], tree["second"]]


@pytest.mark.parametrize("mode", ["full", "directional"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_correct_function_passes(mode, dtype, structure):
    with jax.enable_x64(dtype == jnp.float64):
        params, x, y = _mlp(dtype=dtype)
        tree = STRUCTURES[structure](params)
        report = CHECKS[mode](lambda p, x, y: plain_loss(_as_list(p), x, y), tree, x, y)
    assert report.ok, str(report)
    assert report.dtype_used == "float64"  # float32 inputs are promoted for the check
    assert len(report.rows) == 4 and all(r.status == "ok" for r in report.rows)
    assert all(r.max_abs_error < 1e-7 for r in report.rows)


def test_float32_work_off_the_differentiated_path_keeps_the_check_in_float64():
    # An accuracy in aux, (argmax == y).mean(), is float32 even under x64 (JAX's mean of a
    # bool), and a float32 value made from an integer carries no tangent either. Neither
    # rounds the derivative checked, so the check stays in float64 with its tight tolerances
    # (judged in float32, eps = 1e-3 crossed a ReLU kink and called a right gradient wrong).
    params, x, y = _mlp(dtype=jnp.float32)

    def with_accuracy(p, x, y):
        logits = fg.mlp_apply(p, x, activation="tanh")
        loss = fg.softmax_cross_entropy(logits, y)
        return loss, {"acc": (logits.argmax(-1) == y).mean()}

    def with_count(p, x, y):  # a float32 factor computed from an integer result of the params
        hits = (x @ p[0]["w"]).argmax(-1).astype(jnp.float32).sum()
        return plain_loss(p, x, y) + 0.0 * hits.astype(jnp.float64)

    for fn, aux in ((with_accuracy, True), (with_count, False)):
        report = fg.check_grads(fn, params, x, y, has_aux=aux)
        assert report.dtype_used == "float64" and report.lifted_from is None, str(report)
        assert report.ok, str(report)
    # A float32 cast on the differentiated path is seen: lifted to float64 by default, or,
    # checked as computed, it sets the tolerances.
    cast = lambda p, x, y: plain_loss(jax.tree.map(lambda a: a.astype(jnp.float32), p), x, y)
    assert fg.check_grads(cast, params, x, y).lifted_from == "float32"
    as_computed = fg.CheckOptions(lift_precision=False)
    assert fg.check_grads(cast, params, x, y, options=as_computed).dtype_used == "float32"


def test_has_aux_and_argnums_tuple_name_each_argument():
    def f(scale, x, bias):
        return jnp.sum(jnp.sin(x * scale)) + jnp.sum(bias["c"] ** 2), {"ignored": x}

    report = fg.check_grads(f, 1.5, jnp.linspace(-1, 1, 4), {"c": jnp.ones(2)}, argnums=(0, 2),
                            has_aux=True)
    assert report.ok, str(report)
    assert [r.path for r in report.rows] == ["scale", "bias['c']"]
    # d/dbias sum(bias^2) = 2*bias = 2 at bias = 1: the analytic value of the worst element.
    assert report.rows[1].analytic == pytest.approx(2.0)


def test_non_scalar_output_checks_vjp_with_a_random_cotangent():
    report = fg.check_grads(lambda x: jnp.tanh(x) * x, jnp.linspace(-2, 2, 6).reshape(2, 3))
    assert report.ok and any("uᵀJ" in n for n in report.notes)


# --- planted bugs are caught and located ---------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "directional"])
def test_doubled_element_is_located_to_leaf_and_element(mode):
    params, x, y = _mlp()
    buggy = functools.partial(mlp_loss, dense=make_dense(("double", (2, 1))))
    report = CHECKS[mode](buggy, params, x, y)
    assert not report.ok
    [bad] = report.failures
    assert bad.path == "params[0]['w']" and bad.worst_index == (2, 1)
    # The analytic value is exactly twice the true derivative, which the numeric value is.
    assert bad.analytic == pytest.approx(2 * bad.numeric, rel=1e-6)
    assert any("fwd skipped" in n for n in report.notes)  # custom_vjp: no jvp
    assert report.modes == ("rev",) and f"({mode}, rev," in str(report)  # what was checked


def test_sign_error_in_one_leaf():
    params, x, y = _mlp()
    report = fg.check_grads(functools.partial(mlp_loss, dense=make_dense("sign_b")), params, x, y)
    assert [r.path for r in report.failures] == ["params[0]['b']"]
    for r in report.failures:
        assert r.analytic == pytest.approx(-r.numeric, rel=1e-6)


def test_missing_term_in_a_fan_out_sum():
    # f(x) = sin(x) * x uses x twice; df/dx = cos(x)*x + sin(x). The backward below forgets the
    # second path's term sin(x), as when one branch of a fan-out is not summed.
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x) * x

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.cos(x) * x,))
    x = jnp.array([0.5, 1.0, 2.0])
    report = fg.check_grads(lambda p: jnp.sum(f(p["x"])), {"x": x})
    [bad] = report.failures
    i = bad.worst_index[0]
    xi = float(x[i])
    assert bad.analytic == pytest.approx(np.cos(xi) * xi, rel=1e-6)
    assert bad.numeric == pytest.approx(np.cos(xi) * xi + np.sin(xi), rel=1e-6)


def test_directional_mode_localises_in_a_large_model():
    # 256 -> 512 -> 256 -> 10: 264,458 parameters; dW[1] doubled at its largest-gradient element
    # (doubling a zero gradient would change nothing, so no checker could see it).
    sizes = (256, 512, 256, 10)
    params = fg.mlp_init(jax.random.key(0), sizes, activation="tanh")
    x = jax.random.normal(jax.random.key(1), (8, sizes[0]))
    y = jnp.arange(8) % 10

    def loss(params, x, y, dense):
        h = x
        for i, p in enumerate(params):
            h = dense(p["w"], p["b"], h)
            h = jnp.tanh(h) if i < len(params) - 1 else h
        return fg.softmax_cross_entropy(h, y)

    g = jax.grad(loss)(params, x, y, make_dense())
    target = tuple(int(i) for i in np.unravel_index(np.argmax(np.abs(g[1]["w"])), g[1]["w"].shape))
    report = fg.check_directional(functools.partial(loss, dense=make_dense(("double", target))),
                                  params, x, y)
    assert [r.path for r in report.failures] == ["params[1]['w']"]
    bad = report.failures[0]
    assert bad.worst_index == target
    assert bad.analytic == pytest.approx(2 * bad.numeric, rel=1e-5)
    assert any("bisection" in n for n in bad.notes)


# --- kinks and stop_gradient -------------------------------------------------------------

@pytest.mark.parametrize("fn, expected_value, convention", [
    # relu at 0: left derivative 0, right derivative 1; JAX's relu'(0) = 0, the left one.
    (jax.nn.relu, 0.0, "the left derivative"),
    # |x| at 0: left -1, right 1; JAX's abs'(0) = 1, the right one.
    (jnp.abs, 1.0, "the right derivative"),
    # maximum(x, 0) at 0: JAX splits the tie, 0.5 = the mean of 0 and 1.
    (lambda x: jnp.maximum(x, 0.0), 0.5, "the mean of the one-sided derivatives"),
], ids=["relu", "abs", "maximum"])
def test_kinks_are_reported_not_failed(fn, expected_value, convention):
    report = fg.check_grads(lambda x: jnp.sum(fn(x) * jnp.array([1.0, 1.0, 1.0])),
                            jnp.array([0.0, 1.5, -2.0]))
    assert report.ok, str(report)
    [row] = report.rows
    assert row.status == "nondifferentiable_point"
    [(index, left, right, value, conv)] = row.kinks
    assert index == (0,) and value == pytest.approx(expected_value) and conv == convention
    assert right - left == pytest.approx(1.0 if fn is not jnp.abs else 2.0, rel=1e-6)


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_an_accidental_stop_gradient_fails_and_is_named(mode):
    # f = sum(sg(a) * b): JAX's d/da is 0, the central difference sees b = [3, -1]. A weight
    # detached by mistake trains no more, so by default the check fails and names the cause
    # (PyTorch's gradcheck fails here too); funcgrad 0.1 passed it.
    def f(p):
        return jnp.sum(jax.lax.stop_gradient(p["a"]) * p["b"])

    p = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, -1.0])}
    report = CHECKS[mode](f, p)
    assert not report.ok and [r.status for r in report.rows] == ["stop_gradient", "ok"]
    assert [r.path for r in report.failures] == ["p['a']"]
    assert "FAILED" in str(report) and "allow_stop_gradient=[\"p['a']\"]" in str(report)
    with pytest.raises(AssertionError, match="stop_gradient"):
        report.raise_if_failed()
    with pytest.raises(AssertionError, match="stop_gradient"):
        assert_grads_close(f, p)
    if mode == "full":  # the worst element shows the cut: JAX 0, finite differences b[0] = 3
        assert report.rows[0].worst_index == (0,)
        assert (report.rows[0].analytic, report.rows[0].numeric) == pytest.approx((0.0, 3.0))
    # Declared, by path (or prefix) or for every leaf, it passes.
    for allow in (["p['a']"], "p['a']", True):
        declared = CHECKS[mode](f, p, allow_stop_gradient=allow)
        assert declared.ok and [r.status for r in declared.rows] == [
            "stop_gradient_declared", "ok"], str(declared)
    with pytest.raises(ValueError, match=r"names .p\['c'\]..*p\['a'\], p\['b'\]"):
        fg.check_grads(f, p, allow_stop_gradient=["p['c']"])
    with pytest.raises(TypeError, match="respect_stop_gradient= is no longer a keyword; it is "
                                        "allow_stop_gradient=True"):
        fg.check_grads(f, p, respect_stop_gradient=True)


def test_a_declared_stop_gradient_does_not_excuse_another_leaf():
    # Declaring p['a'] detached leaves p['b'] checked: its detached copy fails.
    def f(p):
        sg = jax.lax.stop_gradient
        return jnp.sum(sg(p["a"]) * p["b"]) + jnp.sum(sg(p["b"]) ** 2)

    p = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, -1.0])}
    report = fg.check_grads(f, p, allow_stop_gradient=["p['a']"])
    assert [r.status for r in report.rows] == ["stop_gradient_declared", "stop_gradient"]


def _sg_in_remat(p):
    return jax.checkpoint(lambda q: jnp.sum(jax.lax.stop_gradient(q["a"]) * q["b"]))(p)


def _sg_in_scan(p):
    step = lambda c, _: (c + jnp.sum(jax.lax.stop_gradient(p["a"]) * p["b"]), None)
    return jax.lax.scan(step, 0.0, None, length=2)[0]


def _sg_in_cond(p):
    return jax.lax.cond(p["b"][0] > 0, lambda: jnp.sum(jax.lax.stop_gradient(p["a"]) * p["b"]),
                        lambda: jnp.sum(p["b"]))


@pytest.mark.parametrize("f", [_sg_in_remat, _sg_in_scan, _sg_in_cond],
                         ids=["checkpoint", "scan", "cond"])
@pytest.mark.parametrize("mode", ["full", "directional"])
def test_stop_gradient_inside_remat_scan_and_cond_is_named(f, mode):
    # Same function as above, inside checkpoint, scan (counted twice) and the taken cond
    # branch: JAX's d/da is 0 where the central difference sees b (or 2b), so only the
    # see-through gradient, rebuilt through these primitives, explains the difference.
    p = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, -1.0])}
    report = CHECKS[mode](f, p)
    assert not report.ok and [r.status for r in report.rows] == ["stop_gradient", "ok"], str(report)
    declared = CHECKS[mode](f, p, allow_stop_gradient=True)
    assert declared.ok and [r.status for r in declared.rows] == ["stop_gradient_declared", "ok"]


def test_see_through_does_not_excuse_a_wrong_rule_inside_scan():
    # A custom_jvp with a wrong derivative (3x where the truth is 2x) inside scan next to a
    # stop_gradient: the see-through gradient keeps the custom rule, so p['b'] still fails.
    @jax.custom_jvp
    def square(x):
        return x * x
    square.defjvp(lambda primals, tangents: (square(primals[0]), 3 * primals[0] * tangents[0]))

    def f(p):
        step = lambda c, _: (c + jnp.sum(jax.lax.stop_gradient(p["a"]) * square(p["b"])), None)
        return jax.lax.scan(step, 0.0, None, length=2)[0]
    report = fg.check_grads(f, {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, -1.0])})
    assert [r.status for r in report.rows] == ["stop_gradient", "fail"]


def _cube_by_while(p):
    # p multiplied into 1.0 three times: p**3, by a loop JAX can only forward-differentiate.
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * p),
                              (0, jnp.ones_like(p)))[1].sum()


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_a_while_loop_is_checked_in_forward_mode_alone(mode):
    # Hand: d/dp sum(p**3) = 3 p**2 = [6.75, 0.75] at p = [1.5, -0.5]; fwd alone checks it.
    p = jnp.array([1.5, -0.5])
    report = CHECKS[mode](_cube_by_while, p, options=fg.CheckOptions(modes=("fwd",)))
    assert report.ok and report.modes == ("fwd",)
    if mode == "full":  # the worst element's jvp is 3 p**2 there
        i = report.rows[0].worst_index[0]
        np.testing.assert_allclose(report.rows[0].analytic, 3 * float(p[i]) ** 2, rtol=1e-9)
    with pytest.raises(ValueError,
                       match=r"while_loop.*options=funcgrad\.CheckOptions\(modes=\('fwd',\)\)"):
        fg.check_grads(_cube_by_while, p)


def test_forward_mode_alone_checks_every_element_and_catches_a_wrong_jvp():
    # A custom_jvp whose derivative is wrong in element 1 only (x -> x**2 with tangent 2x,
    # except 3x at index 1): fwd alone, element by element, names that element.
    @jax.custom_jvp
    def square(x):
        return x * x
    square.defjvp(lambda pr, t: (square(pr[0]),
                                 2 * pr[0] * t[0] * jnp.array([1.0, 1.5, 1.0])))
    report = fg.check_grads(lambda x: jnp.sum(square(x)), jnp.array([1.0, 2.0, -1.0]),
                            options=fg.CheckOptions(modes=("fwd",)))
    assert not report.ok and report.rows[0].worst_index == (1,)
    # Hand: analytic 3 * 2 = 6 where the central difference gives 2 * 2 = 4.
    np.testing.assert_allclose([report.rows[0].analytic, report.rows[0].numeric], [6.0, 4.0],
                               rtol=1e-6)


@pytest.mark.parametrize("mode, modes", [("full", ("rev", "fwd")), ("full", ("fwd",)),
                                         ("full", ("rev",)), ("directional", ("rev", "fwd"))],
                         ids=["both", "fwd", "rev", "dir"])
def test_stop_gradient_inside_a_while_loop_is_named(mode, modes):
    # f(a) = sum over 3 iterations of sg(a)**2, plus sum(a): JAX's gradient is 1 per element,
    # the central difference 6a + 1. Without stop_gradient the loop depends on a, so the
    # see-through gradient can only be taken in forward mode.
    sg = jax.lax.stop_gradient

    def f(a):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + sg(a) ** 2),
                                  (0, jnp.zeros(3)))[1].sum() + a.sum()
    options = fg.CheckOptions(modes=modes)
    report = CHECKS[mode](f, jnp.array([1.0, 2.0, 3.0]), options=options)
    assert not report.ok and [r.status for r in report.rows] == ["stop_gradient"], str(report)
    declared = CHECKS[mode](f, jnp.array([1.0, 2.0, 3.0]), allow_stop_gradient=True,
                            options=options)
    assert declared.ok and [r.status for r in declared.rows] == ["stop_gradient_declared"]


def test_second_order_through_a_while_loop_is_a_clear_error():
    wl = lambda a: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])),
                                      (0, a))[1].sum()
    with pytest.raises(ValueError,
                       match=r"order=2 checks the gradient.*CheckOptions\(modes=\('fwd',\)\)"):
        fg.check_grads(wl, jnp.ones(3), options=fg.CheckOptions(modes=("fwd",), order=2))


def test_empty_leaves_are_skipped_not_failed():
    # A (0,) leaf has no element to check: listed as skipped (it was a NaN failure, an
    # IndexError in directional mode, and a ZeroDivisionError when alone).
    f = lambda p: jnp.sum(p["a"] ** 2) + jnp.sum(p["e"])
    p = {"a": jnp.ones(2), "e": jnp.zeros((0,))}
    for mode in ("full", "directional"):
        report = CHECKS[mode](f, p)
        assert report.ok and [r.path for r in report.rows] == ["p['a']"]
        assert any("p['e']" in s and "empty" in s for s in report.skipped)
    with pytest.raises(ValueError, match=r"no floating leaf to differentiate.*skipped: e \(shape"):
        fg.check_grads(lambda e: jnp.sum(e), jnp.zeros((0,)))


def test_forward_mode_alone_in_directional_mode_locates_the_element():
    # x**2 with a jvp that is 1.5x too large at index 37 of 64: bisection on jvps finds it.
    # Hand: analytic 2 * 1.5 * x = 3x there, the central difference 2x.
    scale = jnp.ones(64).at[37].set(1.5)

    @jax.custom_jvp
    def square(x):
        return x * x
    square.defjvp(lambda pr, t: (square(pr[0]), 2 * pr[0] * t[0] * scale))
    x = jnp.linspace(0.5, 2.0, 64)
    report = fg.check_directional(lambda x: jnp.sum(square(x)), x,
                                  options=fg.CheckOptions(modes=("fwd",)))
    row = report.rows[0]
    assert not report.ok and row.worst_index == (37,)
    np.testing.assert_allclose([row.analytic, row.numeric], [3 * float(x[37]), 2 * float(x[37])],
                               rtol=1e-6)


def test_forward_mode_alone_with_a_custom_vjp_is_a_clear_error():
    with pytest.raises(ValueError,
                       match=r"CheckOptions\(modes=\('fwd',\)\) but fn uses a custom_vjp"):
        fg.check_grads(lambda p: mlp_loss(p, *_mlp()[1:]), _mlp()[0],
                       options=fg.CheckOptions(modes=("fwd",)))


# --- second order -----------------------------------------------------------------------

SECOND_ORDER = {
    "tanh_sum": (lambda x: jnp.sum(jnp.tanh(x)), (jnp.linspace(-1, 1, 5, dtype=jnp.float32),)),
    "logsumexp": (jax.nn.logsumexp, (jnp.linspace(-2, 3, 6, dtype=jnp.float32),)),
    "softmax_xent": (lambda z: fg.softmax_cross_entropy(z, jnp.array([0, 2])),
                     (jnp.array([[0.1, -1.0, 2.0], [1.0, 0.5, -0.3]], jnp.float32),)),
    "mlp": (lambda p: plain_loss(p, *_mlp()[1:]), (_mlp()[0],)),
}


@pytest.mark.parametrize("name", list(SECOND_ORDER))
def test_order_two_passes_from_float32_inputs(name):
    fn, args = SECOND_ORDER[name]
    report = fg.check_grads(fn, *args, options=fg.CheckOptions(order=2))
    assert report.ok and report.order == 2 and report.dtype_used == "float64", str(report)


def test_order_two_catches_a_wrong_hessian():
    # cube(x) = x^3 with a jvp rule 3 * frozen_sq(x) * t: right at first order (3x^2), but
    # frozen_sq declares a zero derivative, so the Hessian comes out 0 instead of 6x.
    @jax.custom_jvp
    def frozen_sq(x):
        return x ** 2

    frozen_sq.defjvp(lambda p, t: (p[0] ** 2, jnp.zeros_like(t[0])))

    @jax.custom_jvp
    def cube(x):
        return x ** 3

    cube.defjvp(lambda p, t: (cube(p[0]), 3 * frozen_sq(p[0]) * t[0]))
    x = jnp.array([0.7, -1.2])
    assert fg.check_grads(lambda x: jnp.sum(cube(x)), x).ok
    second = fg.check_grads(lambda x: jnp.sum(cube(x)), x, options=fg.CheckOptions(order=2))
    [bad] = second.failures
    assert bad.analytic == pytest.approx(0.0, abs=1e-12) and abs(bad.numeric) > 1.0


# --- precision, skipped leaves, errors ---------------------------------------------------

def test_function_forcing_float32_is_checked_with_float32_tolerances_as_computed():
    f = lambda x: jnp.sum(jnp.tanh(x.astype(jnp.float32)))
    lifted = fg.check_grads(f, jnp.linspace(-1, 1, 5))  # the default: float32 lifted
    assert lifted.ok and lifted.dtype_used == "float64" and lifted.lifted_from == "float32"
    assert (lifted.eps, lifted.rtol, lifted.atol) == fg.check.TOLERANCES["float64"]
    report = fg.check_grads(f, jnp.linspace(-1, 1, 5),
                            options=fg.CheckOptions(lift_precision=False))
    assert report.ok and report.dtype_used == "float32"
    assert (report.eps, report.rtol, report.atol) == fg.check.TOLERANCES["float32"]
    assert any("computes in float32" in n for n in report.notes)


def test_integer_leaves_are_skipped_and_listed():
    report = fg.check_grads(lambda p: jnp.sum(p["w"] ** 2) * p["n"],
                            {"w": jnp.ones(3), "n": jnp.array(3)})
    assert report.ok and [r.path for r in report.rows] == ["p['w']"]
    assert report.skipped == ["p['n'] (int32, not differentiated)"] or \
        report.skipped == ["p['n'] (int64, not differentiated)"]


def test_errors_are_clear():
    with pytest.raises(ValueError,
                       match=r"argument n \(argnums=0\) has dtype int.*cannot be differentiated"):
        fg.check_grads(lambda n: n * 2.0, jnp.array(3))
    with pytest.raises(ValueError,
                       match=r"not finite at the primal point.*first at output\[1\] = -inf"):
        fg.check_grads(lambda x: jnp.log(x), jnp.array([1.0, 0.0, 2.0]))
    with pytest.raises(TypeError, match="mode= is no longer a keyword"):
        fg.check_grads(jnp.sum, jnp.ones(2), mode="fast")
    with pytest.raises(ValueError, match="argnums=3 is out of range"):
        fg.check_grads(jnp.sum, jnp.ones(2), argnums=3)
    with pytest.raises(ValueError, match="order must be 1 or 2"):
        fg.check_grads(jnp.sum, jnp.ones(2), options=fg.CheckOptions(order=3))
    with pytest.raises(TypeError, match="fn must be callable"):
        fg.check_grads("loss", jnp.ones(2))


# --- report forms, pytest helper, audit --------------------------------------------------

def test_report_table_dict_and_raise():
    params, x, y = _mlp()
    report = fg.check_grads(functools.partial(mlp_loss, dense=make_dense(("double", (0, 0)))),
                            params, x, y)
    text = str(report)
    assert "FAILED" in text and "params[0]['w']" in text and "(0, 0)" in text
    d = report.to_dict()
    assert d["ok"] is False and d["rows"][1]["path"] == "params[0]['w']"
    assert d["rows"][1]["status"] == "fail" and d["rows"][0]["status"] == "ok"
    with pytest.raises(AssertionError, match=r"params\[0\]\['w'\]"):
        report.raise_if_failed()


def test_assert_grads_close():
    params, x, y = _mlp()
    assert assert_grads_close(plain_loss, params, x, y).ok
    with pytest.raises(AssertionError, match="gradient check failed for 1 leaf"):
        assert_grads_close(functools.partial(mlp_loss, dense=make_dense(("double", (1, 1)))),
                           params, x, y)


def test_audit_picks_full_or_directional():
    params, x, y = _mlp()
    assert fg.audit(plain_loss, params, x, y).mode == "full"
    report = fg.audit(plain_loss, params, x, y, max_full_elements=10)
    assert report.mode == "directional" and report.ok
    assert [r.path for r in report.rows] == ["params[0]['b']", "params[0]['w']",
                                             "params[1]['b']", "params[1]['w']"]


def test_a_nan_derivative_never_passes():
    # d/dx where(x > 0, sqrt(x), 0) at x = -1 is 0, but JAX's is NaN: sqrt'(-1) = NaN times
    # the 0 cotangent of the untaken branch (the double-where problem). NaN > tol is False, so
    # a NaN must be failed explicitly; the element and both values are named.
    report = fg.check_grads(lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)),
                            jnp.array([-1.0, 4.0]))
    assert not report.ok
    [row] = report.rows
    assert row.status == "fail" and row.worst_index == (0,) and np.isnan(row.analytic)
    assert row.numeric == 0.0 and any("non-finite derivative" in n for n in row.notes)


def test_high_curvature_is_not_a_kink_that_excuses_a_wrong_gradient():
    # f(w) = k/2 (w - 1)^2 with k = 5000 at w = 1 + 1e-7: smooth, f' = k (w - 1) = 5e-4, but
    # the one-sided differences at eps = 1e-6 differ by eps k = 5e-3 > sqrt(eps), which alone
    # looks like a kink. The planted bwd adds 1e-3 (1e4 x atol). A second step eps/8 shrinks
    # the gap 8-fold (curvature; a kink's would not), so it is a plain failure.
    k = 5000.0

    @jax.custom_vjp
    def f(w):
        return 0.5 * k * (w - 1.0) ** 2

    f.defvjp(lambda w: (f(w), w), lambda w, g: (g * (k * (w - 1.0) + 1e-3),))
    report = fg.check_grads(lambda w: jnp.sum(f(w)), jnp.array([1.0 + 1e-7, 2.0]))
    [row] = report.rows
    assert row.status == "fail" and row.worst_index == (0,) and row.kinks == ()
    assert row.analytic - row.numeric == pytest.approx(1e-3, rel=1e-3)


def test_directional_tangents_are_described_not_stored():
    # Second method: the dense tangents of the full mode's fwd check. The directional mode's
    # plan (draw rows, segment bounds and norms) must describe exactly the same unit tangents
    # in the same order, and its host dot products must equal the dense ones.
    from funcgrad.check._directional_mode import _random_tangents, _tangent_plan
    segments, n, k = [(0, 3), (3, 10), (10, 11)], 11, 2
    dense, _ = _random_tangents(5, n, segments, k)
    plan = _tangent_plan(5, n, segments, k)
    np.testing.assert_allclose(plan.rows(slice(None)), dense, rtol=1e-15)
    g = np.arange(n, dtype=np.float64)
    np.testing.assert_allclose(plan.dot(g), dense @ g, rtol=1e-13)
    assert plan.raw.shape == (k, n)            # what is stored: the draws, not (8, 11)


@pytest.mark.parametrize("call, error, match", [
    (lambda f, x: fg.check_directional(f, x, num_directions=0), ValueError,
     "num_directions must be a positive int .*, got 0"),
    (lambda f, x: fg.check_grads(f, x, options=fg.CheckOptions(chunk_size=-2)), ValueError,
     "chunk_size must be a positive int or None, got -2"),
    (lambda f, x: fg.check_grads(f, x, argnums=True), TypeError,
     "argnums must be an int or a non-empty tuple of ints"),
], ids=["no_directions", "negative_chunk", "bool_argnums"])
def test_bad_settings_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(lambda x: jnp.sum(x ** 2), jnp.ones(2))


def test_non_array_and_static_arguments_get_the_partial_fix():
    def by_mode(x, mode):
        return jnp.sum(x ** 2) if mode == "sq" else jnp.sum(x)

    with pytest.raises(TypeError,
                       match=r"argument mode is a str, not an array.*functools\.partial"):
        fg.check_grads(by_mode, jnp.ones(3), "sq")

    def first_n(x, n):                      # n used as a Python int: range(n)
        return sum(x[i] for i in range(n))

    # n is not differentiated, so closing over it is the fix the message gives, at the line.
    with pytest.raises(TypeError, match=r"(?s)test_check\.py:\d+ \(first_n\).*Python int.*"
                       r"depends on n, which check_grads does not differentiate.*"
                       r"functools\.partial\(fn, n=\.\.\.\)"):
        fg.check_grads(first_n, jnp.ones(3), 2)
    # The fix the message gives works: d/dx_i sum_{i<2} x_i = (1, 1, 0).
    report = fg.check_grads(functools.partial(first_n, n=2), jnp.ones(3))
    assert report.ok


def test_an_equinox_model_passed_whole_is_checked_as_its_partition():
    # An eqx.nn.MLP holds its activation (a function) as a leaf: passed whole it is split as
    # eqx.partition(m, eqx.is_inexact_array) splits it (issue 13), so its check equals the
    # check of the split by hand: the MLP's weight and bias leaves, 2 per layer, by its paths.
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(3, 1, 4, 1, key=jax.random.key(0))
    whole = fg.check_grads(lambda m, x: jnp.sum(m(x)), model, jnp.ones(3))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    split = fg.check_grads(lambda m, x: jnp.sum(eqx.combine(m, static)(x)), params, jnp.ones(3))
    assert whole.ok and split.ok and len(whole.rows) == 4, str(whole)
    assert [r.path for r in whole.rows] == [r.path for r in split.rows] == [
        "m.layers[0].weight", "m.layers[0].bias", "m.layers[1].weight", "m.layers[1].bias"]
    assert [r.analytic for r in whole.rows] == [r.analytic for r in split.rows]


def test_tolerances_follow_a_float32_cast_inside_a_float64_function():
    # softmax computed in float32 inside a function that returns float64: its rounding
    # (~6e-8 relative, amplified by eps = 1e-6 central differences to ~1e-1) is float32's, so
    # float64 tolerances would fail a correct gradient. Checked as computed, the check must
    # use float32's; by default it lifts the cast and checks in float64 (custom_jvp of
    # softmax included).
    x = jax.random.normal(jax.random.key(0), (5,))

    def f(h):
        return jnp.sum(jax.nn.softmax(h.astype(jnp.float32)).astype(h.dtype) * x)

    point = jax.random.normal(jax.random.key(1), (5,))
    report = fg.check_grads(f, point, options=fg.CheckOptions(lift_precision=False))
    assert report.ok and report.dtype_used == "float32"
    assert any("computes in float32" in n for n in report.notes)
    lifted = fg.check_grads(f, point)
    assert lifted.ok and lifted.lifted_from == "float32" and lifted.dtype_used == "float64"
    assert all(r.max_rel_error < 1e-6 for r in lifted.rows), str(lifted)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"eps": -1.0}, ValueError, r"eps must be a finite number > 0 or None, got -1\.0"),
    ({"eps": 0.0}, ValueError, r"eps must be a finite number > 0 or None, got 0\.0"),
    ({"eps": "1e-3"}, TypeError, r"eps must be a number or None, got str"),
    ({"rtol": -1e-3}, ValueError, r"rtol must be a finite number >= 0 or None"),
    ({"atol": float("nan")}, ValueError, r"atol must be a finite number >= 0 or None, got nan"),
    ({"seed": -1}, ValueError, r"seed must be a non-negative int"),
], ids=["negative_eps", "zero_eps", "str_eps", "negative_rtol", "nan_atol", "negative_seed"])
def test_bad_steps_and_tolerances_are_refused(kwargs, error, match):
    # eps=0 used to fall back silently to the default step (eps or default), and eps=-1 ran
    # with a negative step: both "passed".
    with pytest.raises(error, match=match):
        fg.check_grads(lambda x: jnp.sum(x ** 2), jnp.ones(2), options=fg.CheckOptions(**kwargs))


def test_zero_tolerances_and_an_explicit_step_are_used_as_given():
    # f(x) = sum(x^2) at x = (1, 1) in float64: the central difference of a quadratic is exact
    # up to rounding (~1e-10 at eps = 1e-3), so rtol = atol = 0 demands exact agreement and
    # fails on rounding, while the report carries the values given.
    with jax.enable_x64(True):
        report = fg.check_grads(lambda x: jnp.sum(x ** 2), jnp.ones(2, jnp.float64),
                                options=fg.CheckOptions(eps=1e-3, rtol=0, atol=1e-9))
    assert (report.eps, report.rtol, report.atol) == (1e-3, 0.0, 1e-9) and report.ok


def test_audit_refuses_a_negative_max_full_elements():
    with pytest.raises(ValueError, match="max_full_elements must be a non-negative int"):
        fg.audit(lambda p: jnp.sum(p ** 2), jnp.ones(2), max_full_elements=-1)


def test_the_report_names_the_arguments_checked_and_not():
    # With the default argnums=0 the second argument's gradient is silently unchecked in 0.1;
    # the report now names both, and which unchecked one has floating leaves (could be meant).
    def f(w, x, n):
        return jnp.sum(w * x) * n

    report = fg.check_grads(f, jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0]), 3)
    assert report.checked_args == ("w (argnums=0)",)
    assert report.unchecked_args == ("x (argnums=1)", "n (argnums=2, nothing floating)")
    text = str(report)
    assert "checked arguments: w (argnums=0)" in text
    assert "not checked: x (argnums=1), n (argnums=2, nothing floating)" in text
    assert "to check x too, pass argnums" in text
    both = fg.check_grads(f, jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0]), 3, argnums=(0, 1))
    assert both.unchecked_args == ("n (argnums=2, nothing floating)",)
    assert [r.path for r in both.rows] == ["w", "x"]
    assert both.to_dict()["checked_args"] == ["w (argnums=0)", "x (argnums=1)"]


def test_a_long_full_check_announces_its_time_and_shows_progress(monkeypatch, capsys):
    # 150 elements in chunks of 2: 75 chunk rows cut into 38 blocks of 2 rows, one compiled
    # call each. With the "slow" threshold at 0 s the check must print its estimate and the
    # directional suggestion on stderr; its verdicts must equal the one-block run's (the same
    # 2n evaluations, only dispatched in pieces), including a planted bug's element.
    from funcgrad.check import _full_pass
    scale = jnp.ones(150).at[77].set(1.01)

    @jax.custom_vjp
    def f(x):
        return jnp.sum(jnp.sin(x))
    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.cos(x) * scale,))
    x = jnp.linspace(-2.0, 2.0, 150)
    one_call = fg.check_grads(f, x, options=fg.CheckOptions(progress=False))
    assert "check_grads perturbs" not in capsys.readouterr().err  # quick: nothing printed
    monkeypatch.setattr(_full_pass, "SLOW_SECONDS", 0.0)
    blocked = fg.check_grads(f, x, options=fg.CheckOptions(chunk_size=2))
    err = capsys.readouterr().err
    assert "check_grads perturbs each of 150 elements twice (300 forward passes)" in err
    assert "funcgrad.check_directional" in err and "left" in err
    assert blocked.rows[0].worst_index == one_call.rows[0].worst_index == (77,)
    # The sums run in other vmap widths, so f differs in its last bits: ~1e-16 / 2e-6 ≈ 1e-10.
    assert blocked.rows[0].numeric == pytest.approx(one_call.rows[0].numeric, rel=1e-8)
    assert blocked.rows[0].analytic == pytest.approx(float(scale[77]) * np.cos(float(x[77])),
                                                     rel=1e-12)  # scale is float32 1.01
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        fg.check_grads(f, x, options=fg.CheckOptions(progress="yes"))


def test_unusable_outputs_and_argnums_get_clear_errors():
    # A new user's mistakes that 0.1 answered with raw Python errors deep inside the checker.
    w = jnp.array([1.0, 2.0])
    with pytest.raises(TypeError, match=r"argnums must be an int or a non-empty tuple of ints"):
        fg.check_grads(lambda w: jnp.sum(w), w, argnums="w")
    with pytest.raises(TypeError, match=r"argnums must be an int or a non-empty tuple of ints"):
        fg.check_grads(lambda w: jnp.sum(w), w, argnums=1.0)
    with pytest.raises(ValueError, match=r"fn returned None, with no array to check"):
        fg.check_grads(lambda w: None, w)
    with pytest.raises(ValueError, match=r"has_aux=True expects fn to return a pair.*shape \(\)"):
        fg.check_grads(lambda w: jnp.sum(w), w, has_aux=True)
    # argnums=(0, 0) checks the argument once.
    assert fg.check_grads(lambda w: jnp.sum(w ** 2), w, argnums=(0, 0)).checked_args == (
        "w (argnums=0)",)


def test_a_pair_returned_without_has_aux_gets_a_hint():
    # (loss, metrics) without has_aux: both are checked (uᵀJ of all outputs), and the report
    # says how to check the loss alone.
    w = jnp.array([1.0, 2.0])
    report = fg.check_grads(lambda w: (jnp.sum(w ** 2), w * 3.0), w)
    assert any("pass has_aux=True" in n for n in report.notes), report.notes
    alone = fg.check_grads(lambda w: (jnp.sum(w ** 2), w * 3.0), w, has_aux=True)
    assert not any("has_aux" in n for n in alone.notes)


def test_a_resolution_near_the_derivative_is_flagged():
    # f = 1e12 + sum(0.01 w): the round-off floor 4·u·|f|/h = 4 · 1.1e-16 · 1e12 / 1e-6 ≈ 0.44
    # dwarfs the derivative 0.01, so a 100% error could not be seen: the check still passes
    # (it cannot know better) but must say its resolution is far above the derivative.
    report = fg.check_grads(lambda w: 1e12 + jnp.sum(0.01 * w), jnp.array([1.0, 2.0]))
    [row] = report.rows
    assert row.resolution > 0.01
    assert any(n.startswith("low resolution") for n in row.notes), row.notes
    quiet = fg.check_grads(lambda w: jnp.sum(0.01 * w), jnp.array([1.0, 2.0]))
    assert not any(n.startswith("low resolution") for n in quiet.rows[0].notes)


# --- fuzz-found (tests/test_fuzz.py) ------------------------------------------------------------

def test_a_float64_numpy_leaf_with_a_random_draw_is_checked_as_the_user_runs_it():
    # Found by the fuzz: with x64 off, a float64 NumPy leaf is float32 in the program the user
    # runs, and a uniform draw from the key takes 32 bits there, 64 in the check's float64
    # trace (another value), so the check is rebuilt on the user's program. It was handed the
    # leaf in float64 and raised "lax.mul requires arguments to have the same dtypes".
    def loss(p, key):
        return jnp.sum(jnp.sin(p["w"]) * p["v"]) * jax.random.uniform(key, ())

    params = {"w": np.array([0.5, -1.0]), "v": jnp.array([2.0, 3.0])}
    report = fg.check_grads(loss, params, jax.random.key(0))
    assert report.ok and [r.path for r in report.rows] == ["p['v']", "p['w']"], str(report)
    assert any("differs" in n for n in report.notes), report.notes  # the rebuilt check, said


def test_audit_names_an_argument_that_is_not_an_array():
    # Found by the fuzz: audit asked jnp.result_type of an unregistered dataclass leaf
    # ("Cannot determine dtype of ...") before check_grads could name it.
    class Config:  # not a pytree: a leaf that is not an array
        scale = 2.0

    with pytest.raises(TypeError, match=r"audit: argument params\[1\] is a Config"):
        fg.audit(lambda params: jnp.sum(params[0] * params[1].scale), (jnp.ones(2), Config()))
