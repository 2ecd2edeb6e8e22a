"""The hand-written two-layer backward pass equals jax.grad (B §2.2-2.3; concept 11)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcgrad as fg
import funcgrad.check.manual

SHAPES = [(1, 1, 1, 1), (4, 3, 5, 2), (16, 64, 32, 10), (7, 2, 9, 3)]  # (batch, in, hidden, out)


def _problem(seed, batch, d_in, hidden, out, loss):
    # NumPy draws (no per-shape compilation); random non-zero biases put the point off the
    # ReLU kinks almost surely, so both methods differentiate a smooth function there.
    rng = np.random.default_rng(seed)
    sizes = (d_in, hidden, out)
    params = [{"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a)),
               "b": jnp.asarray(0.1 * rng.normal(size=b))} for a, b in zip(sizes[:-1], sizes[1:])]
    x = jnp.asarray(rng.normal(size=(batch, d_in)))
    if loss == "softmax_cross_entropy":
        targets = jnp.asarray(rng.integers(0, out, size=batch), jnp.int32)
    else:
        targets = jnp.asarray(rng.normal(size=(batch, out)))
    return params, x, targets


def _autodiff(params, x, targets, loss):
    def f(p):
        logits = fg.mlp_apply(p, x)
        if loss == "softmax_cross_entropy":
            return fg.softmax_cross_entropy(logits, targets)
        return fg.mean_squared_error(logits, targets)
    return jax.value_and_grad(f)(params)


# Jitted so that each shape compiles once instead of every eager op compiling on its own.
_manual = jax.jit(fg.two_layer_grads, static_argnames="loss")
_reference = jax.jit(_autodiff, static_argnames="loss")


def _assert_match(params, x, targets, loss):
    value, grads = _manual(params, x, targets, loss=loss)
    ref_value, ref_grads = _reference(params, x, targets, loss)
    # Two float64 methods over a few hundred flops agree to ~1e-15; 1e-10 is the bar.
    np.testing.assert_allclose(value, ref_value, rtol=0, atol=1e-10)
    leaves = [jax.tree_util.tree_flatten_with_path(t)[0] for t in (grads, ref_grads, params)]
    for (path, g), (_, r), (_, p) in zip(*leaves, strict=True):
        name = jax.tree_util.keystr(path)
        assert g.shape == p.shape, name
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-10, err_msg=name)

@pytest.mark.parametrize("loss", ["softmax_cross_entropy", "mean_squared_error"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_in{}_h{}_out{}".format(*s))
def test_manual_equals_jax_grad(shape, loss):
    with jax.enable_x64(True):
        _assert_match(*_problem(0, *shape, loss), loss)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 8), d_in=st.integers(1, 6), hidden=st.integers(1, 8),
       out=st.integers(1, 5), seed=st.integers(0, 2**16),
       loss=st.sampled_from(["softmax_cross_entropy", "mean_squared_error"]))
def test_manual_equals_jax_grad_any_shape(batch, d_in, hidden, out, seed, loss):
    with jax.enable_x64(True), jax.numpy_rank_promotion("raise"):
        _assert_match(*_problem(seed, batch, d_in, hidden, out, loss), loss)


def test_relu_kink_uses_jax_convention(strict_dtypes):
    # With W1 = 0 and b1 = 0 every pre-activation z is exactly 0. JAX takes relu'(0) = 0 and the
    # manual dz = dh * (z > 0) does too, so dW1 and db1 are exactly zero in both.
    with jax.enable_x64(True):
        params, x, y = _problem(1, 4, 3, 5, 2, "softmax_cross_entropy")
        params[0] = {"w": jnp.zeros_like(params[0]["w"]), "b": jnp.zeros_like(params[0]["b"])}
        _, grads = _manual(params, x, y, loss="softmax_cross_entropy")
        _, ref = _reference(params, x, y, "softmax_cross_entropy")
        for g in (grads, ref):
            assert not np.any(g[0]["w"]) and not np.any(g[0]["b"])


def test_dlogits_cross_entropy_by_hand(strict_dtypes):
    # logits (0, 0), label 0: softmax = (1/2, 1/2); loss = log 2; dlogits = (1/2 - 1, 1/2) / 1
    loss, d = funcgrad.check.manual.dlogits_softmax_cross_entropy(jnp.zeros((1, 2)), jnp.array([0]))
    np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(d, [[-0.5, 0.5]], rtol=1e-6)


def test_errors_name_the_problem():
    params = fg.mlp_init(jax.random.key(0), (3, 4, 2))
    with pytest.raises(ValueError, match="loss must be one of"):
        fg.two_layer_grads(params, jnp.ones((2, 3)), jnp.array([0, 1]), loss="hinge")
    with pytest.raises(ValueError, match=r"x must be \(batch, 3\)"):
        fg.two_layer_grads(params, jnp.ones((2, 5)), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="expected 2 layers"):
        fg.two_layer_grads(params[:1], jnp.ones((2, 3)), jnp.array([0, 1]))
