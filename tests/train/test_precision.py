"""Dynamic loss scaling: the scale's schedule, skipped steps, unscaling before clipping, and the
state as a pytree. Every expected value is derived by hand in a comment (or by PyTorch).

The train steps here are ``make_train_step(fg.mixed_precision(loss, dtype, loss_scale=ls), tx)``,
their states from ``step.init(params)`` (which adds the loss scale's state)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.train import precision as P
from funcgrad.train.step import TrainState, make_train_step

F, N = True, False  # a finite / a non-finite step in the scripted runs

# Hyperparameters of the scripted run: small numbers so that the floor and the ceiling are
# reached within a few steps. interval 3: the scale grows on the 3rd consecutive finite step.
SCRIPT_HP = dict(init_scale=4.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                 min_scale=1.0, max_scale=16.0)
# (finite?, then (scale, good_steps, skipped, skipped_total) after that step), from
# (scale, good, skipped, total) = (4, 0, False, 0):
SCRIPT = [
    (F, (4.0, 1, False, 0)),
    (F, (4.0, 2, False, 0)),
    (F, (8.0, 0, False, 0)),    # 3rd finite step: 4 * 2 = 8, counter reset
    (N, (4.0, 0, True, 1)),     # overflow: 8 * 0.5 = 4, skipped, total 1
    (F, (4.0, 1, False, 1)),
    (F, (4.0, 2, False, 1)),
    (F, (8.0, 0, False, 1)),    # 3 finite steps since the skip: 8
    (F, (8.0, 1, False, 1)),
    (F, (8.0, 2, False, 1)),
    (F, (16.0, 0, False, 1)),   # 8 * 2 = 16 = max_scale
    (F, (16.0, 1, False, 1)),
    (F, (16.0, 2, False, 1)),
    (F, (16.0, 0, False, 1)),   # ceiling: min(16 * 2, 16) = 16; the counter still resets
    (N, (8.0, 0, True, 2)),
    (N, (4.0, 0, True, 3)),
    (N, (2.0, 0, True, 4)),
    (N, (1.0, 0, True, 5)),     # 2 * 0.5 = 1 = min_scale
    (N, (1.0, 0, True, 6)),     # floor: max(1 * 0.5, 1) = 1
    (F, (1.0, 1, False, 6)),
    (N, (1.0, 0, True, 7)),     # a skip resets a partial run of finite steps
    (F, (1.0, 1, False, 7)),
    (F, (1.0, 2, False, 7)),
    (F, (2.0, 0, False, 7)),    # 3 finite steps after the last skip: 1 * 2 = 2
]


def _as_tuple(state):
    return (float(state.scale), int(state.good_steps), bool(state.skipped),
            int(state.skipped_total))


def _bits(tree):
    """Each leaf as (dtype, shape, raw bytes), to compare pytrees bit for bit."""
    return [(np.asarray(a).dtype, np.shape(a), np.asarray(a).tobytes())
            for a in jax.tree.leaves(tree)]


def test_scale_follows_the_scripted_sequence_under_jit(strict_dtypes):
    ls = P.dynamic_loss_scale(**SCRIPT_HP)
    update = jax.jit(ls.update)
    state = ls.init()
    assert _as_tuple(state) == (4.0, 0, False, 0)
    for i, (finite, expected) in enumerate(SCRIPT):
        state = update(state, jnp.asarray(finite))
        assert _as_tuple(state) == expected, f"step {i + 1}"


def test_scale_sequence_in_one_scan_equals_step_by_step(strict_dtypes):
    # The same script as one compiled lax.scan: the update is a pure function of (state, flag).
    ls = P.dynamic_loss_scale(**SCRIPT_HP)
    flags = jnp.asarray([f for f, _ in SCRIPT])
    _, states = jax.jit(lambda s, f: jax.lax.scan(lambda c, x: (ls.update(c, x),) * 2, s, f))(
        ls.init(), flags)
    got = [_as_tuple(jax.tree.map(lambda a, i=i: a[i], states)) for i in range(len(SCRIPT))]
    assert got == [e for _, e in SCRIPT]


def test_counter_convention_matches_pytorch():
    # PyTorch's own update kernel on the same script (PyTorch has no floor or ceiling, so this
    # script stays inside [min, max]): the scale must agree on every step, and so must PyTorch's
    # growth tracker with our good_steps. interval 3: both grow on the 3rd finite step.
    torch = pytest.importorskip("torch")
    script = [F, F, F, N, F, F, F, F, F, N, F, N, N, F, F, F, F]
    ls = P.dynamic_loss_scale(init_scale=2.0**10, growth_interval=3, min_scale=1.0,
                              max_scale=2.0**20)
    state = ls.init()
    scale = torch.full((), 2.0**10)
    tracker = torch.zeros((), dtype=torch.int32)
    for i, finite in enumerate(script):
        state = ls.update(state, jnp.asarray(finite))
        torch._amp_update_scale_(scale, tracker, torch.full((), 0.0 if finite else 1.0),
                                 2.0, 0.5, 3)
        assert (float(state.scale), int(state.good_steps)) == (scale.item(), tracker.item()), i


def test_state_survives_flatten_unflatten_jit_and_keeps_its_floor(strict_dtypes):
    ls = P.dynamic_loss_scale(init_scale=8.0, min_scale=4.0, growth_interval=5)
    state = ls.init()
    for finite in (F, F, N):  # 8 -> 8 (good 1) -> 8 (good 2) -> max(8 * 0.5, 4) = 4, skipped
        state = ls.update(state, jnp.asarray(finite))
    assert _as_tuple(state) == (4.0, 0, True, 1)

    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == len(P.LossScaleState._fields) == 4  # every field is a leaf
    rebuilt = jax.tree.unflatten(treedef, leaves)
    through_jit = jax.jit(lambda s: s)(state)
    for s in (rebuilt, through_jit):
        assert isinstance(s, P.LossScaleState) and _bits(s) == _bits(state)
        assert [a.dtype for a in s] == [jnp.float32, jnp.int32, jnp.bool_, jnp.int32]
    # The floor lives in `ls`, not in a field a flatten could drop: one more overflow after the
    # jit boundary stays at max(4 * 0.5, 4) = 4. (jmp's DynamicLossScale keeps min_loss_scale
    # as a field but leaves it out of tree_flatten, so after unflatten its floor is back to 1
    # and the same overflow would give 2; jmp/_src/loss_scale.py, tree_unflatten.)
    after = jax.jit(ls.update)(through_jit, jnp.asarray(N))
    assert _as_tuple(after) == (4.0, 0, True, 2)


def test_update_vmaps_over_a_batch_of_states(strict_dtypes):
    # Two independent scales, both at 4 with good_steps 2 (interval 3): a finite step grows the
    # first to 8; a non-finite step backs the second off to 2.
    ls = P.dynamic_loss_scale(init_scale=4.0, growth_interval=3)
    one = ls.init()._replace(good_steps=jnp.asarray(2, jnp.int32))
    both = jax.tree.map(lambda a: jnp.stack([a, a]), one)
    out = jax.vmap(ls.update)(both, jnp.asarray([F, N]))
    assert out.scale.tolist() == [8.0, 2.0] and out.skipped_total.tolist() == [0, 1]


@pytest.mark.parametrize("compute_dtype, scale, expected", [
    pytest.param(jnp.float16, 1.0, 0.0,     # 2**-26 < 2**-25 (half the smallest subnormal) -> 0
                 marks=pytest.mark.float16),
    pytest.param(jnp.float16, 2.0**15, 2.0**-26,  # scaled: 2**-11 in float16, / 2**15 in float32
                 marks=pytest.mark.float16),
    (jnp.bfloat16, 1.0, 2.0**-26),          # bfloat16 has float32's exponent range
    (jnp.float32, 1.0, 2.0**-26),
], ids=["float16-unscaled", "float16-scale2^15", "bfloat16-unscaled", "float32"])
def test_small_gradient_underflows_in_float16_unless_scaled(strict_dtypes, compute_dtype, scale,
                                                            expected):
    # loss = c * w * x with c = 2**-14, x = 2**-12, w = 1: dL/dw = c * x = 2**-26.
    # Backward in the compute dtype: cotangent scale * c, then times x. Unscaled in float16:
    # 2**-14 (the smallest normal) times 2**-12 = 2**-26, which rounds to 0 (the smallest
    # subnormal is 2**-24). Scaled by 2**15: 2 * 2**-12 = 2**-11, exact, and 2**-11 / 2**15 =
    # 2**-26 exactly in float32.
    def loss_fn(params, batch):
        return jnp.sum(params["w"] * batch["x"]) * 2.0**-14

    seen = []
    def spy(params, batch):
        seen.append((params["w"].dtype, batch["x"].dtype, batch["y"].dtype))
        return loss_fn(params, batch)

    f = P.scaled_value_and_grad(spy, compute_dtype=compute_dtype)
    params = {"w": jnp.ones((1,), jnp.float32)}
    batch = {"x": np.full((1,), 2.0**-12, np.float32), "y": np.zeros((1,), np.int32)}
    loss, grads = jax.jit(f)(params, batch, jnp.float32(scale))
    assert seen == [(compute_dtype, compute_dtype, jnp.int32)]  # labels keep their dtype
    assert loss.dtype == jnp.float32 and grads["w"].dtype == jnp.float32
    assert float(grads["w"][0]) == expected


@pytest.mark.float16
def test_a_custom_value_and_grad_differentiates_only_what_it_chooses(strict_dtypes):
    # A stand-in for funcgrad.train.masks.value_and_grad_trainable: differentiate "w" only, "b" is a
    # constant with a zero gradient. loss = sum(w * x) + b, x = [3, 4]: dL/dw = [3, 4] exactly
    # after scaling by 2**10 in float16 ([3072, 4096], exact) and unscaling; dL/db = 0 / 2**10.
    def only_w(fn, has_aux):
        def f(params, *args):
            (value, aux), g = jax.value_and_grad(
                lambda w: fn({"w": w, "b": params["b"]}, *args), has_aux=has_aux)(params["w"])
            return (value, aux), {"w": g, "b": jnp.zeros_like(params["b"])}
        return f

    loss_fn = lambda p, b: jnp.sum(p["w"] * b["x"]) + p["b"]
    f = P.scaled_value_and_grad(loss_fn, compute_dtype=jnp.float16, value_and_grad=only_w)
    params = {"w": jnp.zeros((2,), jnp.float32), "b": jnp.ones((), jnp.float32)}
    loss, grads = jax.jit(f)(params, {"x": np.array([3.0, 4.0], np.float32)}, jnp.float32(2**10))
    assert float(loss) == 1.0 and grads["w"].tolist() == [3.0, 4.0] and float(grads["b"]) == 0.0


def _linear_loss(params, batch):
    return jnp.sum(params["w"] * batch["x"])  # dL/dw = x


@pytest.mark.float16
def test_overflowing_step_is_skipped_and_leaves_state_bit_identical():
    # float16 compute, scale 64, Adam. dL/dw = x, so the scaled float16 gradient is 64 * x.
    #  step 1: x = [1000, 1] -> [64000, 64]: finite (float16's max is 65504), applied.
    #  step 2: x = [2000, 1] -> 128000 overflows to inf: skipped, scale 64 * 0.5 = 32.
    #  step 3: x = [2000, 1] at scale 32 -> [64000, 32]: finite, applied with the true [2000, 1].
    tx = optax.adam(1e-2)
    ls = P.dynamic_loss_scale(init_scale=64.0, growth_interval=1000)
    step = make_train_step(fg.mixed_precision(_linear_loss, jnp.float16, loss_scale=ls), tx)
    state0 = step.init({"w": jnp.ones((2,), jnp.float32)})
    small = {"x": np.array([1000.0, 1.0], np.float32)}
    large = {"x": np.array([2000.0, 1.0], np.float32)}

    state1, m1 = step(state0, small)
    assert (float(m1["loss"]), int(m1["skipped"])) == (1001.0, 0)  # 1*1000 + 1*1 in float16
    state2, m2 = step(state1, large)
    assert (int(m2["skipped"]), int(m2["skipped_total"])) == (1, 1)
    assert float(m2["loss_scale"]) == 64.0 and not np.isfinite(float(m2["grad_norm"]))
    assert _bits(state2.params) == _bits(state1.params)
    assert _bits(state2.opt_state) == _bits(state1.opt_state)  # Adam's count included
    assert int(state2.step) == 2  # step calls, skipped ones included; 2 - 1 skipped applied
    assert _as_tuple(state2.loss_scale) == (32.0, 0, True, 1)

    state3, m3 = step(state2, large)
    assert (int(m3["skipped"]), int(m3["skipped_total"]), int(state3.step)) == (0, 1, 3)
    assert float(m3["grad_norm"]) == float(np.float32(np.hypot(2000.0, 1.0)))
    # Second method: plain optax on the true gradients [1000, 1] then [2000, 1] in float32.
    # Same float32 operations on the same inputs (bit-identical on CPU); 1 ulp because the two
    # programs are compiled separately and XLA may fuse a*b + c into one FMA in only one.
    ref_params, ref_opt = {"w": jnp.ones((2,), jnp.float32)}, tx.init({"w": jnp.ones((2,))})
    for g in ([1000.0, 1.0], [2000.0, 1.0]):
        upd, ref_opt = jax.jit(tx.update)({"w": jnp.asarray(g, jnp.float32)}, ref_opt)
        ref_params = optax.apply_updates(ref_params, upd)
    np.testing.assert_array_max_ulp(state3.params["w"], ref_params["w"], maxulp=1)


@pytest.mark.float16
def test_train_state_with_its_loss_scale_survives_flatten_unflatten_and_jit():
    # step.init(params) keeps the LossScaleState of ls in TrainState.loss_scale:
    # its four scalars are leaves of the TrainState, so flatten/unflatten and a jit boundary
    # keep them bit for bit, and the step carries on from them. Scale 64, x = 2000: the scaled
    # float16 gradient 128000 overflows (max 65504), skipped, scale 32. Then from each rebuilt
    # state: 32 * 2000 = 64000 (exact in float16, spacing 32 there), unscaled to 2000; SGD with
    # lr 0.1 from w = 1: 1 - 0.1 * 2000 = -199 (0.1f * 2000 rounds to 200 in float32).
    tx = optax.sgd(0.1)
    ls = P.dynamic_loss_scale(init_scale=64.0, growth_interval=1000)
    step = make_train_step(fg.mixed_precision(_linear_loss, jnp.float16, loss_scale=ls), tx)
    batch = {"x": np.array([2000.0], np.float32)}
    state, m = step(step.init({"w": jnp.ones((1,), jnp.float32)}), batch)
    assert int(m["skipped"]) == 1 and _as_tuple(state.loss_scale) == (32.0, 0, True, 1)

    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == (len(jax.tree.leaves((state.params, state.opt_state, state.step)))
                           + len(P.LossScaleState._fields))  # the loss scale's 4 are leaves
    for s in (jax.tree.unflatten(treedef, leaves), jax.jit(lambda s: s)(state)):
        assert isinstance(s, TrainState) and isinstance(s.loss_scale, P.LossScaleState)
        assert _bits(s) == _bits(state)
        new, m = step(s, batch)
        assert (int(m["skipped"]), float(m["loss_scale"])) == (0, 32.0)
        assert new.params["w"].tolist() == [-199.0]
        assert _as_tuple(new.loss_scale) == (32.0, 1, False, 1)


@pytest.mark.float16
def test_nan_in_the_batch_is_skipped_too():
    # A NaN input makes the gradient NaN at any scale: the step is skipped and the scale backs
    # off (64 -> 32), the params stay as they were.
    tx = optax.sgd(0.1)
    ls = P.dynamic_loss_scale(init_scale=64.0)
    step = make_train_step(fg.mixed_precision(_linear_loss, jnp.float16, loss_scale=ls), tx)
    state = step.init({"w": jnp.ones((2,), jnp.float32)})
    new, m = step(state, {"x": np.array([np.nan, 1.0], np.float32)})
    assert int(m["skipped"]) == 1 and float(new.loss_scale.scale) == 32.0
    assert _bits(new.params) == _bits(state.params)


@pytest.mark.parametrize("compute_dtype",
                         [pytest.param(jnp.float16, marks=pytest.mark.float16), jnp.bfloat16],
                         ids=["float16", "bfloat16"])
def test_clipping_sees_the_unscaled_gradient(compute_dtype):
    # dL/dw = x = [3, 4], global norm 5 (3-4-5). Scale 2**10: the backward holds [3072, 4096]
    # (exact in float16 and bfloat16: 3 and 1 times a power of two), unscaled to [3, 4]
    # exactly. Clip to 1: [3, 4] / 5 = [0.6, 0.8]; SGD with lr 1 from w = 0 gives
    # [-0.6, -0.8]. Clipping the *scaled* gradient (norm 5120) and unscaling afterwards
    # would give [0.6, 0.8] / 1024 instead.
    tx = optax.chain(fg.clip_by_global_norm(1.0), optax.sgd(1.0))
    ls = P.dynamic_loss_scale(init_scale=2.0**10)
    step = make_train_step(fg.mixed_precision(_linear_loss, compute_dtype, loss_scale=ls), tx)
    state = step.init({"w": jnp.zeros((2,), jnp.float32)})
    new, m = step(state, {"x": np.array([3.0, 4.0], np.float32)})
    assert float(m["grad_norm"]) == 5.0 and float(m["loss_scale"]) == 2.0**10
    # Second method: optax's clipping of the true gradient, then the same SGD step (same ops;
    # 1 ulp for a separately compiled program, as above).
    true = {"w": jnp.array([3.0, 4.0], jnp.float32)}
    clipped, _ = optax.clip_by_global_norm(1.0).update(true, optax.EmptyState())
    np.testing.assert_array_max_ulp(new.params["w"], -clipped["w"], maxulp=1)
    # And by hand: float32's spacing near 0.6-0.8 is 6e-8, so 1e-7 allows one rounding.
    np.testing.assert_allclose(new.params["w"], [-0.6, -0.8], rtol=0, atol=1e-7)
    wrong = np.array([-0.6, -0.8]) / 1024
    assert not np.allclose(new.params["w"], wrong, rtol=0.5)


def test_float32_compute_without_loss_scale_equals_the_plain_step():
    # compute_dtype float32 and no loss scale (the scaled_value_and_grad path at scale 1): the
    # same computation as the plain make_train_step.
    # Same float32 operations (bit-identical on CPU); 1 ulp because the two programs are
    # compiled separately and XLA may fuse a*b + c into one FMA in only one of them.
    from funcgrad.demo.mlp import mlp_apply, mlp_init, softmax_cross_entropy
    params = mlp_init(jax.random.key(0), (4, 8, 3))
    x = np.asarray(jax.random.normal(jax.random.key(1), (16, 4)), np.float32)
    batch = {"x": x, "y": np.arange(16, dtype=np.int32) % 3}
    loss_fn = lambda p, b: softmax_cross_entropy(mlp_apply(p, b["x"]), b["y"])
    tx = optax.adam(1e-2)
    ours = make_train_step(fg.mixed_precision(loss_fn, jnp.float32), tx)
    theirs = make_train_step(loss_fn, tx)
    s1, m1 = ours(ours.init(params), batch)
    s2, m2 = theirs(theirs.init(params), batch)
    assert set(m1) == set(m2) == {"loss", "grad_norm", "skipped"}
    assert s1.loss_scale is None and int(s1.step) == 1
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_array_max_ulp(a, b, maxulp=1)


def test_bfloat16_step_trains_float32_master_params(key):
    # Ten full-batch Adam steps on a separable toy problem lower the loss; the master params
    # stay float32 and the metrics have the documented dtypes.
    from funcgrad.demo.mlp import mlp_apply, mlp_init, softmax_cross_entropy
    params = mlp_init(key, (2, 16, 2))
    x = np.asarray(jax.random.normal(jax.random.key(1), (64, 2)), np.float32)
    batch = {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}
    loss_fn = lambda p, b: softmax_cross_entropy(mlp_apply(p, b["x"]).astype(jnp.float32), b["y"])
    tx = optax.adam(3e-2)
    ls = P.dynamic_loss_scale()
    step = make_train_step(fg.mixed_precision(loss_fn, jnp.bfloat16, loss_scale=ls), tx)
    state = step.init(params)
    losses = []
    for _ in range(10):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {k: v.dtype for k, v in m.items()} == {
        "loss": jnp.float32, "grad_norm": jnp.float32, "loss_scale": jnp.float32,
        "skipped": jnp.int32, "skipped_total": jnp.int32}
    assert int(state.step) == 10 and int(m["skipped_total"]) == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(growth_factor=1.0), "growth_factor must be > 1"),
    (dict(backoff_factor=1.5), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), "backoff_factor must be positive"),
    (dict(growth_interval=0), "growth_interval must be a positive int"),
    (dict(growth_interval=2.5), "growth_interval must be a positive int"),
    (dict(min_scale=2.0**16), "min_scale <= init_scale <= max_scale"),
    (dict(max_scale=float("inf")), "max_scale must be positive and finite"),
    (dict(init_scale="big"), "init_scale must be a number"),
], ids=["growth", "backoff-high", "backoff-zero", "interval-zero", "interval-float", "order",
        "max-inf", "not-a-number"])
def test_bad_hyperparameters_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        P.dynamic_loss_scale(**kwargs)


def test_update_needs_one_bool_flag():
    ls = P.dynamic_loss_scale()
    with pytest.raises(ValueError, match="grads_finite must be a bool of shape"):
        ls.update(ls.init(), jnp.asarray([True, False]))
    with pytest.raises(ValueError, match="all_finite"):
        ls.update(ls.init(), jnp.float32(1.0))


def test_all_finite():
    assert bool(P.all_finite({"a": jnp.ones(3), "b": [jnp.arange(2), jnp.zeros((2, 2))]}))
    assert not bool(P.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    assert not bool(jax.jit(P.all_finite)([jnp.array(jnp.nan)]))
    assert bool(P.all_finite({}))


def test_errors_name_what_is_wrong():
    tx = optax.sgd(0.1)
    with pytest.raises(TypeError, match="compute_dtype must be a floating dtype"):
        make_train_step(fg.mixed_precision(_linear_loss, jnp.int32), tx)
    ls = P.dynamic_loss_scale()
    scaled = fg.mixed_precision(_linear_loss, jnp.bfloat16, loss_scale=ls)
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        make_train_step(scaled, optax.chain(fg.clip_by_global_norm(0.0), tx))
    with pytest.raises(ValueError, match=r"funcgrad.zero_nonfinite\(\) and the loss has "
                                         "funcgrad.mixed_precision's loss scale"):
        make_train_step(scaled, optax.chain(fg.zero_nonfinite(), tx))
    # A loss scale where it changes nothing (float32 gradients do not flush to zero at 6e-8).
    with pytest.raises(ValueError, match="loss scale with compute dtype float32 changes "
                                         "nothing"):
        fg.mixed_precision(_linear_loss, jnp.float32, loss_scale=ls)
    with pytest.raises(ValueError, match="already has a precision"):
        fg.mixed_precision(scaled, jnp.bfloat16)
    with pytest.raises(TypeError, match="loss_scale must be a LossScale.*got function"):
        fg.mixed_precision(_linear_loss, jnp.bfloat16, loss_scale=P.dynamic_loss_scale)


@pytest.mark.float16
def test_float16_errors_name_what_is_wrong():
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((2,), jnp.float32)}
    batch = {"x": np.ones((2,), np.float32)}
    half_step = make_train_step(fg.mixed_precision(_linear_loss, jnp.float16), tx)
    with pytest.raises(TypeError, match=r"params\['w'\] is float16.*float32 master params"):
        half_step(half_step.init({"w": jnp.ones((2,), jnp.float16)}), batch)
    ls = P.dynamic_loss_scale()
    step = make_train_step(fg.mixed_precision(_linear_loss, jnp.float16, loss_scale=ls), tx)
    with pytest.raises(ValueError, match="no loss-scale state"):
        step(half_step.init(params), batch)
    vector_loss = make_train_step(
        fg.mixed_precision(lambda p, b: p["w"] * b["x"], jnp.float16, loss_scale=ls), tx)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        vector_loss(vector_loss.init(params), batch)


def test_cast_floating_refuses_an_integer_dtype():
    # float -> int32 would truncate 2.7 to 2 silently.
    with pytest.raises(TypeError, match="cast_floating: dtype must be a floating dtype"):
        P.cast_floating({"x": jnp.array([2.7])}, jnp.int32)
