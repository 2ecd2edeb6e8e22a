"""Models as pure functions: init statistics, the forward pass, the losses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg


def test_init_shapes_and_zero_biases(key):
    params = fg.mlp_init(key, (64, 128, 10))
    assert ([(p["w"].shape, p["b"].shape) for p in params]
            == [((64, 128), (128,)), ((128, 10), (10,))])
    assert all(p["w"].dtype == jnp.float32 and not np.any(p["b"]) for p in params)


@pytest.mark.parametrize("activation, expected_std", [
    ("relu", np.sqrt(2 / 256)),       # He: Var = 2 / fan_in
    ("tanh", np.sqrt(2 / (256 + 512))),  # Glorot: Var = 2 / (fan_in + fan_out)
])
def test_init_scale_follows_activation(key, activation, expected_std):
    w = np.asarray(fg.mlp_init(key, (256, 512), activation=activation)[0]["w"])
    # 131,072 samples: the sample std's relative standard error is ~1/sqrt(2n) = 0.2%; 3% is safe.
    assert w.std() == pytest.approx(expected_std, rel=0.03)


def test_apply_equals_numpy_forward(key, strict_dtypes):
    params = fg.mlp_init(key, (5, 7, 3))
    x = jax.random.normal(jax.random.key(1), (4, 5))
    (w1, b1), (w2, b2) = ((np.asarray(p["w"], np.float64), np.asarray(p["b"], np.float64))
                          for p in params)
    ref = np.maximum(np.asarray(x, np.float64) @ w1 + b1, 0) @ w2 + b2  # second method: NumPy
    np.testing.assert_allclose(jax.jit(fg.mlp_apply)(params, x), ref, rtol=1e-5, atol=1e-5)


def test_the_init_activation_travels_with_the_params(key, strict_dtypes):
    # mlp_init(activation="tanh") then mlp_apply(params, x): a tanh network (before: ReLU).
    params = fg.mlp_init(key, (5, 7, 3), activation="tanh")
    x = jax.random.normal(jax.random.key(1), (4, 5))
    (w1, b1), (w2, b2) = ((np.asarray(p["w"], np.float64), np.asarray(p["b"], np.float64))
                          for p in params)
    ref = np.tanh(np.asarray(x, np.float64) @ w1 + b1) @ w2 + b2  # second method: NumPy
    np.testing.assert_allclose(fg.mlp_apply(params, x), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(fg.mlp_apply)(params, x), ref, rtol=1e-5, atol=1e-5)
    # It survives grad and an optimizer step (static pytree metadata); paths are unchanged.
    grads = jax.grad(lambda p: jnp.sum(fg.mlp_apply(p, x)))(params)
    stepped = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert stepped.activation == "tanh" and stepped[:1].activation == "tanh"
    assert [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(stepped)[0]] \
        == ["[0]['b']", "[0]['w']", "[1]['b']", "[1]['w']"]
    np.testing.assert_allclose(fg.mlp_apply(stepped, x),
                               fg.mlp_apply(stepped, x, activation="tanh"), rtol=0)


def test_a_mismatched_activation_is_refused(key):
    params = fg.mlp_init(key, (5, 7, 3), activation="tanh")
    with pytest.raises(ValueError, match=r"activation='relu', but params were made by "
                                         r"mlp_init\(\.\.\., activation='tanh'\).*Leave "
                                         r"activation out"):
        fg.mlp_apply(params, jnp.ones((2, 5)), activation="relu")
    # ReLU params stay a plain list (plain-list masks keep matching them).
    assert type(fg.mlp_init(key, (5, 3))) is list


def test_losses_by_hand(strict_dtypes):
    # Uniform logits over 4 classes: cross-entropy = log 4 for any label.
    np.testing.assert_allclose(fg.softmax_cross_entropy(jnp.zeros((3, 4)), jnp.array([0, 1, 3])),
                               np.log(4.0), rtol=1e-6)
    # ((1-0)^2 + (3-1)^2) / 2 = 2.5
    assert float(fg.mean_squared_error(jnp.array([1.0, 3.0]), jnp.array([0.0, 1.0]))) == 2.5
    # rows' argmax = (1, 0, 1) vs labels (1, 1, 1): 2 of 3 right
    logits = jnp.array([[0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    assert float(fg.accuracy(logits, jnp.array([1, 1, 1]))) == pytest.approx(2 / 3)


def test_bad_input_errors(key):
    params = fg.mlp_init(key, (5, 3))
    with pytest.raises(ValueError, match=r"shape \(batch, in\)"):
        fg.mlp_apply(params, jnp.ones(5))
    with pytest.raises(ValueError, match="x has 4 features but params\\[0\\]\\['w'\\] expects 5"):
        fg.mlp_apply(params, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        fg.mlp_init(key, (5, 3), activation="swish")
    with pytest.raises(ValueError, match="at least two positive ints"):
        fg.mlp_init(key, (5,))
    # PyTorch habit: an int seed. JAX takes a key made from it.
    with pytest.raises(TypeError, match=r"got the int 0\. Make one from the seed: "
                                        r"mlp_init\(jax\.random\.key\(0\), sizes\)"):
        fg.mlp_init(0, (5, 3))


def test_cross_entropy_label_errors():
    logits = jnp.zeros((4, 10))
    # Labels for another number of rows (x and y of different batches).
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) do not match logits of shape "
                                         r"\(4, 10\): expected one label per row, shape \(4,\)"):
        fg.softmax_cross_entropy(logits, jnp.zeros(3, jnp.int32))
    # One-hot (float) labels.
    with pytest.raises(TypeError, match=r"labels must be integer class indices of shape \(4,\), "
                                        r"got dtype float32 .* pass labels\.argmax\(-1\)"):
        fg.softmax_cross_entropy(logits, jax.nn.one_hot(jnp.arange(4), 10))


def test_out_of_range_labels_make_the_loss_nan_both_ways():
    # Hand: uniform logits over 4 classes give log(4) per valid example. A label of -1 would
    # index the last class and 4 is past the end: both make the mean NaN, so the train step's
    # guard skips the update instead of training on a wrong target.
    logits = jnp.zeros((2, 4))
    np.testing.assert_allclose(fg.softmax_cross_entropy(logits, jnp.array([0, 3])), np.log(4.0),
                               rtol=1e-6)
    assert np.isnan(fg.softmax_cross_entropy(logits, jnp.array([-1, 3])))
    assert np.isnan(fg.softmax_cross_entropy(logits, jnp.array([0, 4])))
