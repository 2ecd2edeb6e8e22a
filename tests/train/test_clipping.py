"""Tests for funcgrad.train.clipping."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from funcgrad.train.clipping import clip_grads, global_norm


def test_global_norm_three_four_five():
    # Hand: the elements 3 and 4 in two leaves of different shapes; sqrt(9 + 16) = 5.
    tree = {"a": jnp.array([3.0]), "b": [jnp.array([[0.0, 4.0]])]}
    chex.assert_trees_all_close(global_norm(tree), jnp.float32(5.0))


def test_global_norm_matches_optax_on_random_trees():
    # Second method: optax.tree.norm sums each leaf separately; only rounding may differ.
    keys = jax.random.split(jax.random.key(0), 4)
    tree = {"w": jax.random.normal(keys[0], (64, 128)), "b": jax.random.normal(keys[1], (128,)),
            "nested": [jax.random.normal(keys[2], (3, 4, 5)), jax.random.normal(keys[3], ())]}
    np.testing.assert_allclose(global_norm(tree), optax.tree.norm(tree), rtol=1e-6)


def test_global_norm_large_leaves_are_reduced_without_a_copy():
    # Leaves past the concatenation limit (2**15 elements) are reduced one by one: the jaxpr
    # holds no concatenate as large as the tree (a 1.1M-element concatenate took 26 ms on CPU
    # against 0.2 ms for per-leaf sums). Second method for the value: optax.tree.norm.
    from funcgrad.train.clipping import _CONCAT_LIMIT
    keys = jax.random.split(jax.random.key(1), 4)
    tree = {"big": jax.random.normal(keys[0], (300, 400)),
            "mid": jax.random.normal(keys[1], (90, 300)),
            "small": [jax.random.normal(keys[2], (128,)), jax.random.normal(keys[3], (10, 3))]}
    np.testing.assert_allclose(global_norm(tree), optax.tree.norm(tree), rtol=1e-6)
    jaxpr = jax.make_jaxpr(global_norm)(tree)
    concatenated = [e.outvars[0].aval.size for e in jaxpr.eqns if e.primitive.name == "concatenate"]
    assert concatenated and max(concatenated) <= _CONCAT_LIMIT, concatenated
    # Hand: a NaN in the largest leaf still makes the norm NaN.
    assert np.isnan(global_norm({**tree, "big": tree["big"].at[7, 7].set(jnp.nan)}))


def test_global_norm_mixed_dtypes_and_half_precision_in_float32():
    # Hand: 300 bfloat16 ones and one float32 element 10 -> sqrt(300 + 100) = 20. Summed in
    # bfloat16 (8 significant bits) 300 ones would stall at 256; the float32 sum is exact.
    tree = {"h": jnp.ones((300,), jnp.bfloat16), "f": jnp.array([10.0], jnp.float32)}
    out = global_norm(tree)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, 20.0, rtol=0)


def test_global_norm_complex_and_empty():
    # Hand: |3+4i| = 5. An empty tree has norm 0.
    np.testing.assert_allclose(global_norm([jnp.array([3 + 4j], jnp.complex64)]), 5.0, rtol=1e-6)
    assert float(global_norm({})) == 0.0


def test_global_norm_propagates_nan_and_overflow():
    # 2e19**2 = 4e38 > float32 max (3.4e38): the sum of squares overflows to inf, as optax's does.
    assert np.isinf(global_norm([jnp.array([2e19], jnp.float32)]))
    assert np.isnan(global_norm({"a": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)}))


def test_global_norm_under_jit_equals_eager():
    tree = [jnp.arange(5.0), jnp.full((2, 2), 0.5)]
    # Hand: 0+1+4+9+16 = 30, plus 4 * 0.25 = 1 -> sqrt(31).
    np.testing.assert_allclose(jax.jit(global_norm)(tree), np.sqrt(31.0), rtol=1e-6)


def test_global_norm_rejects_integer_leaves():
    with pytest.raises(TypeError, match="floating-point leaves, got a leaf of dtype int32"):
        global_norm({"steps": jnp.array([1, 2], jnp.int32)})


def test_clip_three_four_five_by_hand():
    # g = (3, 4), ||g|| = 5 > max_norm 1: g' = g / 5 = (0.6, 0.8), coefficient 0.2, ||g'|| = 1,
    # and g' is parallel to g (cosine 1).
    grads = {"a": jnp.array([3.0]), "b": jnp.array([4.0])}
    clipped, info = clip_grads(grads, 1.0)
    np.testing.assert_allclose(jnp.concatenate([clipped["a"], clipped["b"]]), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(info.grad_norm, 5.0, rtol=1e-6)
    np.testing.assert_allclose(info.clip_coef, 0.2, rtol=1e-6)
    np.testing.assert_allclose(global_norm(clipped), 1.0, rtol=1e-6)
    v, w = np.array([3.0, 4.0]), np.array([clipped["a"][0], clipped["b"][0]])
    np.testing.assert_allclose(v @ w / (np.linalg.norm(v) * np.linalg.norm(w)), 1.0, rtol=1e-6)
    # Under the bound (5 <= 10) nothing changes and the coefficient is 1.
    same, info = clip_grads(grads, 10.0)
    chex.assert_trees_all_equal(same, grads)
    assert float(info.clip_coef) == 1.0


def test_clip_equals_optax_on_random_trees():
    # Second method: optax.clip_by_global_norm alone gives the same tree.
    keys = jax.random.split(jax.random.key(1), 2)
    grads = [jax.random.normal(keys[0], (20, 30)) * 3, jax.random.normal(keys[1], (30,))]
    ours, info = clip_grads(grads, 2.0)
    ref, _ = optax.clip_by_global_norm(2.0).update(grads, optax.EmptyState())
    chex.assert_trees_all_close(ours, ref, rtol=1e-6)
    np.testing.assert_allclose(info.clip_coef, 2.0 / optax.tree.norm(grads), rtol=1e-6)


def test_a_given_norm_is_not_taken_again():
    # With grad_norm given, clipping is one coefficient times every leaf: the jaxpr of the
    # clipped tree holds no reduction over the gradients (optax's transformation takes the norm
    # again), and the result matches optax's. Hand: norm 5 -> coefficient 1/5.
    grads = {"a": jnp.array([3.0]), "b": jnp.array([[0.0, 4.0]])}
    jaxpr = jax.make_jaxpr(lambda g, n: clip_grads(g, 1.0, grad_norm=n)[0])(
        grads, jnp.float32(5.0))
    names = {e.primitive.name for e in jaxpr.eqns}
    assert not names & {"reduce_sum", "dot_general", "sqrt"}, names
    clipped, info = clip_grads(grads, 1.0, grad_norm=jnp.float32(5.0))
    chex.assert_trees_all_close(clipped, {"a": jnp.array([0.6]), "b": jnp.array([[0.0, 0.8]])})
    ref, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    chex.assert_trees_all_close(clipped, ref, rtol=1e-6)


def test_one_nan_leaf_poisons_optax_but_not_zero_nonfinite():
    # optax divides every leaf by the nan norm: all NaN. Zeroing the bad leaf first keeps the
    # other: a = 3, remaining norm 3 > 1 -> a' = 1, coefficient 1/3; b' = 0; one leaf zeroed.
    grads = {"a": jnp.array([3.0]), "b": jnp.array([jnp.nan, 1.0])}
    poisoned, info = clip_grads(grads, 1.0)
    assert bool(jnp.all(jnp.isnan(poisoned["a"]))) and int(info.nonfinite_leaves) == 1
    kept, info = clip_grads(grads, 1.0, zero_nonfinite=True)
    np.testing.assert_allclose(kept["a"], [1.0], rtol=1e-6)
    np.testing.assert_array_equal(kept["b"], [0.0, 0.0])
    np.testing.assert_allclose(info.clip_coef, 1 / 3, rtol=1e-6)
    assert np.isnan(info.grad_norm) and int(info.nonfinite_leaves) == 1


def test_clip_rejects_bad_max_norm():
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0, got -1"):
        clip_grads({"a": jnp.ones(2)}, -1)
