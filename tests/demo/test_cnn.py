"""The CNN of `funcgrad train --model cnn`: equal to a flax linen network with the same weights,
its dropout masks follow the key, its gradients match finite differences, and its BatchNorm
running averages follow flax's formula, computed here by hand."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg
from funcgrad.demo.cnn import batch_norm, cnn_apply, cnn_init, cnn_loss, dropout

CHANNELS = (4, 8)  # small: 8x8 -> 4x4 -> 2x2, 32 features into the dense head


def _batch(n=16, seed=1):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 64)).astype(np.float32),
            "y": rng.integers(0, 10, size=n).astype(np.int32)}


def _randomised(params, model_state, seed=2):
    """BatchNorm scale/bias and running statistics away from their init (1, 0, 0, 1), so that
    a swapped or ignored leaf changes the output."""
    rng = np.random.default_rng(seed)
    for name in params:
        if name.startswith("bn"):
            c = params[name]["scale"].shape[0]
            params[name] = {"scale": jnp.asarray(rng.uniform(0.5, 1.5, c), jnp.float32),
                            "bias": jnp.asarray(rng.normal(0, 0.3, c), jnp.float32)}
            model_state[name] = {"mean": jnp.asarray(rng.normal(0, 0.3, c), jnp.float32),
                                 "var": jnp.asarray(rng.uniform(0.5, 2.0, c), jnp.float32)}
    return params, model_state


def _flax_reference(params, model_state, *, rate, momentum):
    """The same network in flax linen, and its variables copied from ours."""
    nn = pytest.importorskip("flax.linen")

    class Reference(nn.Module):
        @nn.compact
        def __call__(self, x, *, train, key=None):
            x = x.reshape(x.shape[0], 8, 8, 1)
            for c in CHANNELS:
                x = nn.Conv(c, (3, 3), padding="SAME", use_bias=False)(x)
                x = nn.BatchNorm(use_running_average=not train, momentum=momentum,
                                 epsilon=1e-5, use_fast_variance=False)(x)
                x = nn.relu(x)
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = x.reshape(x.shape[0], -1)
            x = nn.Dropout(rate, deterministic=not train)(x, rng=key)
            return nn.Dense(10)(x)

    variables = {
        "params": {**{f"Conv_{i}": {"kernel": params[f"conv{i}"]["w"]} for i in range(2)},
                   **{f"BatchNorm_{i}": dict(params[f"bn{i}"]) for i in range(2)},
                   "Dense_0": {"kernel": params["dense"]["w"], "bias": params["dense"]["b"]}},
        "batch_stats": {f"BatchNorm_{i}": dict(model_state[f"bn{i}"]) for i in range(2)}}
    return Reference(), variables


@pytest.mark.parametrize("dtype, tol", [
    # float32: the two programs order the BatchNorm arithmetic differently (flax: (x - mean) *
    # mul + bias; ours: x * mul + (bias - mean * mul)); logits of size ~1-10 after a few hundred
    # float32 roundings (eps 6e-8) agree to ~1e-5.
    (jnp.float32, 2e-5),
    # float64: the same two methods agree to float64 rounding.
    (jnp.float64, 1e-11),
], ids=["float32", "float64"])
def test_forward_equals_flax_linen_in_train_and_eval_mode(key, dtype, tol):
    rate, momentum = 0.25, 0.9
    params, state = _randomised(*cnn_init(key, channels=CHANNELS))
    with jax.enable_x64(dtype == jnp.float64):
        params, state = jax.tree.map(lambda a: jnp.asarray(a, dtype), (params, state))
        model, variables = _flax_reference(params, state, rate=rate, momentum=momentum)
        x = jnp.asarray(_batch()["x"], dtype)
        dropout_key = jax.random.key(7)
        # Training: batch statistics, dropout with the same key (flax's Dropout(rng=key) draws
        # bernoulli(key, 1 - rate) as ours does), and the running-average update.
        ours, new_state = jax.jit(functools.partial(
            cnn_apply, train=True, dropout_rate=rate, momentum=momentum))(
                params, state, x, key=dropout_key)
        theirs, updated = jax.jit(functools.partial(
            model.apply, train=True, mutable=["batch_stats"]))(variables, x, key=dropout_key)
        np.testing.assert_allclose(ours, theirs, rtol=tol, atol=tol)
        for i in range(2):
            for stat in ("mean", "var"):
                np.testing.assert_allclose(new_state[f"bn{i}"][stat],
                                           updated["batch_stats"][f"BatchNorm_{i}"][stat],
                                           rtol=tol, atol=tol)
                assert new_state[f"bn{i}"][stat].dtype == dtype
        # The update moved the statistics (else the comparison above proves little).
        assert not np.allclose(new_state["bn1"]["mean"], state["bn1"]["mean"])
        # Evaluation: the running statistics, no dropout, the state returned unchanged.
        ours, same_state = jax.jit(functools.partial(cnn_apply, train=False))(params, state, x)
        theirs = jax.jit(functools.partial(model.apply, train=False))(variables, x)
        np.testing.assert_allclose(ours, theirs, rtol=tol, atol=tol)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), same_state, state))


def test_init_shapes_and_scales(key):
    params, state = fg.cnn_init(key)  # channels (32, 64): 8x8 -> 4x4 -> 2x2, 256 features
    shapes = jax.tree.map(jnp.shape, (params, state))
    assert shapes == ({"conv0": {"w": (3, 3, 1, 32)}, "bn0": {"scale": (32,), "bias": (32,)},
                       "conv1": {"w": (3, 3, 32, 64)}, "bn1": {"scale": (64,), "bias": (64,)},
                       "dense": {"w": (256, 10), "b": (10,)}},
                      {"bn0": {"mean": (32,), "var": (32,)}, "bn1": {"mean": (64,), "var": (64,)}})
    # He: variance 2 / fan_in, fan_in = 3*3*32 = 288, over 18432 draws (the sample variance's
    # relative std is sqrt(2 / 18432) = 1.0%: 5% is 5 sigma). LeCun: 1 / 256 over 2560 draws
    # (relative std 2.8%: 15% is over 5 sigma).
    np.testing.assert_allclose(np.var(params["conv1"]["w"]), 2 / 288, rtol=0.05)
    np.testing.assert_allclose(np.var(params["dense"]["w"]), 1 / 256, rtol=0.15)
    assert abs(float(np.mean(params["conv1"]["w"]))) < 5 * np.sqrt(2 / 288 / 18432)
    assert all((np.asarray(state[f"bn{i}"]["var"]) == 1).all()
               and (np.asarray(state[f"bn{i}"]["mean"]) == 0).all()
               and (np.asarray(params[f"bn{i}"]["scale"]) == 1).all() for i in range(2))
    assert fg.cnn_apply is cnn_apply and fg.cnn_loss is cnn_loss


def test_dropout_masks_follow_the_key(key):
    params, state = cnn_init(key, channels=CHANNELS)
    x = _batch()["x"]
    run = jax.jit(lambda k: cnn_apply(params, state, x, train=True, key=k, dropout_rate=0.5)[0])
    a, again, b = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    np.testing.assert_array_equal(a, again)  # same key: the same mask, bit for bit
    assert not np.allclose(a, b)              # another key: another mask
    # The mask itself: x of ones, rate 0.25 -> every element 0 or 1 / 0.75 (inverted dropout),
    # about a quarter zeros: 4000 Bernoulli(0.25) draws have a std of sqrt(.25*.75/4000) =
    # 0.0068 in the dropped fraction; 0.03 is over 4 sigma.
    out = dropout(jnp.ones((4000,)), 0.25, jax.random.key(3))
    assert set(np.unique(np.asarray(out)).tolist()) == {0.0, np.float32(1 / 0.75)}
    assert abs(float((out == 0).mean()) - 0.25) < 0.03
    np.testing.assert_array_equal(out, dropout(jnp.ones((4000,)), 0.25, jax.random.key(3)))
    assert not np.array_equal(out, dropout(jnp.ones((4000,)), 0.25, jax.random.key(4)))


def test_gradients_match_finite_differences(key):
    params, state = _randomised(*cnn_init(key, channels=CHANNELS))  # 680 params
    batch = _batch(n=4)
    dropout_key = jax.random.key(5)
    loss, _ = cnn_loss(params, batch, model_state=state, key=dropout_key)
    assert np.isfinite(float(loss))
    # Training mode: the gradient flows through the batch statistics too.
    # The loss under the contract, bound to a model state and key as the analysis tools take it.
    bound = fg.Loss(cnn_loss, has_state=True, takes_key=True).bind(model_state=state,
                                                                   key=dropout_key)
    report = fg.check_grads(bound, params, batch, options=fg.CheckOptions(progress=False))
    assert report.ok, report
    assert {row.path for row in report.rows} == {
        f"params['{layer}']['{leaf}']" for layer, leaf in [
            ("conv0", "w"), ("bn0", "scale"), ("bn0", "bias"), ("conv1", "w"), ("bn1", "scale"),
            ("bn1", "bias"), ("dense", "w"), ("dense", "b")]}


def test_batch_norm_running_average_by_hand(strict_dtypes):
    # x: (n=2, h=2, w=1, c=2); statistics over n, h, w for each channel.
    x = jnp.asarray([[[[1.0, 0.0]], [[2.0, 0.0]]],
                     [[[3.0, 4.0]], [[6.0, 4.0]]]], jnp.float32)
    # channel 0: 1, 2, 3, 6 -> mean 3, biased var (4 + 1 + 0 + 9) / 4 = 3.5
    # channel 1: 0, 0, 4, 4 -> mean 2, biased var (4 + 4 + 4 + 4) / 4 = 4
    stats = {"mean": jnp.asarray([1.0, -2.0], jnp.float32),
             "var": jnp.asarray([1.0, 2.0], jnp.float32)}
    scale, bias = jnp.asarray([2.0, 1.0], jnp.float32), jnp.asarray([0.5, -1.0], jnp.float32)
    y, new = batch_norm(x, scale, bias, stats, train=True, momentum=0.75, epsilon=0.5)
    # running = 0.75 * running + 0.25 * batch (flax's convention), exact in binary:
    # mean: 0.75 * 1 + 0.25 * 3 = 1.5;  0.75 * -2 + 0.25 * 2 = -1
    # var:  0.75 * 1 + 0.25 * 3.5 = 1.625;  0.75 * 2 + 0.25 * 4 = 2.5
    np.testing.assert_array_equal(new["mean"], [1.5, -1.0])
    np.testing.assert_array_equal(new["var"], [1.625, 2.5])
    # y = (x - mean) / sqrt(var + eps) * scale + bias with the batch statistics:
    # channel 0: (x - 3) / sqrt(4) * 2 + 0.5 = x - 2.5;  channel 1: (x - 2) / sqrt(4.5) - 1
    # Tolerance: a few float32 ulps (1.2e-7 each) through rsqrt, a product and a sum.
    np.testing.assert_allclose(y[..., 0], x[..., 0] - 2.5, rtol=1e-5)
    np.testing.assert_allclose(y[..., 1], (x[..., 1] - 2) / np.sqrt(4.5) - 1, rtol=1e-5)
    # Evaluation: the running statistics, returned as they are.
    y, same = batch_norm(x, scale, bias, stats, train=False, epsilon=0.5)
    assert same is stats
    # channel 0: (x - 1) / sqrt(1.5) * 2 + 0.5;  channel 1: (x + 2) / sqrt(2.5) - 1
    np.testing.assert_allclose(y[..., 0], (x[..., 0] - 1) / np.sqrt(1.5) * 2 + 0.5, rtol=1e-5)
    np.testing.assert_allclose(y[..., 1], (x[..., 1] + 2) / np.sqrt(2.5) - 1, rtol=1e-5)


def test_half_precision_keeps_the_state_in_float32(key):
    params, state = cnn_init(key, channels=CHANNELS)
    x = _batch()["x"]
    apply = jax.jit(functools.partial(cnn_apply, train=True))
    logits, new = apply(params, state, x, key=jax.random.key(1))
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    logits16, new16 = apply(half, state, jnp.asarray(x, jnp.bfloat16), key=jax.random.key(1))
    assert logits16.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(new16))
    # Statistics reduced in float32 over bfloat16 activations (8 significant bits, relative
    # rounding 2**-8 = 0.4%): the running statistics agree to about that.
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new16)):
        np.testing.assert_allclose(a, b, rtol=0.02, atol=0.02)


def test_per_example_losses_average_to_the_loss(key):
    params, state = cnn_init(key, channels=CHANNELS)
    batch, k = _batch(), jax.random.key(1)
    loss = jax.jit(cnn_loss, static_argnames="per_example")
    mean, _ = loss(params, batch, model_state=state, key=k)
    per_example, _ = loss(params, batch, model_state=state, key=k, per_example=True)
    assert per_example.shape == (16,)
    np.testing.assert_allclose(per_example.mean(), mean, rtol=1e-6)


def test_bad_input_errors(key):
    params, state = cnn_init(key, channels=CHANNELS)
    x = _batch()["x"]
    with pytest.raises(ValueError, match="needs a PRNG key"):
        cnn_apply(params, state, x, train=True)
    # Without dropout no key is needed.
    cnn_apply(params, state, x, train=True, dropout_rate=0.0)
    with pytest.raises(ValueError, match="not a square image"):
        cnn_apply(params, state, x[:, :60], train=False)
    with pytest.raises(ValueError, match=r"grey images \(n, height, width\)"):
        cnn_apply(params, state, x.reshape(16, 8, 8, 1, 1), train=False)
    with pytest.raises(TypeError, match="floating images"):
        cnn_apply(params, state, x.astype(np.int32), train=False)
    with pytest.raises(ValueError, match="params must be the dict from cnn_init"):
        cnn_apply([params], state, x, train=False)
    with pytest.raises(TypeError, match=r"jax.random.key\(0\)"):
        cnn_init(0)
    with pytest.raises(ValueError, match="halved only 3 times"):
        cnn_init(key, channels=(4, 4, 4, 4))
    with pytest.raises(ValueError, match="rate must be in"):
        dropout(jnp.ones(3), 1.0, key)
