"""backward with a cotangent: vᵀJ by hand, the scalar case, errors before jax.vjp's (row 5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from funcgrad.debug.vjp import backward


def test_square_with_cotangent_by_hand(strict_dtypes):
    # y = x**2 elementwise: J = diag(2x), so vᵀJ = 2 x v = 2*(1, 2, 3)*(1, 0.5, -1) = (2, 2, -6).
    x = jnp.array([1.0, 2.0, 3.0])
    v = jnp.array([1.0, 0.5, -1.0])
    assert backward(lambda x: x ** 2, x, cotangent=v).tolist() == [2.0, 2.0, -6.0]


def test_scalar_output_equals_jax_grad(strict_dtypes):
    # f = sum(x sin x); df/dx = sin x + x cos x (by hand). backward's implied cotangent is 1.0,
    # which is what jax.grad pulls back too, so the two are the same computation: exact.
    f = lambda x: jnp.sum(x * jnp.sin(x))
    x = jnp.array([0.5, 1.0, 2.0])
    g = backward(f, x)
    assert np.array_equal(g, jax.grad(f)(x))
    np.testing.assert_allclose(g, np.sin(x) + x * np.cos(x), rtol=1e-6)  # float32 sin/cos


def test_scalar_cotangent_scales_the_gradient(strict_dtypes):
    # f = sum(x^2) with v = 2 (a Python number takes the output's dtype): 2 * 2x = (4, 8).
    assert backward(lambda x: jnp.sum(x ** 2), jnp.array([1.0, 2.0]), cotangent=2).tolist() == [
        4.0, 8.0]


def test_cotangent_equals_gradient_of_the_weighted_sum():
    # Second method: vᵀJ = grad of <v, f(x)> (linearity of the derivative). Different graphs,
    # float32 values ~1: agreement to a few ulps.
    f = lambda x: jnp.tanh(x) * jnp.exp(x[::-1])
    x = jax.random.normal(jax.random.key(0), (7,))
    v = jax.random.normal(jax.random.key(1), (7,))
    np.testing.assert_allclose(backward(f, x, cotangent=v),
                               jax.grad(lambda x: jnp.sum(v * f(x)))(x), rtol=1e-5, atol=1e-6)


def test_several_argnums(strict_dtypes):
    # y = x * w elementwise: d/dx = w, d/dw = x; with v: (w v, x v) = ((2, 4), (1, -2)) at
    # x = (1, 2), w = (2, 4), v = (1, -1).
    x, w, v = jnp.array([1.0, 2.0]), jnp.array([2.0, 4.0]), jnp.array([1.0, -1.0])
    gx, gw = backward(lambda x, w: x * w, x, w, cotangent=v, argnums=(0, 1))
    assert gx.tolist() == [2.0, -4.0] and gw.tolist() == [1.0, -2.0]
    assert backward(lambda x, w: x * w, x, w, cotangent=v, argnums=-1).tolist() == [1.0, -2.0]


def test_pytree_output_with_pytree_cotangent(strict_dtypes):
    # out = {"sq": x^2, "cube": x^3}; vᵀJ = 2x v_sq + 3x^2 v_cube. At x = (1, 2),
    # v_sq = (1, 1), v_cube = (1, -1): (2 + 3, 4 - 12) = (5, -8).
    f = lambda x: {"sq": x ** 2, "cube": x ** 3}
    x = jnp.array([1.0, 2.0])
    v = {"sq": jnp.array([1.0, 1.0]), "cube": jnp.array([1.0, -1.0])}
    assert backward(f, x, cotangent=v).tolist() == [5.0, -8.0]


def test_has_aux_and_jit(strict_dtypes):
    # y = x^3 with v = 1: 3x^2 = (3, 12); aux passes through. Under jit the checks run at
    # trace time on shapes and dtypes, so the same call compiles.
    f = lambda x: (x ** 3, {"mean": jnp.mean(x)})
    x = jnp.array([1.0, 2.0])
    g, aux = jax.jit(lambda x: backward(f, x, cotangent=jnp.ones_like(x), has_aux=True))(x)
    assert g.tolist() == [3.0, 12.0] and float(aux["mean"]) == 1.5


@pytest.mark.parametrize("fn, cotangent, error, match", [
    (lambda x: x ** 2, None, ValueError,
     r"output has shape \(3,\) and dtype float32, so it needs a cotangent of that shape and "
     r"dtype.*cotangent=jnp.ones_like\(out\).*out.sum\(\)"),
    (lambda x: x ** 2, jnp.ones(2), ValueError,
     r"output has shape \(3,\) and dtype float32, but its cotangent has shape \(2,\)"),
    (lambda x: x ** 2, jnp.ones(3, jnp.int32), ValueError,
     r"but its cotangent has shape \(3,\) and dtype int32"),
    (lambda x: x ** 2, jnp.ones(3, jnp.bfloat16), ValueError, r"dtype bfloat16.*astype"),
    (lambda x: (x, x.sum()), None, ValueError,
     r"structure PyTreeDef\(\(\*, \*\)\) with leaves float32\[3\], float32\[\].*"
     r"jax.tree.map\(jnp.ones_like, out\)"),
    (lambda x: (x, x.sum()), jnp.ones(3), ValueError,
     r"cotangent's pytree structure PyTreeDef\(\*\) does not match the output's"),
    (lambda x: {"a": x}, {"a": "one"}, TypeError, r"cotangent for output\['a'\] is a str"),
    (lambda x: jnp.argsort(x), jnp.ones(3), TypeError, r"output has dtype int32, which has no"),
    (lambda x: (), None, ValueError, r"fn returned \(\), which holds no array"),
    (lambda x: jnp.sum(x) * (1 + 1j), None, TypeError,
     r"output is a complex scalar.*pass cotangent="),
], ids=["missing", "wrong_shape", "wrong_dtype", "bfloat16", "pytree_missing",
        "wrong_structure", "not_an_array", "integer_output", "empty_output", "complex_scalar"])
def test_errors_name_the_output_and_the_fix(fn, cotangent, error, match):
    with pytest.raises(error, match=f"(?s)^backward: .*{match}"):
        backward(fn, jnp.array([1.0, 2.0, 3.0]), cotangent=cotangent)


def test_jax_alone_gives_a_different_error():
    # What our check replaces: jax.vjp's own complaint about a mis-shaped cotangent.
    _, pullback = jax.vjp(lambda x: x ** 2, jnp.ones(3))
    with pytest.raises((ValueError, TypeError)) as info:
        pullback(jnp.ones(2))
    assert "backward:" not in str(info.value)


@pytest.mark.parametrize("argnums", [2, (0, 5), ()], ids=["int", "tuple", "empty"])
def test_argnums_out_of_range(argnums):
    with pytest.raises(ValueError, match=r"argnums=.* must name positions of the 2 argument"):
        backward(lambda x, w: jnp.sum(x * w), jnp.ones(2), jnp.ones(2), argnums=argnums)


def test_an_integer_or_bool_argnum_is_refused():
    # jax.vjp would return a float0 "gradient" for the int argument; funcgrad says why not.
    with pytest.raises(TypeError, match=r"argument 1 \(argnums\) has dtype int32, which has no"):
        backward(lambda x, n: jnp.sum(x) * n, jnp.ones(2), 3, argnums=1)
    with pytest.raises(ValueError, match=r"argnums=True must name positions"):
        backward(lambda x: jnp.sum(x), jnp.ones(2), argnums=True)


def test_an_argument_named_twice_in_argnums_is_refused():
    # Both slots would be the gradient of the same argument, and one would overwrite the other.
    with pytest.raises(ValueError, match=r"argnums=\(0, 0\) names an argument twice"):
        backward(lambda x, y: jnp.sum(x * y), jnp.ones(2), 2 * jnp.ones(2), argnums=(0, 0))


def test_an_argument_that_is_not_an_array_is_named():
    # Found by the fuzz: an unregistered dataclass leaf reached jnp.result_type ("Cannot
    # determine dtype of ...") inside backward instead of an error naming it.
    class Config:  # not a pytree: a leaf that is not an array
        scale = 2.0

    with pytest.raises(TypeError, match=r"backward: argument p\['c'\] is a Config"):
        backward(lambda p: jnp.sum(p["x"] * p["c"].scale), {"x": jnp.ones(2), "c": Config()})
