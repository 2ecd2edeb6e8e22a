"""Tests for funcgrad.debug.taps: intermediate gradients (retain_grad) and the identity tap."""
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg
from funcgrad.debug.taps import intermediate_grads, tap

W = jnp.array([[0.1, -0.2], [0.3, 0.05], [-0.4, 0.2]])
X = jnp.arange(6.0).reshape(2, 3) / 6.0


def sq_tanh(w, x):
    h = tap("h", jnp.tanh(tap("z", x @ w)))
    return jnp.sum(h ** 2)


def test_tap_gradients_by_hand():
    # loss = sum(h^2), h = tanh(z), z = x @ w:
    #   dloss/dh = 2h;  dloss/dz = 2h * (1 - h^2).
    value, grads, taps = intermediate_grads(sq_tanh)(W, X)
    h = np.tanh(np.asarray(X) @ np.asarray(W))
    np.testing.assert_allclose(value, np.sum(h ** 2), rtol=1e-6)
    np.testing.assert_allclose(taps["h"], 2 * h, rtol=1e-6)
    np.testing.assert_allclose(taps["z"], 2 * h * (1 - h ** 2), rtol=1e-5)
    chex.assert_trees_all_close(grads, jax.grad(sq_tanh)(W, X))


def test_tap_gradient_equals_splitting_the_mlp_at_the_tap(key):
    # Second method: split the loss at the hidden layer by hand, upper(h) = loss of the last
    # layer on h, and differentiate that half with jax.grad.
    params = fg.mlp_init(key, (64, 16, 10))
    data = fg.load_digits(seed=0)
    x, y = data.x_train[:8], data.y_train[:8]

    def loss(params, x, y):
        h = tap("hidden", jax.nn.relu(x @ params[0]["w"] + params[0]["b"][None, :]))
        return fg.softmax_cross_entropy(h @ params[1]["w"] + params[1]["b"][None, :], y)

    h = jax.nn.relu(x @ params[0]["w"] + params[0]["b"][None, :])
    upper = lambda h: fg.softmax_cross_entropy(h @ params[1]["w"] + params[1]["b"][None, :], y)
    value, grads, taps = intermediate_grads(loss)(params, x, y)
    chex.assert_trees_all_close(taps["hidden"], jax.grad(upper)(h), rtol=1e-6)
    chex.assert_trees_all_close(grads, jax.grad(loss)(params, x, y), rtol=1e-6)
    np.testing.assert_allclose(value, upper(h), rtol=1e-6)


def test_under_jit_both_ways():
    h = np.tanh(np.asarray(X) @ np.asarray(W))
    _, _, taps = jax.jit(intermediate_grads(sq_tanh))(W, X)  # the transformation jitted
    np.testing.assert_allclose(taps["h"], 2 * h, rtol=1e-6)
    inner = jax.jit(sq_tanh)                                   # the taps inside a jitted call
    _, _, taps = intermediate_grads(lambda w, x: inner(w, x))(W, X)
    np.testing.assert_allclose(taps["h"], 2 * h, rtol=1e-6)


def test_under_vmap_the_tap_gradient_is_per_example():
    # The per-example loss sum(h_i^2) summed over the batch: dloss/dh_i = 2 h_i, one row each.
    def loss(w, x):
        return jax.vmap(lambda xi: jnp.sum(tap("h", jnp.tanh(xi @ w)) ** 2))(x).sum()

    _, _, taps = intermediate_grads(loss)(W, X)
    h = np.tanh(np.asarray(X) @ np.asarray(W))
    assert taps["h"].shape == (2, 2)
    np.testing.assert_allclose(taps["h"], 2 * h, rtol=1e-6)
    # vmap of the transformation: one tap gradient per mapped input, same values.
    _, _, taps = jax.vmap(intermediate_grads(sq_tanh), in_axes=(None, 0))(W, X[:, None, :])
    np.testing.assert_allclose(taps["h"][:, 0, :], 2 * h, rtol=1e-6)


def test_inside_scan_one_gradient_per_iteration():
    # carry c_t = c_{t-1} * 0.5 + sum(h_t^2), h_t = tanh(x_t @ w); loss = c_T with T = 2.
    # dloss/dh_t = 2 h_t * 0.5^(T - 1 - t): 0.5 for t = 0, 1 for t = 1.
    def loss(w, x):
        def body(c, xt):
            return c * 0.5 + jnp.sum(tap("h", jnp.tanh(xt @ w)) ** 2), None
        return jax.lax.scan(body, 0.0, x)[0]

    _, grads, taps = intermediate_grads(loss)(W, X)
    h = np.tanh(np.asarray(X) @ np.asarray(W))
    assert taps["h"].shape == (2, 2)
    np.testing.assert_allclose(taps["h"], 2 * h * np.array([[0.5], [1.0]]), rtol=1e-6)
    chex.assert_trees_all_close(grads, jax.grad(loss)(W, X), rtol=1e-6)


def test_inside_cond_the_untaken_branch_gets_zero():
    # Taken branch: loss = 3 * sum(z) -> dloss/dz = 3 everywhere; not taken: the tap never ran.
    def loss(w, x, flag):
        return jax.lax.cond(flag, lambda: 3.0 * jnp.sum(tap("z", x @ w)), lambda: jnp.sum(x @ w))

    np.testing.assert_array_equal(intermediate_grads(loss)(W, X, True)[2]["z"],
                                  np.full((2, 2), 3.0))
    np.testing.assert_array_equal(intermediate_grads(loss)(W, X, False)[2]["z"], np.zeros((2, 2)))


def test_one_name_in_two_cond_branches_is_the_branch_taken():
    # h = p x (branch 0, x[0] > 0) or 2 p x (branch 1); loss = scale * sum(h^2), scale a
    # keyword argument: dloss/dh = 2 scale h. Hand: p = 1.5, x = [1, 2], scale 3: h = [1.5, 3],
    # dh = [9, 18], dp = sum(dh * x) = 45. x = [-1, 2], scale 1: h = [-3, 6], dh = [-6, 12],
    # dp = sum(dh * 2x) = 60.
    def loss(p, x, scale=1.0):
        h = jax.lax.cond(x[0] > 0, lambda: tap("h", p * x), lambda: tap("h", p * x * 2.0))
        return jnp.sum(h ** 2) * scale

    value, dp, taps = intermediate_grads(loss)(jnp.float32(1.5), jnp.array([1.0, 2.0]), scale=3.0)
    np.testing.assert_allclose([value, dp], [33.75, 45.0], rtol=1e-6)
    np.testing.assert_allclose(taps["h"], [9.0, 18.0], rtol=1e-6)
    value, dp, taps = intermediate_grads(loss)(jnp.float32(1.5), jnp.array([-1.0, 2.0]))
    np.testing.assert_allclose([value, dp], [45.0, 60.0], rtol=1e-6)
    np.testing.assert_allclose(taps["h"], [-6.0, 12.0], rtol=1e-6)
    # Different shapes under one name cannot share a gradient.
    bad = lambda p, x: jax.lax.cond(x[0] > 0, lambda: jnp.sum(tap("h", p * x)),
                                    lambda: jnp.sum(tap("h", p * x[:1])))
    with pytest.raises(ValueError, match=r"'h' sits in two branches of one cond with different"):
        intermediate_grads(bad)(jnp.float32(1.5), jnp.array([1.0, 2.0]))


def test_a_tap_in_lax_map_with_a_remainder_names_the_cause():
    # batch_size 2 over 5 rows: two full batches in a scan, the last row on its own, so the
    # one tap line is traced twice.
    loss = lambda p, xs: jnp.sum(jax.lax.map(lambda x: jnp.sum(tap("h", p * x)), xs,
                                             batch_size=2))
    with pytest.raises(ValueError, match=r"same line was traced twice.*batch_size that divides"):
        intermediate_grads(loss)(jnp.float32(1.0), jnp.ones((5, 3)))
    # A batch_size that divides the length: one site, (batches, batch_size, 3); dloss/dh = 1.
    _, _, taps = intermediate_grads(loss)(jnp.float32(1.0), jnp.ones((4, 3)))
    np.testing.assert_array_equal(taps["h"], np.ones((2, 2, 3)))


def test_one_name_in_both_branches_of_a_vmapped_cond_names_the_select():
    # Under vmap a cond with a per-example predicate runs both branches: two sites.
    def loss(w, xs):
        return jax.vmap(lambda e: jax.lax.cond(e > 1.5, lambda: jnp.sum(tap("h", w * e) ** 2),
                                               lambda: jnp.sum(tap("h", w * e))))(xs).sum()
    with pytest.raises(ValueError, match=r"runs both branches \(vmap turns it into a select\)"):
        intermediate_grads(loss)(jnp.ones(3), jnp.array([1.0, 2.0]))


def test_a_constant_aux_comes_back_as_an_array():
    # Hand: sum(w^2) at w = [1, 1] is 2, its gradient 2w; the aux 3.0 is a literal in the jaxpr.
    (value, aux), grads, taps = intermediate_grads(
        lambda w: (jnp.sum(tap("a", w) ** 2), 3.0), has_aux=True)(jnp.ones(2))
    assert isinstance(aux, jax.Array) and float(aux) == 3.0 and float(value) == 2.0
    np.testing.assert_array_equal(taps["a"], [2.0, 2.0])


def test_inside_checkpoint_and_with_aux_and_argnums():
    # Same hand values as test_tap_gradients_by_hand; d/dx through z = x @ w is dz @ w^T.
    f = jax.checkpoint(lambda w, x: (sq_tanh(w, x), {"n": x.shape[0]}))
    (value, aux), (gw, gx), taps = intermediate_grads(f, argnums=(0, 1), has_aux=True)(W, X)
    h = np.tanh(np.asarray(X) @ np.asarray(W))
    dz = 2 * h * (1 - h ** 2)
    assert aux == {"n": 2}
    np.testing.assert_allclose(taps["z"], dz, rtol=1e-5)
    np.testing.assert_allclose(gx, dz @ np.asarray(W).T, rtol=1e-5)
    np.testing.assert_allclose(gw, np.asarray(X).T @ dz, rtol=1e-5)


def test_a_tap_alone_is_the_identity_and_compiles_to_nothing():
    x = jnp.arange(3.0)
    assert tap("t", x) is not None and np.array_equal(tap("t", x), x)
    untapped = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    chex.assert_trees_all_close(jax.grad(sq_tanh)(W, X), jax.grad(untapped)(W, X))
    chex.assert_trees_all_close(jax.jacfwd(sq_tanh)(W, X), jax.jacfwd(untapped)(W, X))
    # The lowered programs hold the same operations: the tap lowers to its operand.
    ops = lambda f: sorted(re.findall(r"stablehlo\.\w+", jax.jit(f).lower(W, X).as_text()))
    assert ops(sq_tanh) == ops(untapped)


def test_repeated_name_is_an_error_naming_both_sites():
    with pytest.raises(ValueError,
                       match=r"tap name 'z' is used twice in one call: at test_taps.py:\d+"):
        intermediate_grads(lambda w, x: sq_tanh(w, x) + sq_tanh(w, x))(W, X)


def test_taps_where_they_cannot_be_reached_are_errors():
    def in_while(w, x):
        return jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, tap("h", c[1])),
                                  (0, jnp.sum(x @ w)))[1]

    with pytest.raises(ValueError, match="inside a while_loop"):
        intermediate_grads(in_while)(W, X)

    @jax.custom_vjp
    def g(z):
        return tap("inner", z)
    g.defvjp(lambda z: (z, None), lambda _, ct: (ct,))
    with pytest.raises(ValueError, match="inside a custom_vjp function"):
        intermediate_grads(lambda w, x: jnp.sum(g(x @ w)))(W, X)


def test_bad_tap_arguments():
    with pytest.raises(TypeError, match="x must be a floating-point array, got dtype int32"):
        tap("i", jnp.arange(3))
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        tap("", jnp.ones(2))


def _tapped_pair(w, x):
    h = tap("h", w * x)
    return jnp.sum(h ** 2), {"h": h}


def test_a_loss_aux_pair_without_has_aux_gets_the_has_aux_hint():
    w, x = jnp.ones(3), jnp.arange(3.0)
    with pytest.raises(ValueError, match=r"a \(loss, aux\) output\. Pass has_aux=True"):
        intermediate_grads(_tapped_pair)(w, x)
    # With has_aux: h = w x = (0, 1, 2); d/dh sum(h^2) = 2h = (0, 2, 4); d/dw = 2 h x = (0, 2, 8).
    (loss, aux), grads, taps = intermediate_grads(_tapped_pair, has_aux=True)(w, x)
    assert float(loss) == 5.0 and aux["h"].tolist() == [0.0, 1.0, 2.0]
    assert grads.tolist() == [0.0, 2.0, 8.0] and taps["h"].tolist() == [0.0, 2.0, 4.0]


def test_a_non_scalar_output_gets_the_reduce_or_has_aux_hint():
    def squares(w, x):
        return tap("h", w * x) ** 2
    with pytest.raises(ValueError, match=r"returns an array of shape \(3,\).*Reduce it inside fn"
                                         r".*has_aux=True"):
        intermediate_grads(squares)(jnp.ones(3), jnp.arange(3.0))
    with pytest.raises(ValueError, match=r"has_aux=True\) needs fn to return a pair \(loss, aux\)"):
        intermediate_grads(squares, has_aux=True)(jnp.ones(3), jnp.arange(3.0))


# --- fuzz-found (tests/test_fuzz.py) ------------------------------------------------------------

def test_a_negative_argnums_differentiates_the_argument_it_names():
    # Found by the fuzz: argnums=-1 was shifted by one for the taps' own argument and became
    # 0, so the "gradient" returned was the taps' dict. -1 is the last argument, as in jax.grad.
    def loss(x, w):
        return jnp.sum(tap("h", x * w) ** 2)

    x, w = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
    value, grads, taps = intermediate_grads(loss, argnums=-1)(x, w)
    # L = sum((x w)^2): dL/dw = 2 x^2 w = [6, -8]; dL/dh = 2 h = 2 x w = [6, -4].
    np.testing.assert_array_equal(grads, jnp.array([6.0, -8.0]))
    np.testing.assert_array_equal(taps["h"], jnp.array([6.0, -4.0]))
    np.testing.assert_array_equal(grads, jax.grad(loss, argnums=-1)(x, w))
    with pytest.raises(ValueError, match="argnums=2 must name positions of the 2"):
        intermediate_grads(loss, argnums=2)(x, w)


def test_an_argument_that_is_not_an_array_is_named():
    # Found by the fuzz: an unregistered dataclass (one leaf to JAX) reached jax.jit's
    # "Error interpreting argument" from inside intermediate_grads.
    class Config:  # not a pytree: a leaf that is not an array
        scale = 2.0

    with pytest.raises(TypeError, match="intermediate_grads: argument c is a Config"):
        intermediate_grads(lambda x, c: jnp.sum(x * c.scale))(jnp.ones(2), Config())
