"""Trainable masks: selection by path, gradients of trainable leaves only, frozen optimizers.

Concept 4 (article A §2.1)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad._jaxpr import sub_jaxprs
from funcgrad.train.masks import requires_grad, train_only, trainable_mask, value_and_grad_trainable


def _mlp(sizes=(6, 8, 3), dtype=jnp.float32):
    params = fg.mlp_init(jax.random.key(0), sizes, dtype=dtype)
    x = jax.random.normal(jax.random.key(1), (5, sizes[0]), dtype)
    y = jnp.array([0, 1, 2, 1, 0])

    def loss_fn(p, x, y):
        return fg.softmax_cross_entropy(fg.mlp_apply(p, x), y)
    return params, x, y, loss_fn


def _count(jaxpr, primitive="dot_general"):
    """Equations of `primitive` in `jaxpr` and every jaxpr nested in it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == primitive
        n += sum(_count(sub, primitive) for _, sub, _ in sub_jaxprs(eqn))
    return n


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# --- trainable_mask ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, expected", [
    # Leaf paths of a two-layer MLP: 0/b, 0/w, 1/b, 1/w.
    ({}, [{"b": True, "w": True}, {"b": True, "w": True}]),
    ({"freeze": "0/*"}, [{"b": False, "w": False}, {"b": True, "w": True}]),
    ({"train": "1/*"}, [{"b": False, "w": False}, {"b": True, "w": True}]),
    ({"freeze": "*/b"}, [{"b": False, "w": True}, {"b": False, "w": True}]),
    # train selects 0/w and 1/w, freeze then removes 0/w.
    ({"train": "*/w", "freeze": "0/*"}, [{"b": False, "w": False}, {"b": False, "w": True}]),
    # A list selects the union: 0/b or anything in layer 1.
    ({"freeze": ["0/b", "1/*"]}, [{"b": False, "w": True}, {"b": False, "w": False}]),
    # Predicate: the 2-D leaves are the weights.
    ({"train": lambda path, leaf: leaf.ndim == 2},
     [{"b": False, "w": True}, {"b": False, "w": True}]),
], ids=["default_all", "freeze_layer0", "train_layer1", "freeze_biases", "train_and_freeze",
        "list_union", "predicate"])
def test_trainable_mask_selects_by_path(kwargs, expected):
    params, *_ = _mlp()
    assert trainable_mask(params, **kwargs) == expected


def test_paths_name_dict_keys_and_attributes():
    # keys joined by '/': dict key "enc", tuple index 1, dict key "w".
    params = {"enc": ({"w": jnp.ones(2)}, {"w": jnp.ones(2)}), "head": jnp.ones(3)}
    assert trainable_mask(params, freeze="enc/1/w") == {
        "enc": ({"w": True}, {"w": False}), "head": True}


def test_pattern_matching_nothing_lists_the_paths():
    params, *_ = _mlp()
    with pytest.raises(ValueError, match=r"'0/W' matches no leaf.*0/b, 0/w, 1/b, 1/w"):
        trainable_mask(params, freeze="0/W")
    with pytest.raises(ValueError, match="train= predicate .* matches no leaf"):
        trainable_mask(params, train=lambda path, leaf: leaf.ndim == 3)


def test_bad_selectors_are_type_errors():
    params, *_ = _mlp()
    with pytest.raises(TypeError, match="path patterns such as '0/\\*' or predicates"):
        trainable_mask(params, freeze=0)
    with pytest.raises(TypeError, match="predicate returned .*Array.* bool"):
        trainable_mask(params, freeze=lambda path, leaf: leaf.sum() > 0)


# --- value_and_grad_trainable -----------------------------------------------------------------

def test_frozen_leaf_gets_exact_zeros_by_hand(strict_dtypes):
    # f = a * b^2 at a = 3, b = 2: df/db = 2ab = 12; a frozen, so its gradient is 0 (shape (),
    # float32) although df/da = b^2 = 4. f = 3 * 4 = 12.
    f = lambda p: p["a"] * p["b"] ** 2
    p = {"a": jnp.float32(3.0), "b": jnp.float32(2.0)}
    value, grads = jax.jit(value_and_grad_trainable(f, {"a": False, "b": True}))(p)
    assert float(value) == 12.0 and float(grads["b"]) == 12.0
    assert grads["a"].dtype == jnp.float32 and grads["a"].shape == () and float(grads["a"]) == 0.0


@pytest.mark.parametrize("mask", [
    [{"b": False, "w": False}, {"b": True, "w": True}],
    [False, True],  # a prefix: one bool per layer
    [{"b": True, "w": False}, {"b": False, "w": True}],
], ids=["full_mask", "prefix_mask", "mixed"])
def test_trainable_grads_equal_jax_grad(mask):
    # Second method: plain jax.grad over every leaf, then read the trainable ones. float64, so
    # the two evaluations of the same formulas agree to 1e-10 whatever XLA fuses.
    with jax.enable_x64(True):
        params, x, y, loss_fn = _mlp(dtype=jnp.float64)
        value, grads = jax.jit(value_and_grad_trainable(loss_fn, mask))(params, x, y)
        ref_value, ref = jax.value_and_grad(loss_fn)(params, x, y)
        flags = jax.tree.leaves(jax.tree.map(
            lambda m, sub: jax.tree.map(lambda _: m, sub), mask, params))
        np.testing.assert_allclose(value, ref_value, rtol=1e-10)
        for g, r, f in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), flags):
            assert g.shape == r.shape and g.dtype == r.dtype
            if f:
                np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)
            else:
                assert np.all(np.asarray(g) == 0.0)  # exact zeros, not merely small


def test_has_aux_passes_aux_through():
    # f = sum(w^2), aux = "n": df/dw = 2w = (2, 4); b frozen -> 0.
    f = lambda p: (jnp.sum(p["w"] ** 2), {"n": p["w"].size})
    (value, aux), grads = value_and_grad_trainable(f, {"w": True, "b": False}, has_aux=True)(
        {"w": jnp.array([1.0, 2.0]), "b": jnp.array(5.0)})
    assert float(value) == 5.0 and aux == {"n": 2}
    assert grads["w"].tolist() == [2.0, 4.0] and float(grads["b"]) == 0.0


def test_frozen_leaves_get_no_tangent_so_their_backward_is_not_computed():
    # Count the matrix products (dot_general) in the traced gradient computation.
    # Two layers, x (B, D), W0 (D, H), W1 (H, K); forward: x W0 and h W1 -> 2.
    #   all trainable, backward: dW1 = hᵀ dlogits, dh = dlogits W1ᵀ, dW0 = xᵀ dz -> 3; total 5
    #     (dx = dz W0ᵀ is never formed: x is not differentiated).
    #   layer 0 frozen: only dW1 = hᵀ dlogits; dh feeds nothing trainable -> 1; total 3.
    #   jax.grad then multiplying by the mask: the same 5 products, the zeros come after.
    params, x, y, loss_fn = _mlp()
    frozen0 = trainable_mask(params, freeze="0/*")
    count = lambda f: _count(jax.make_jaxpr(f)(params, x, y).jaxpr)
    masked_after = lambda p, x, y: jax.tree.map(
        lambda g, m: g * m, jax.grad(loss_fn)(p, x, y), frozen0)
    assert count(loss_fn) == 2
    assert count(jax.value_and_grad(loss_fn)) == 5
    assert count(value_and_grad_trainable(loss_fn, frozen0)) == 3
    assert count(masked_after) == 5


def test_which_backward_products_are_dropped_in_three_layers():
    # Three layers: forward 3 products. Backward, all trainable: dW2, dh2, dW1, dh1, dW0 -> 5;
    # total 8. First layer frozen: dW0 and dh1 (which only fed dW0) go -> 6. Last layer frozen:
    # only dW2 goes (dh2 still feeds dW1 and dW0) -> 7.
    params, x, y, loss_fn = _mlp((6, 8, 8, 3))
    count = lambda mask: _count(jax.make_jaxpr(value_and_grad_trainable(loss_fn, mask))(
        params, x, y).jaxpr)
    assert count(trainable_mask(params)) == 8
    assert count(trainable_mask(params, freeze="0/*")) == 6
    assert count(trainable_mask(params, freeze="2/*")) == 7


@pytest.mark.parametrize("mask, error, match", [
    ([True], ValueError,
     r"(?s)structure does not match params.*params: PyTreeDef.*mask:   PyTreeDef"),
    ([{"b": 1, "w": True}, True], TypeError, r"mask leaf at 0/b is int 1; .*Python bools"),
    ([jnp.array(True), True], TypeError, r"mask leaf at 0 is .*Array.*traced or device array"),
], ids=["structure", "int_leaf", "jax_array_leaf"])
def test_bad_mask_errors(mask, error, match):
    params, x, y, loss_fn = _mlp()
    with pytest.raises(error, match=match):
        value_and_grad_trainable(loss_fn, mask)(params, x, y)


def test_integer_trainable_leaf_is_refused():
    params = {"w": jnp.ones(2), "step": jnp.array(0)}
    f = lambda p: jnp.sum(p["w"])
    with pytest.raises(TypeError, match=r"params\['step'\] has dtype int32.*freeze='step'"):
        value_and_grad_trainable(f, trainable_mask(params))(params)
    _, grads = value_and_grad_trainable(f, trainable_mask(params, freeze="step"))(params)
    assert grads["step"].dtype == jnp.int32 and int(grads["step"]) == 0


# --- train_only -------------------------------------------------------------------------------

def _train(tx, mask, steps, loss_fn, params, x, y):
    """Runs `steps` updates; returns the params, the opt state and every step's updates."""
    grad_fn = value_and_grad_trainable(loss_fn, mask)

    @jax.jit
    def step(params, opt_state):
        _, grads = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, updates

    opt_state, all_updates = tx.init(params), []
    for _ in range(steps):
        params, opt_state, updates = step(params, opt_state)
        all_updates.append(updates)
    return params, opt_state, all_updates


def test_adam_frozen_layer_is_bit_identical_after_ten_steps():
    params, x, y, loss_fn = _mlp()
    mask = trainable_mask(params, freeze="0/*")
    new, opt_state, all_updates = _train(train_only(optax.adam(1e-2), mask), mask, 10,
                                         loss_fn, params, x, y)
    assert _bits(new[0]) == _bits(params[0])  # frozen: the same bytes
    for updates in all_updates:  # every step's update of a frozen leaf is exactly zero
        assert all(np.all(np.asarray(u) == 0.0) for u in jax.tree.leaves(updates[0]))
    assert all(np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3
               for a, b in zip(jax.tree.leaves(new[1]), jax.tree.leaves(params[1])))
    # Adam keeps moments for the trainable leaves only: mu holds 1/b (3,) and 1/w (8, 3).
    mu = opt_state.inner_states["trainable"].inner_state[0].mu
    assert [a.shape for a in jax.tree.leaves(mu)] == [(3,), (8, 3)]
    # Second method: Adam on layer 1 alone, its gradient from plain jax.grad with layer 0 as a
    # constant. Same formulas on the same numbers, float32: equal up to a few ulps of fusion.
    tx, p1 = optax.adam(1e-2), params[1]
    state = tx.init(p1)
    for _ in range(10):
        g = jax.grad(lambda p1: loss_fn([params[0], p1], x, y))(p1)
        u, state = tx.update(g, state, p1)
        p1 = optax.apply_updates(p1, u)
    for a, b in zip(jax.tree.leaves(new[1]), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_adamw_weight_decay_does_not_move_frozen_leaves():
    params, x, y, loss_fn = _mlp()
    mask = trainable_mask(params, freeze="0/*")
    lr, wd = 0.1, 0.5
    new, _, _ = _train(train_only(optax.adamw(lr, weight_decay=wd), mask), mask, 10,
                       loss_fn, params, x, y)
    assert _bits(new[0]) == _bits(params[0])
    # Why train_only is needed: plain adamw given the exact zero gradients still decays the frozen
    # leaves. First step with g = 0: mu = nu = 0, so the Adam part is 0 / (0 + eps) = 0 and the
    # update is -lr * wd * p, giving p * (1 - 0.1 * 0.5) = 0.95 p (float32: one rounding).
    once, _, _ = _train(optax.adamw(lr, weight_decay=wd), mask, 1, loss_fn, params, x, y)
    np.testing.assert_allclose(once[0]["w"], 0.95 * params[0]["w"], rtol=1e-6)


def test_train_only_checks_the_mask_and_the_optimizer():
    params, *_ = _mlp()
    with pytest.raises(ValueError, match="train_only: the mask's structure does not match"):
        train_only(optax.adam(1e-3), [True, True, True]).init(params)
    with pytest.raises(TypeError, match="train_only: optimizer must be an optax "
                                        "GradientTransformation"):
        train_only("adam", [False, True])
    # The public name, with the polarity of every funcgrad mask (True = trained).
    assert fg.train_only is train_only


# --- requires_grad ----------------------------------------------------------------------------

def test_requires_grad_follows_the_propagation_rule():
    # a frozen, b trainable. An output needs a gradient iff it depends on b through a
    # differentiable path: a*b yes; a+1 no (a only); stop_gradient(b) cuts the path; b > 0 is
    # boolean; round has derivative 0 everywhere (JAX knows, PyTorch would say True); a jitted
    # call is followed inside: (2a, 3b) -> (no, yes).
    def f(p):
        a, b = p["a"], p["b"]
        return {"ab": a * b, "a1": a + 1.0, "sg": jax.lax.stop_gradient(b) * a,
                "cmp": b > 0, "round": jnp.round(b),
                "jit": jax.jit(lambda a, b: (2.0 * a, 3.0 * b))(a, b)}
    report = requires_grad(f, {"a": False, "b": True})({"a": jnp.ones(3), "b": jnp.ones(3)})
    assert report == {"ab": True, "a1": False, "sg": False, "cmp": False, "round": False,
                      "jit": (False, True)}


def test_requires_grad_of_a_frozen_first_layer():
    # logits depend on layer 1 (trainable); the hidden pre-activation x W0 + b0 does not.
    params, x, _, _ = _mlp()
    f = lambda p, x: (x @ p[0]["w"] + p[0]["b"][None, :], fg.mlp_apply(p, x))
    assert requires_grad(f, [False, True])(params, x) == (False, True)


def test_a_state_made_without_the_steps_mask_says_which_side_lacks_it():
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    mask = fg.trainable_mask(params, freeze="a")
    loss = lambda p, b: jnp.sum(p["a"] * p["b"])
    step = fg.make_train_step(loss, optax.adam(0.1), trainable=mask)
    plain = fg.make_train_step(loss, optax.adam(0.1))
    with pytest.raises(ValueError, match="the state was created without the same mask"):
        step(plain.init(params), {})
    with pytest.raises(ValueError, match="that this step does not have"):
        plain(step.init(params), {})
