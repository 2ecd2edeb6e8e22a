"""custom_vjp with a checked bwd: hand-derived rules, jit and vmap, every error message (row 14)."""
import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from funcgrad.check.custom import DroppedCotangentWarning, custom_vjp
from funcgrad.check.grads import check_grads


def make_scale(bwd):
    """scale(x, w) = x * w for x: float32[3], w: float32[], with the given bwd rule."""
    @custom_vjp
    def scale(x, w):
        return x * w

    scale.defvjp(lambda x, w: (x * w, (x, w)), bwd)
    return scale


def scale_bwd(res, g):
    # y_i = x_i w: dL/dx_i = g_i w; w was broadcast over i, so dL/dw = sum_i g_i x_i.
    x, w = res
    return g * w, jnp.sum(g * x)


def grad_scale(scale, x=None, w=2.0):
    x = jnp.array([1.0, 2.0, 3.0]) if x is None else x
    return jax.grad(lambda x, w: jnp.sum(scale(x, w)), argnums=(0, 1))(x, jnp.float32(w))


@functools.partial(custom_vjp, nondiff_argnums=(1,))
def clipped_identity(x, c):
    return x


clipped_identity.defvjp(lambda x, c: (x, None), lambda c, _, g: (jnp.clip(g, -c, c),))


# --- correct rules: values, jit, vmap, checker --------------------------------------------------

def test_scale_by_hand_under_jit(strict_dtypes):
    # x = (1, 2, 3), w = 2, L = sum(x w): dL/dx = (w, w, w) = (2, 2, 2); dL/dw = sum x = 6.
    gx, gw = jax.jit(lambda x, w: grad_scale(make_scale(scale_bwd), x, w))(
        jnp.array([1.0, 2.0, 3.0]), jnp.float32(2.0))
    assert gx.tolist() == [2.0, 2.0, 2.0] and float(gw) == 6.0


def test_clipped_identity_by_hand(strict_dtypes):
    # L = sum(v * y), y = x: dL/dy = v, clipped to [-1, 1]: (0.5, 1, -1) for v = (0.5, 3, -2).
    v = jnp.array([0.5, 3.0, -2.0])
    g = jax.jit(jax.grad(lambda x: jnp.sum(v * clipped_identity(x, 1.0))))(jnp.zeros(3))
    assert g.tolist() == [0.5, 1.0, -1.0]


def test_per_example_grads_under_vmap(strict_dtypes):
    # vmap over a batch of x (4, 3), shared w = 2: per example dL/dx = (2, 2, 2) and
    # dL/dw = sum of that row of x. The bwd (and the check) sees per-example shapes: (3,), ().
    xs = jnp.arange(12.0).reshape(4, 3)
    gx, gw = jax.jit(jax.vmap(lambda x: grad_scale(make_scale(scale_bwd), x, 2.0)))(xs)
    assert gx.tolist() == [[2.0] * 3] * 4
    assert gw.tolist() == xs.sum(axis=1).tolist()  # 3, 12, 21, 30: exact in float32


def test_vmap_of_a_wrong_rule_still_caught():
    # Under vmap the per-example w is float32[] while g * x is float32[3].
    bad = make_scale(lambda res, g: (g * res[1], g * res[0]))
    with pytest.raises(ValueError, match=r"w: expected float32\[\] .*got float32\[3\]"):
        jax.vmap(lambda x: grad_scale(bad, x))(jnp.ones((4, 3)))


def test_check_grads_agrees_with_a_pytree_rule():
    # A dense layer with params {"w", "b"} and a hand-written bwd (y = x w + b):
    # dL/dw = xᵀ g, dL/db = sum over the batch of g, dL/dx = g wᵀ. Verified by finite
    # differences in float64 (check_grads' own tolerances; reverse mode, custom_vjp has no jvp).
    @custom_vjp
    def dense(params, x):
        return x @ params["w"] + params["b"][None, :]

    def dense_bwd(res, g):
        params, x = res
        return {"w": x.T @ g, "b": g.sum(axis=0)}, g @ params["w"].T

    dense.defvjp(lambda params, x: (dense(params, x), (params, x)), dense_bwd)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}
    x = jax.random.normal(k3, (4, 3))
    report = check_grads(lambda p, x: jnp.sum(jnp.tanh(dense(p, x))), params, x, argnums=(0, 1))
    assert report.ok, str(report)
    assert [r.path for r in report.rows] == ["p['b']", "p['w']", "x"]


def test_the_check_adds_nothing_to_the_program():
    # Same rule through jax.custom_vjp and funcgrad's: identical jaxpr and StableHLO.
    def program(deco):
        @deco
        def scale(x, w):
            return x * w
        scale.defvjp(lambda x, w: (x * w, (x, w)), scale_bwd)
        return jax.grad(lambda x, w: jnp.sum(scale(x, w)), argnums=(0, 1))

    args = (jnp.ones(3), jnp.float32(2.0))
    ours, theirs = program(custom_vjp), program(jax.custom_vjp)
    assert str(jax.make_jaxpr(ours)(*args)) == str(jax.make_jaxpr(theirs)(*args))
    assert jax.jit(ours).lower(*args).as_text() == jax.jit(theirs).lower(*args).as_text()


def test_bwd_is_checked_once_per_trace():
    # Under jit the backward is traced (and checked) once; later calls run the compiled code.
    calls = []
    scale = make_scale(lambda res, g: calls.append(1) or scale_bwd(res, g))
    f = jax.jit(lambda x, w: grad_scale(scale, x, w))
    for _ in range(3):
        f(jnp.ones(3), jnp.float32(2.0))
    assert len(calls) == 1


def test_none_for_a_whole_input_or_a_subtree(strict_dtypes):
    # p = {"a": x, "b": {"c": y}}, out = a + c * n. bwd gives a its cotangent and None for the
    # subtree b (zero), and None for the integer n: dL/da = 1, dL/dc = 0.
    @custom_vjp
    def f(p, n):
        return p["a"] + p["b"]["c"] * n.astype(jnp.float32)

    f.defvjp(lambda p, n: (f(p, n), None), lambda _, g: ({"a": g, "b": None}, None),
             zero_cotangents=("p['b']",))  # out depends on c: the drop is declared
    g = jax.grad(f)({"a": jnp.float32(1.0), "b": {"c": jnp.float32(2.0)}}, jnp.int32(3))
    assert float(g["a"]) == 1.0 and float(g["b"]["c"]) == 0.0


def test_float0_for_an_integer_input_is_accepted(strict_dtypes):
    # y = x * n with integer n: dL/dx = n = 3; n's cotangent is a float0 zero of its shape.
    @custom_vjp
    def f(x, n):
        return x * n.astype(jnp.float32)

    f.defvjp(lambda x, n: (f(x, n), n),
             lambda n, g: (g * n.astype(jnp.float32), np.zeros(n.shape, jax.dtypes.float0)))
    assert float(jax.jit(jax.grad(f))(jnp.float32(2.0), jnp.int32(3))) == 3.0


def test_list_and_python_scalars_are_accepted():
    # JAX takes a list of the right length, and a Python float counts as float32[] (weak):
    # L = 3 * y with the rule dy/dx := 1 (a constant cotangent) gives 1, not 3.
    @custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: [1.0])
    assert float(jax.grad(lambda x: 3.0 * f(x))(2.0)) == 1.0


def test_keyword_arguments_are_resolved(strict_dtypes):
    # Called as scale(x, w=...): the same as positional, w still named "w" in the check.
    scale = make_scale(scale_bwd)
    gx, gw = jax.grad(lambda x, w: jnp.sum(scale(x, w=w)), argnums=(0, 1))(
        jnp.array([1.0, 2.0, 3.0]), jnp.float32(2.0))
    assert gx.tolist() == [2.0, 2.0, 2.0] and float(gw) == 6.0
    bad = make_scale(lambda res, g: (g * res[1], g * res[0]))
    with pytest.raises(ValueError, match=r"  w: expected"):
        jax.grad(lambda x, w: jnp.sum(bad(x, w=w)), argnums=1)(jnp.ones(3), jnp.float32(2.0))


# --- wrong rules: each error, named, raised before JAX's ----------------------------------------

def test_not_a_tuple():
    @custom_vjp
    def f(x):
        return 2.0 * x

    f.defvjp(lambda x: (f(x), None), lambda _, g: 2.0 * g)  # PyTorch habit: a bare tensor
    with pytest.raises(TypeError, match=r"returned float32\[3\], not a tuple\. It must return a "
                       r"tuple of 1 cotangent\(s\).*\(x: float32\[3\]\)\. For one input write "
                       r"`return \(ct,\)`"):
        jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))


def test_wrong_count():
    bad = make_scale(lambda res, g: (g * res[1],))
    with pytest.raises(TypeError, match=r"^custom_vjp: the bwd rule <lambda> of scale returned 1 "
                       r"cotangent\(s\), but scale has 2 differentiable input\(s\) "
                       r"\(x: float32\[3\], w: float32\[\]\)"):
        grad_scale(bad)


def test_wrong_count_with_nondiff_argnums_says_to_leave_them_out():
    # PyTorch's backward returns a gradient (or None) for every forward input; with
    # nondiff_argnums, JAX's bwd returns one only for the differentiable ones.
    @functools.partial(custom_vjp, nondiff_argnums=(1,))
    def f(x, c):
        return x

    f.defvjp(lambda x, c: (x, None), lambda c, _, g: (g, None))
    with pytest.raises(TypeError, match=r"returned 2 cotangent\(s\), but f has 1 differentiable "
                       r"input\(s\) \(x: float32\[\]\).*argument\(s\) c get no cotangent"):
        jax.grad(lambda x: f(x, 1.0))(jnp.float32(1.0))


def test_wrong_shape_names_the_input_and_both_shapes():
    # The broadcast bug: w is a scalar, so its cotangent must be summed over x's axis.
    bad = make_scale(lambda res, g: (g * res[1], g * res[0]))
    with pytest.raises(ValueError, match=r"returned a wrong cotangent for 1 input leaf\(s\):\n"
                       r"  w: expected float32\[\] \(the primal's shape and dtype\), "
                       r"got float32\[3\]"):
        jax.jit(lambda x, w: grad_scale(bad, x, w))(jnp.ones(3), jnp.float32(2.0))


@pytest.mark.float16
def test_wrong_dtype_that_jax_would_accept():
    # jax.custom_vjp lets a float16 cotangent through for a float32 input; we do not.
    bad = make_scale(lambda res, g: (g * res[1], jnp.sum(g * res[0]).astype(jnp.float16)))
    with pytest.raises(ValueError, match=r"w: expected float32\[\] .*got float16\[\]"):
        grad_scale(bad)


def test_a_numpy_float64_cotangent_is_named():
    # jax.typeof reports a NumPy float64 array as float32 (x64 off), and eager jax.grad would
    # hand the float64 array back as the gradient: the check reads the array's own dtype.
    bad = make_scale(lambda res, g: (g * res[1], np.float64(np.sum(np.asarray(g * res[0])))))
    with pytest.raises(ValueError, match=r"w: expected float32\[\] .*got a NumPy float64 array"):
        grad_scale(bad)


def test_float_cotangent_for_an_integer_input():
    @custom_vjp
    def f(x, n):
        return x * n.astype(jnp.float32)

    f.defvjp(lambda x, n: (f(x, n), n), lambda n, g: (g * n.astype(jnp.float32), jnp.ones(2)))
    with pytest.raises(TypeError, match=r"n: the primal is int32\[\], which has no gradient; "
                       r"return None for it .*got float32\[2\]"):
        jax.grad(f)(jnp.float32(2.0), jnp.int32(3))


def test_a_prng_key_input_takes_none():
    # y = x + noise(key): dL/dx = 1; a key, like an integer, has no gradient.
    @custom_vjp
    def noisy(x, key):
        return x + jax.random.normal(key, x.shape)

    noisy.defvjp(lambda x, key: (noisy(x, key), None), lambda _, g: (g, None))
    loss = lambda x: jnp.sum(noisy(x, jax.random.key(0)))
    assert jax.grad(loss)(jnp.ones(2)).tolist() == [1.0, 1.0]
    noisy.defvjp(lambda x, key: (noisy(x, key), None), lambda _, g: (g, g))
    with pytest.raises(TypeError, match=r"key: the primal is key<fry>\[\], which has no gradient"):
        jax.grad(loss)(jnp.ones(2))


def test_every_wrong_leaf_is_listed():
    bad = make_scale(lambda res, g: (g[:2], jnp.ones((1,))))
    with pytest.raises(ValueError, match=r"for 2 input leaf\(s\):\n  x: expected float32\[3\] "
                       r".*got float32\[2\]\n  w: expected float32\[\] .*got float32\[1\]"):
        grad_scale(bad)


def test_a_non_array_leaf():
    bad = make_scale(lambda res, g: (g * res[1], "zero"))
    with pytest.raises(TypeError, match=r"w: expected an array float32\[\], got a str"):
        grad_scale(bad)


PARAMS = {"w": jnp.ones((2, 2)), "b": {"c": jnp.ones(2), "d": jnp.ones(())}}
STRUCTURE_CASES = {
    "missing_key": ({"w": jnp.ones((2, 2)), "b": {"c": jnp.ones(2)}},
                    r"; missing: p\['b'\]\['d'\]"),
    "extra_key": ({"w": jnp.ones((2, 2)), "b": {"c": jnp.ones(2), "d": jnp.ones(()),
                                               "e": jnp.ones(())}},
                  r"; not in the input: p\['b'\]\['e'\]"),
    "leaf_for_subtree": ({"w": jnp.ones((2, 2)), "b": jnp.ones(2)},
                         r"; one array at p\['b'\], where the input has PyTreeDef\(\{'c': \*, "
                         r"'d': \*\}\)"),
    "list_for_dict": ([jnp.ones((2, 2)), jnp.ones(2), jnp.ones(())],
                      r"; missing: p\['b'\]\['c'\], p\['b'\]\['d'\], p\['w'\]; not in the input: "
                      r"p\[0\], p\[1\], p\[2\]"),
}


@pytest.mark.parametrize("case", list(STRUCTURE_CASES), ids=list(STRUCTURE_CASES))
def test_wrong_pytree_structure(case):
    ct, detail = STRUCTURE_CASES[case]

    @custom_vjp
    def f(p):
        return jnp.sum(p["w"]) + jnp.sum(p["b"]["c"]) + p["b"]["d"]

    f.defvjp(lambda p: (f(p), None), lambda _, g: (ct,))
    with pytest.raises(TypeError, match=r"returned a cotangent for p with the wrong pytree "
                       r"structure" + detail + r"\.\n  expected: PyTreeDef\(\{'b': \{'c': \*, "
                       r"'d': \*\}, 'w': \*\}\) \(leaves: \['b'\]\['c'\]: float32\[2\], "):
        jax.grad(f)(PARAMS)


def test_tuple_for_list_is_a_structure_error():
    # Same paths ([0], [1]), different container: only the two structures tell them apart.
    @custom_vjp
    def f(xs):
        return xs[0] * xs[1]

    f.defvjp(lambda xs: (f(xs), xs), lambda xs, g: ((g * xs[1], g * xs[0]),))
    with pytest.raises(TypeError, match=r"wrong pytree structure\.\n  expected: PyTreeDef\(\[\*, "
                       r"\*\]\).*\n  received: PyTreeDef\(\(\*, \*\)\)"):
        jax.grad(f)([jnp.float32(2.0), jnp.float32(3.0)])


# --- misuse of the wrapper itself ----------------------------------------------------------------

def test_call_before_defvjp():
    @custom_vjp
    def f(x):
        return x

    with pytest.raises(TypeError, match=r"f has no rule yet; call f\.defvjp\(fwd, bwd\)"):
        f(jnp.ones(2))


def test_nondiff_argnums_out_of_range():
    @functools.partial(custom_vjp, nondiff_argnums=(2,))
    def f(x, c=1.0, *rest):
        return x

    f.defvjp(lambda x, c, *rest: (x, None), lambda *a: (a[-1],))
    with pytest.raises(ValueError, match=r"nondiff_argnums=\(2,\) names position\(s\) \[2\], but "
                       r"f was called with 2 positional argument\(s\)"):
        f(jnp.ones(2))


def test_decorator_with_arguments_and_bad_nondiff_argnums():
    @custom_vjp(nondiff_argnums=(1,))
    def f(x, c):
        return x * c

    f.defvjp(lambda x, c: (x * c, None), lambda c, _, g: (g * c,))
    assert float(jax.grad(f)(jnp.float32(1.0), 3.0)) == 3.0  # d(x c)/dx = c
    with pytest.raises(TypeError, match=r"nondiff_argnums must be a tuple of non-negative ints"):
        custom_vjp(lambda x, c: x, nondiff_argnums=1)


def test_unsupported_defvjp_options_are_named():
    @custom_vjp
    def f(x):
        return x
    with pytest.raises(TypeError, match=r"does not support symbolic_zeros.*jax.custom_vjp"):
        f.defvjp(lambda x: (x, None), lambda _, g: (g,), symbolic_zeros=True)


# --- dropped cotangents (issue 11, point 2) -----------------------------------------------------

def _scale(**defvjp_kwargs):
    """out = x * w; the rule returns x's cotangent g * w and None for w, which out depends on
    (d out / d w = x != 0), so every gradient reaching w is dropped."""
    @custom_vjp
    def scale(x, w):
        return x * w

    def scale_bwd(res, g):
        x, w = res
        return g * w, None

    scale.defvjp(lambda x, w: (x * w, (x, w)), scale_bwd, **defvjp_kwargs)
    return scale


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_none_for_a_used_input_warns_naming_the_function_and_the_input(jit):
    scale = _scale()
    grad = jax.grad(lambda w, x: jnp.sum(scale(x, w)))
    grad = jax.jit(grad) if jit else grad
    with pytest.warns(DroppedCotangentWarning,
                      match=r"scale_bwd of scale returned None .* for w \(float32\[\]\), but "
                            r"scale's output depends on it.*zero_cotangents=\('w',\)"):
        g = grad(jnp.float32(2.0), jnp.ones(3))
    assert float(g) == 0.0  # the true gradient is sum(x) = 3: the rule dropped it


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_the_dropped_cotangent_warning_points_at_the_users_defvjp_line(jit):
    # Reported at funcgrad/check/custom.py before: the backward pass runs inside JAX, where the
    # user's only frame is the gradient call. It now points at the defvjp line, where the rule
    # is attached and where zero_cotangents= would go.
    @custom_vjp
    def double(x, w):
        return x * w

    defvjp_line = inspect.currentframe().f_lineno + 1
    double.defvjp(lambda x, w: (x * w, (x, w)), lambda res, g: (g * res[1], None))
    grad = jax.grad(lambda w, x: jnp.sum(double(x, w)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (jax.jit(grad) if jit else grad)(jnp.float32(2.0), jnp.ones(3))
    assert [w.category for w in caught] == [DroppedCotangentWarning], [str(w.message)
                                                             for w in caught]
    assert (caught[0].filename, caught[0].lineno) == (__file__, defvjp_line)


def test_declared_zero_cotangent_does_not_warn():
    scale = _scale(zero_cotangents=("w",))
    # No warning (pytest turns warnings into errors); the rule's zero is kept.
    assert float(jax.grad(lambda w, x: jnp.sum(scale(x, w)))(jnp.float32(2.0), jnp.ones(3))) == 0.0


def test_none_for_an_input_with_no_differentiable_path_does_not_warn():
    # out = x * stop_gradient(w): w has no differentiable path, so None for it is right.
    @custom_vjp
    def f(x, w):
        return x * jax.lax.stop_gradient(w)

    f.defvjp(lambda x, w: (f(x, w), w), lambda w, g: (g * w, None))
    assert float(jax.grad(lambda x: f(x, jnp.float32(3.0)))(jnp.float32(1.0))) == 3.0


def test_zero_cotangents_naming_no_input_is_refused():
    scale = _scale(zero_cotangents=("v",))
    with pytest.raises(ValueError, match=r"zero_cotangents=\('v',\) of scale names \['v'\].*"
                                         r"expected input names \(x, w\)"):
        scale(jnp.ones(3), jnp.float32(2.0))
