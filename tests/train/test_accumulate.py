"""Gradient accumulation: equal to the full-batch gradient, tail policies, optax.MultiSteps.

Concept 12 (article A §3.3). The reference for every accumulated gradient is a second method:
``jax.grad`` of the mean loss over the same examples concatenated into one batch, at the same
params. Both are float32 sums of the same per-example terms in different orders, so they agree
to a few float32 ulps (eps = 1.2e-7); the issue's bound, 1e-6 relative in the global L2 norm,
leaves room for about eight.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcgrad as fg
from funcgrad.train.accumulate import accumulate_grads, make_accumulating_step, stack_microbatches
from funcgrad.train.masks import trainable_mask, value_and_grad_trainable
from funcgrad.train.step import make_train_step

REL = 1e-6  # see the module docstring


def per_example_loss(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(fg.mlp_apply(params, batch["x"]),
                                                           batch["y"])


def mean_loss(params, batch):
    return per_example_loss(params, batch).mean()


# The second method, jitted once (eager dispatch of every op would dominate the suite's time).
full_value_and_grad = jax.jit(jax.value_and_grad(mean_loss))
full_grad = jax.jit(jax.grad(mean_loss))


def _examples(n, features=6, classes=3, seed=1):
    # NumPy draws: jax.random would compile its generator anew for every n.
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, features), dtype=np.float32),
            "y": rng.integers(0, classes, n).astype(np.int32)}


def _split(batch, sizes):
    """Consecutive micro-batches of the given sizes."""
    bounds = np.cumsum([0, *sizes])
    return [{k: v[a:b] for k, v in batch.items()} for a, b in zip(bounds[:-1], bounds[1:])]


def _concat(microbatches):
    return {k: np.concatenate([mb[k] for mb in microbatches]) for k in microbatches[0]}


def _rel_err(tree, ref):
    diff = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                        tree, ref)
    return float(fg.global_norm(diff) / fg.global_norm(ref))


def _params():
    return fg.mlp_init(jax.random.key(0), (6, 8, 3))


def _recording(tx, calls):
    """`tx`, and each call of its update appends (grads, params) to `calls` from the device."""
    def update(grads, state, params=None):
        jax.debug.callback(lambda g, p: calls.append(jax.tree.map(np.asarray, (g, p))),
                           grads, params, ordered=True)
        return tx.update(grads, state, params)
    return optax.GradientTransformation(tx.init, update)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# --- accumulate_grads --------------------------------------------------------------------------

def test_hand_example_weights_each_micro_batch_by_its_count(strict_dtypes):
    # loss_i = (w x_i)^2 / 2 with w = 1 and x = (1, 2, 3): losses (0.5, 2, 4.5), mean 7/3;
    # dloss_i/dw = w x_i^2 = (1, 4, 9), mean 14/3. Micro-batches (1, 2) and (3,), the second
    # padded with a copy of its row and masked. The scan sums 1 + 4 = 5, then + 9 = 14 (exact
    # in float32) and divides once by N = 3, so the result is float32(14)/float32(3) exactly.
    # PyTorch's loss/accum_steps habit would give the mean of the micro-batch means,
    # ((1 + 4)/2 + 9)/2 = 5.75: the single example of the short micro-batch counts 1.5 times.
    def loss_fn(params, batch):
        return 0.5 * (params["w"] * batch["x"]) ** 2

    mbs = stack_microbatches([{"x": np.float32([1, 2])}, {"x": np.float32([3])}])
    np.testing.assert_array_equal(mbs.data["x"], [[1, 2], [3, 3]])
    np.testing.assert_array_equal(mbs.mask, [[True, True], [True, False]])
    acc = jax.jit(lambda p, b: accumulate_grads(loss_fn, p, b))({"w": jnp.float32(1.0)}, mbs)
    assert float(acc.grads["w"]) == np.float32(14) / np.float32(3) != 5.75
    assert float(acc.loss) == np.float32(7) / np.float32(3)  # 0.5 + 2 + 4.5 = 7, exact
    assert int(acc.count) == 3


@pytest.mark.parametrize("sizes", [[4, 4, 4, 4], [5, 3, 7, 1], [16]],
                         ids=["equal_4x4", "unequal_5_3_7_1", "one_micro_batch"])
def test_accumulated_grads_equal_the_full_batch_grads(sizes, strict_dtypes):
    params, batch = _params(), _examples(sum(sizes))
    mbs = stack_microbatches(_split(batch, sizes))
    acc = jax.jit(lambda p, b: accumulate_grads(per_example_loss, p, b))(params, mbs)
    loss, grads = full_value_and_grad(params, batch)
    assert _rel_err(acc.grads, grads) <= REL
    assert float(acc.loss) == pytest.approx(float(loss), rel=REL)
    assert int(acc.count) == sum(sizes)
    assert jax.tree.map(jnp.result_type, acc.grads) == jax.tree.map(jnp.result_type, params)


_accumulate_jit = jax.jit(lambda p, b, m: accumulate_grads(per_example_loss, p, b, mask=m))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_any_partition_gives_the_full_batch_grads(sizes):
    # Any split of up to 36 examples into up to 6 micro-batches of 1..6. One compiled shape:
    # 6 micro-batches of 6 rows, those beyond len(sizes) copies with every row masked out.
    params, batch = _params(), _examples(sum(sizes), seed=len(sizes))
    parts = _split(batch, sizes)
    mbs = stack_microbatches(parts + parts[-1:] * (6 - len(parts)), size=6)
    mask = mbs.mask.copy()
    mask[len(parts):] = False
    acc = _accumulate_jit(params, mbs.data, mask)
    assert int(acc.count) == sum(sizes)
    assert _rel_err(acc.grads, full_grad(params, batch)) <= REL


def test_no_mask_means_every_row_is_real_and_an_empty_mask_gives_nan():
    params, batch = _params(), _examples(12)
    stacked = {k: v.reshape(3, 4, *v.shape[1:]) for k, v in batch.items()}
    acc = jax.jit(lambda p, b: accumulate_grads(per_example_loss, p, b))(params, stacked)
    assert _rel_err(acc.grads, full_grad(params, batch)) <= REL
    assert int(acc.count) == 12
    # No real example: sum 0 over count 0, and 0/0 is NaN, loud rather than a silent zero step.
    empty = _accumulate_jit(params, stacked, np.zeros((3, 4), bool))
    assert np.isnan(float(empty.loss)) and np.isnan(np.asarray(empty.grads[0]["w"])).all()


def test_half_precision_grads_are_summed_in_float32_and_returned_in_their_dtype():
    # bfloat16 has 8 significant bits: 256 + 1 rounds back to 256. Per-example gradients of
    # loss_i = w * x_i are x_i; with x = (256, 1, 1, 1) in four micro-batches the float32 sum
    # is 259 and the mean 64.75. In [64, 128) bfloat16's spacing is 2^6 / 2^7 = 0.5, so 64.75
    # is a tie between 64.5 (last mantissa bit 1) and 65.0 (bit 0): round to even gives 65.
    # A bfloat16 accumulator would round 256 + 1 = 257 (spacing 2 there, a tie) to the even
    # 256, stay at 256, and give 256/4 = 64.
    def loss_fn(params, batch):
        return params["w"] * batch["x"]

    params = {"w": jnp.bfloat16(1.0)}
    stacked = {"x": jnp.array([[256], [1], [1], [1]], jnp.bfloat16)}
    acc = accumulate_grads(loss_fn, params, stacked)
    assert acc.grads["w"].dtype == jnp.bfloat16 and float(acc.grads["w"]) == 65.0


def test_temp_memory_does_not_grow_with_the_number_of_micro_batches():
    # Compiled temporary bytes (XLA's buffer assignment) for 4 and 16 micro-batches of 32: the
    # scan holds one micro-batch's activations and one accumulator, so the two are equal; the
    # full batch of the same 128 and 512 examples grows with the examples, which shows that
    # the measurement sees activations at all.
    params = fg.mlp_init(jax.random.key(0), (64, 128, 10))
    temps = {}
    for num in (4, 16):
        batch = _examples(32 * num, features=64, classes=10)
        stacked = {k: v.reshape(num, 32, *v.shape[1:]) for k, v in batch.items()}
        mask = np.ones((num, 32), bool)
        acc = jax.jit(lambda p, b, m: accumulate_grads(per_example_loss, p, b, mask=m))
        full = jax.jit(jax.grad(mean_loss))
        temps[num] = (acc.lower(params, stacked, mask).compile().memory_analysis(),
                      full.lower(params, batch).compile().memory_analysis())
    (acc4, full4), (acc16, full16) = temps[4], temps[16]
    assert acc16.temp_size_in_bytes <= acc4.temp_size_in_bytes
    assert full16.temp_size_in_bytes > 2 * full4.temp_size_in_bytes


# --- make_train_step(fg.accumulate(loss, K)): tail policies, one optimizer run per update -----

SIZES = [4, 4, 4, 4, 3]  # five micro-batches, the last one short; accumulate=2 leaves one over


@pytest.mark.parametrize("tail, updates, dropped", [
    # 5 micro-batches in groups of 2: (0, 1), (2, 3) and the tail (4,) of 3 examples.
    ("apply", 3, 0),
    ("drop", 2, 3),
], ids=["apply", "drop"])
def test_tail_policy_and_one_inner_update_per_applied_update(tail, updates, dropped):
    params, batch = _params(), _examples(sum(SIZES))
    microbatches = _split(batch, SIZES)
    mbs = stack_microbatches(microbatches)
    calls = []
    tx = _recording(optax.sgd(0.5), calls)
    step = make_train_step(fg.accumulate(per_example_loss, 2, tail=tail), tx)
    state, metrics = step(step.init(params), mbs)
    jax.effects_barrier()

    groups = [_concat(microbatches[0:2]), _concat(microbatches[2:4]), microbatches[4]][:updates]
    assert len(calls) == updates == int(state.step)  # the inner optimizer ran once per update
    assert list(np.asarray(metrics["examples"])) == [8, 8, 3][:updates]
    assert int(metrics["dropped_examples"]) == dropped
    ref = params
    for (grads, used_params), group, loss in zip(calls, groups, metrics["loss"]):
        # Second method at the very params the step used: the full-batch gradient of the group.
        ref_loss, ref_grads = full_value_and_grad(used_params, group)
        assert _rel_err(grads, ref_grads) <= REL
        assert float(loss) == pytest.approx(float(ref_loss), rel=REL)
        ref = jax.tree.map(lambda p, g: p - 0.5 * g, ref, full_grad(ref, group))
    # The hand loop of full-batch SGD steps over the same groups: a few float32 ulps apart.
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_drop_with_fewer_micro_batches_than_accumulate_changes_nothing():
    params, batch = _params(), _examples(7)
    mbs = stack_microbatches(_split(batch, [4, 3]))
    tx = optax.adam(1e-2)
    step = make_train_step(fg.accumulate(per_example_loss, 3, tail="drop"), tx)
    state = step.init(params)
    new, metrics = step(state, mbs)
    assert _bits(new) == _bits(state)  # params, Adam moments, count, step: bit-identical
    assert metrics["loss"].shape == (0,) and int(metrics["dropped_examples"]) == 7  # 4 + 3


def test_adam_step_equals_the_hand_written_full_batch_loop():
    # Second method: jit(value_and_grad + optax update) on each group's examples as one batch.
    params, batch = _params(), _examples(20)
    microbatches = _split(batch, [5, 3, 7, 1, 4])
    mbs = stack_microbatches(microbatches)
    tx = optax.adam(1e-2)
    step = make_train_step(fg.accumulate(per_example_loss, 2), tx)
    state, metrics = step(step.init(params), mbs)
    ref, opt = params, tx.init(params)
    for group in [microbatches[0:2], microbatches[2:4], microbatches[4:]]:
        grads = full_grad(ref, _concat(group))
        updates, opt = tx.update(grads, opt, ref)
        ref = optax.apply_updates(ref, updates)
    # Adam divides by sqrt(v): relative gradient differences of ~1e-7 stay ~1e-7 in the update.
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert list(np.asarray(metrics["examples"])) == [8, 8, 4] and int(state.step) == 3


def test_clipping_applies_once_to_the_mean_gradient():
    # Every example's loss is |p|^2 / 2, so the mean gradient is p = (3, 4), norm 5. Clipped to
    # 0.5 it is (0.3, 0.4); SGD with lr 1 gives (2.7, 3.6). Clipping each micro-batch's gradient
    # instead would give the same here, so the point checked is the reported pre-clip norm 5
    # and one update for 3 micro-batches.
    def loss_fn(params, batch):
        return 0.5 * jnp.sum(params["p"] ** 2) * jnp.ones_like(batch["x"])

    tx = optax.chain(fg.clip_by_global_norm(0.5), optax.sgd(1.0))
    step = make_train_step(fg.accumulate(loss_fn, 3), tx)
    state, metrics = step(step.init({"p": jnp.array([3.0, 4.0])}), {"x": jnp.zeros((3, 2))})
    np.testing.assert_allclose(state.params["p"], [2.7, 3.6], rtol=1e-6)
    assert metrics["grad_norm"].shape == (1,) and float(metrics["grad_norm"][0]) == 5.0


def test_loss_scaled_accumulation_equals_the_unscaled_one():
    # Second method: the same accumulating bfloat16 step without a loss scale. Multiplying the
    # loss by a power of two (2**10) multiplies every bfloat16 cotangent by it exactly (no
    # overflow or subnormal here) and the float32 division undoes it exactly, so the updates
    # agree to float rounding; the scale grows by 2 after growth_interval = 2 finite updates
    # (PyTorch/jmp convention).
    params, batch = _params(), _examples(20)
    mbs = stack_microbatches(_split(batch, [5, 3, 7, 1, 4]))
    tx = optax.adam(1e-2)
    scale = fg.dynamic_loss_scale(init_scale=2.0**10, growth_interval=2)
    half = fg.accumulate(per_example_loss, 2)
    scaled = make_train_step(fg.mixed_precision(half, jnp.bfloat16, loss_scale=scale), tx)
    plain = make_train_step(fg.mixed_precision(half, jnp.bfloat16), tx)
    s_state, s_metrics = scaled(scaled.init(params), mbs)
    p_state, p_metrics = plain(plain.init(params), mbs)
    for a, b in zip(jax.tree.leaves(s_state.params), jax.tree.leaves(p_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s_metrics["grad_norm"], p_metrics["grad_norm"], rtol=1e-6)
    # 3 updates (2 groups of 2 and the tail of 1), all finite: scale 2**10, 2**10, 2**11.
    assert list(np.asarray(s_metrics["loss_scale"])) == [2.0**10, 2.0**10, 2.0**11]
    assert list(np.asarray(s_metrics["skipped"])) == [0, 0, 0]


def test_an_overflowing_micro_batch_skips_its_whole_update_and_backs_off_once():
    # loss_i = (w * x_i)^2 with w = 1; micro-batch 1 holds x = 3e17: its loss 9e34 is finite in
    # bfloat16 (float32's range, max ~3.4e38), but scaled by 2**15 it is ~2.9e39 = inf, and so
    # is its scaled gradient 2**15 * 2 * w * x^2. Update 0 (micro-batches 0, 1) is skipped
    # whole: params and optimizer state bit-identical, scale halved once to 2**14. Update 1
    # (micro-batches 2, 3, x = 1) applies: mean gradient 2 * w * x^2 = 2, SGD lr 0.1 -> w = 0.8.
    def loss_fn(params, batch):
        return (params["w"] * batch["x"]) ** 2

    tx = optax.sgd(0.1)
    scale = fg.dynamic_loss_scale(init_scale=2.0**15)
    step = make_train_step(
        fg.accumulate(fg.mixed_precision(loss_fn, jnp.bfloat16, loss_scale=scale), 2), tx)
    x = np.array([[1.0], [3e17], [1.0], [1.0]], np.float32)
    state0 = step.init({"w": jnp.ones((), jnp.float32)})
    state, metrics = step(state0, {"x": x[:2]})
    assert _bits(state.params) == _bits(state0.params)
    assert _bits(state.opt_state) == _bits(state0.opt_state)
    assert list(np.asarray(metrics["skipped"])) == [1]
    assert float(state.loss_scale.scale) == 2.0**14 and int(state.loss_scale.skipped_total) == 1
    assert np.isfinite(metrics["loss"][0]) and not np.isfinite(metrics["grad_norm"][0])
    state, metrics = step(state, {"x": x[2:]})
    np.testing.assert_allclose(state.params["w"], 0.8, rtol=1e-6)
    assert list(np.asarray(metrics["skipped"])) == [0]


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float16, marks=pytest.mark.float16),
                                   jnp.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_accumulation_is_close_to_the_float32_full_batch(dtype):
    # Second method: the float32 full-batch gradient. The forward and backward pass run in the
    # half dtype (eps 2**-10 for float16, 2**-7 for bfloat16), so the gradient agrees to a few
    # eps in relative global norm; accumulating in float32 adds no further error. The update is
    # SGD with lr 1, so params moved by -grads: recover the gradient from the params. The
    # loss is taken on float32 logits (as PyTorch's autocast does) and the scale is 2**8, far
    # from float16 overflow for these O(1) gradients, so the update is applied.
    def loss_fn(params, batch):
        logits = fg.mlp_apply(params, batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    params, batch = _params(), _examples(24)
    mbs = stack_microbatches(_split(batch, [8, 8, 8]))
    tx = optax.sgd(1.0)
    scale = fg.dynamic_loss_scale(init_scale=2.0**8)
    step = make_train_step(
        fg.accumulate(fg.mixed_precision(loss_fn, dtype, loss_scale=scale), 3), tx)
    state, metrics = step(step.init(params), mbs)
    assert int(metrics["skipped"][0]) == 0
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.params))
    grads = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                         params, state.params)
    eps = float(jnp.finfo(dtype).eps)
    err = _rel_err(grads, full_grad(params, batch))
    # ... and it did run in the half dtype: in float32 the same step is ~1e-7 from it.
    assert 1e-5 < err < 8 * eps


def test_detect_anomaly_names_the_micro_batch_and_the_line():
    # loss_i = sqrt(w * x_i): finite for x_i >= 0, NaN for x_i < 0 (sqrt of a negative). Six
    # micro-batches of 2 in groups of 2: the only negative x sits in micro-batch 3, row 1, so
    # update 0 (micro-batches 0, 1) is finite and applied, update 1 (2, 3) is the first NaN
    # one: its report is for micro-batch 1 of that update (3 of the call), forward, sqrt, this
    # file's line, evaluated at the params update 1 started from (w after update 0).
    def loss_fn(params, batch):
        return jnp.sqrt(params["w"] * batch["x"])

    x = np.array([[1.0, 4.0], [1.0, 1.0], [9.0, 1.0], [1.0, -2.0], [1.0, 1.0], [1.0, 1.0]],
                 np.float32)
    tx = optax.sgd(0.1)
    step = fg.detect_anomaly(make_train_step(fg.accumulate(loss_fn, 2), tx))
    state0 = step.init({"w": jnp.ones((), jnp.float32)})
    state, metrics = step(state0, {"x": x})
    report = metrics["anomaly"]
    assert (report.phase, report.primitive) == ("forward", "sqrt")
    assert report.file.endswith("test_accumulate.py")
    assert report.context[0].startswith("micro-batch 1 (0-based) of the 2 of update 1 "
                                        "(micro-batch 3 of the call)")
    # Update 0: d/dw mean(sqrt(w x)) = mean(sqrt(x)) / (2 sqrt(w)) = (1 + 2 + 1 + 1) / 4 / 2
    # = 0.625 at w = 1, so w1 = 1 - 0.1 * 0.625 = 0.9375. Update 1 is skipped (NaN). Update 2
    # (x all ones) has gradient 1 / (2 sqrt(w1)): w2 = w1 - 0.1 * 0.5 / sqrt(w1).
    assert list(np.isfinite(np.asarray(metrics["loss"]))) == [True, False, True]
    w1 = 1 - 0.1 * 0.625
    np.testing.assert_allclose(state.params["w"], w1 - 0.1 * 0.5 / np.sqrt(w1), rtol=1e-6)
    # Without NaN no report, and fit carries a report into its NonFiniteReport.
    _, clean = step(state0, {"x": np.abs(x)})
    assert "anomaly" not in clean
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = fg.fit(step, state0,
                        fg.Batches(x.reshape(-1), np.zeros(12, np.int32), batch_size=2), epochs=1,
                        progress=False)
    assert result.nonfinite.anomaly.primitive == "sqrt"


@pytest.mark.float16
def test_detect_anomaly_under_a_loss_scale_names_the_real_nan_not_an_overflow():
    # Float16, K = 2, one example per micro-batch, w = 1. Update 0 (x = 1, 1): d/dw (w x)^2
    # = 2 times the scale 2**15 is 65536 > 65504, a routine overflow: skipped, scale 2**14.
    # Update 1: micro-batch 2 has x = 100, gradient 2 x^2 w = 2e4, times 2**14 ~ 3.3e8: it
    # overflows float16 too; micro-batch 3 has x = -1, where log(x^2 + x) = log 0 = -inf in
    # the forward pass: a non-finite loss, so update 1 is located, and the report is the real
    # -inf (micro-batch 3, forward, log, this file), not the overflow of micro-batch 2.
    def loss_fn(params, batch):
        return (params["w"] * batch["x"]) ** 2 + jnp.log(batch["x"] ** 2 + batch["x"])

    x = np.array([[1.0], [1.0], [100.0], [-1.0]], np.float32)
    tx = optax.sgd(0.1)
    scale = fg.dynamic_loss_scale(init_scale=2.0**15)
    half = fg.mixed_precision(loss_fn, jnp.float16, loss_scale=scale)
    step = fg.detect_anomaly(make_train_step(fg.accumulate(half, 2), tx))
    _, metrics = step(step.init({"w": jnp.ones(())}), {"x": x})
    assert list(np.asarray(metrics["loss_scale"])) == [2.0**15, 2.0**14]
    report = metrics["anomaly"]
    assert report.context[0].startswith("micro-batch 1 (0-based) of the 2 of update 1")
    assert (report.phase, report.primitive) == ("forward", "log")
    assert report.file.endswith("test_accumulate.py")


def test_step_temp_memory_does_not_grow_with_micro_batches_or_updates():
    params = fg.mlp_init(jax.random.key(0), (64, 128, 10))
    tx = optax.adam(1e-3)
    # One state for every step below: they differ only in K, and K is no part of the state.
    state = make_train_step(fg.accumulate(per_example_loss, 4), tx).init(params)
    temp = {}
    for num, k in [(4, 4), (16, 16), (16, 4), (64, 4)]:
        batch = _examples(32 * num, features=64, classes=10)
        stacked = {key: v.reshape(num, 32, *v.shape[1:]) for key, v in batch.items()}
        step = make_train_step(fg.accumulate(per_example_loss, k), tx)
        temp[num, k] = step.lower(state, stacked).compile().memory_analysis().temp_size_in_bytes
    assert temp[16, 16] <= temp[4, 4]  # one update over 4 or 16 micro-batches
    assert temp[64, 4] <= temp[16, 4]  # 4 or 16 updates in one call


def test_any_update_function_and_differentiation_plug_in():
    # The loop around a caller's own update (as funcgrad.train.step can use it) with a trainable
    # mask: layer 0 frozen, so its gradient is exactly zero and layer 1's equals the full-batch
    # gradient. The update is SGD with lr 1 and reports a metric of its own.
    params, batch = _params(), _examples(11)
    mbs = stack_microbatches(_split(batch, [4, 4, 3]))
    frozen = trainable_mask(params, freeze="0/*")

    def apply_update(state, loss, grads):
        params = jax.tree.map(lambda p, g: p - g, state.params, grads)
        return state._replace(params=params), {"loss": loss,
                                               "w1_norm": jnp.linalg.norm(grads[1]["w"])}

    step = make_accumulating_step(
        per_example_loss, apply_update, accumulate=3,
        value_and_grad=lambda f: value_and_grad_trainable(f, frozen))
    state = fg.TrainState(params, (), jnp.zeros((), jnp.int32))
    new, metrics = step(state, mbs)
    grads = full_grad(params, batch)
    np.testing.assert_array_equal(new.params[0]["w"], params[0]["w"])  # frozen: zero gradient
    # p - (p - g) recovers g up to the rounding of two subtractions: float32 ulps of p (~1).
    np.testing.assert_allclose(params[1]["w"] - new.params[1]["w"], grads[1]["w"],
                               rtol=1e-5, atol=1e-6)
    assert list(np.asarray(metrics["examples"])) == [11] and metrics["w1_norm"].shape == (1,)
    assert float(metrics["w1_norm"][0]) == pytest.approx(float(jnp.linalg.norm(grads[1]["w"])),
                                                         rel=REL)


# --- how optax.MultiSteps differs -------------------------------------------------------------

def test_multisteps_runs_the_inner_update_every_mini_step_and_keeps_the_tail():
    # The PyTorch-style loop with optax.MultiSteps(k=2): one jitted call per micro-batch.
    params, batch = _params(), _examples(20)
    microbatches = _split(batch, [4] * 5)
    calls = []
    multi = optax.MultiSteps(_recording(optax.sgd(0.5), calls), every_k_schedule=2)

    @jax.jit
    def mini_step(params, opt_state, mb):
        updates, opt_state = multi.update(full_grad(params, mb), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    p, opt_state, history = params, multi.init(params), []
    for mb in microbatches:
        p, opt_state = mini_step(p, opt_state, mb)
        history.append(p)
    jax.effects_barrier()
    # 1. The inner optimizer ran on all 5 mini-steps, though only 2 updates were applied: its
    #    result is computed and then discarded by jnp.where on the 3 mini-steps in between.
    assert len(calls) == 5 and int(opt_state.gradient_step) == 2
    # 2. The fifth micro-batch sits in the state: mini_step 1 of 2, its gradient accumulated
    #    (Welford mean of one term: acc = 0 + (g - 0)/1 = g, exact) but never applied; the
    #    params after five mini-steps are bit-identical to those after four.
    assert int(opt_state.mini_step) == 1 and not bool(multi.has_updated(opt_state))
    fifth = full_grad(history[3], microbatches[4])
    for a, b in zip(jax.tree.leaves(opt_state.acc_grads), jax.tree.leaves(fifth)):
        np.testing.assert_array_equal(a, b)
    assert _bits(history[4]) == _bits(history[3])

    # funcgrad's step on the same five micro-batches, one call: 2 + 1 updates, inner optimizer
    # run 3 times, all 20 examples used, nothing left in any state.
    calls.clear()
    tx = _recording(optax.sgd(0.5), calls)
    mbs = stack_microbatches(microbatches)
    step = make_train_step(fg.accumulate(per_example_loss, 2), tx)
    state, metrics = step(step.init(params), mbs)
    jax.effects_barrier()
    assert len(calls) == 3 and int(np.sum(metrics["examples"])) == 20
    # Where both applied the same two updates (equal micro-batches of 4: mean of the two
    # micro-batch means = mean over the 8 examples), the params agree before the tail.
    np.testing.assert_allclose(calls[2][1][0]["w"], history[3][0]["w"], rtol=1e-6, atol=1e-6)


def test_a_mean_loss_is_refused_with_the_fix():
    params, batch = _params(), _examples(8)
    stacked = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"(?s)returned shape \(\), expected shape \(4,\).*fixed:"):
        accumulate_grads(mean_loss, params, stacked)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mask": np.ones((2, 4), np.int32)}, TypeError, "mask must be boolean"),
    ({"mask": np.ones((4, 2), bool)}, ValueError, r"need \(2, 4\)"),
], ids=["int_mask", "transposed_mask"])
def test_mask_errors(kwargs, error, match):
    params, batch = _params(), _examples(8)
    stacked = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in batch.items()}
    with pytest.raises(error, match=match):
        accumulate_grads(per_example_loss, params, stacked, **kwargs)


def test_leaves_with_different_leading_axes_are_named():
    params = _params()
    stacked = {"x": np.zeros((2, 4, 6), np.float32), "y": np.zeros((2, 3), np.int32)}
    with pytest.raises(ValueError, match=r"microbatches\['y'\] has shape \(2, 3\)"):
        accumulate_grads(per_example_loss, params, stacked)


@pytest.mark.parametrize("make, match", [
    (lambda: fg.accumulate(per_example_loss, 0), "accumulate: k must be a positive int"),
    (lambda: fg.accumulate(per_example_loss, 2.0), "accumulate: k must be a positive int"),
    (lambda: fg.accumulate(per_example_loss, 2, tail="keep"),
     r"tail must be one of \('apply', 'drop'\)"),
    (lambda: fg.accumulate(fg.accumulate(per_example_loss, 2), 2), "already accumulates"),
    (lambda: make_train_step(fg.accumulate(per_example_loss, 2),
                             optax.chain(fg.clip_by_global_norm(-1.0), optax.sgd(0.1))),
     "max_norm must be a finite number > 0"),
], ids=["zero", "float", "unknown_tail", "twice", "negative_clip"])
def test_step_argument_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --- learning-rate schedules under accumulation (issue 11, point 7) ----------------------------

def _halving(count):  # lr(c) = 0.1 * 0.5**c over the optimizer's update count c
    return 0.1 * 0.5 ** count


def test_a_schedule_counts_updates_and_the_step_reports_the_rate_applied():
    # 6 micro-batches, accumulate=2: 3 updates at rates 0.1, 0.05, 0.025. (Counted per
    # micro-batch the second and third would be 0.025 and 0.00625.) Second method: the hand
    # loop of full-batch SGD steps over the same groups with those rates.
    params, batch = _params(), _examples(24)
    parts = _split(batch, [4] * 6)
    tx = fg.make_optimizer("sgd", _halving)
    step = make_train_step(fg.accumulate(per_example_loss, 2), tx)
    state, metrics = step(step.init(params), stack_microbatches(parts))
    rates = [0.1, 0.05, 0.025]
    np.testing.assert_allclose(metrics["learning_rate"], rates, rtol=1e-7)
    hand = params
    for u, rate in enumerate(rates):
        grads = full_grad(hand, _concat(parts[2 * u:2 * u + 2]))
        hand = jax.tree.map(lambda p, g, rate=rate: p - rate * g, hand, grads)
    assert _rel_err(state.params, hand) < 1e-5


def test_the_rate_is_reported_wherever_the_state_holds_it():
    params, batch = _params(), _examples(8)
    mbs = stack_microbatches(_split(batch, [4, 4]))
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=_halving)
    frozen = trainable_mask(params, freeze="0/*")
    # A user's own inject_hyperparams, a frozen layer (the freeze wraps the state), and the
    # step without accumulation: the first update's rate, 0.1 in each.
    for step, args in [
            (make_train_step(fg.accumulate(per_example_loss, 2), injected), (mbs,)),
            (make_train_step(fg.accumulate(per_example_loss, 2), injected, trainable=frozen),
             (mbs,)),
            (make_train_step(mean_loss, fg.make_optimizer("adam", _halving)), (batch,))]:
        _, metrics = step(step.init(params), *args)
        np.testing.assert_allclose(np.ravel(metrics["learning_rate"])[0], 0.1, rtol=1e-7)
    # (None of these warns: pytest makes a warning an error.) A constant rate: nothing to
    # report, no "learning_rate" and no warning.
    step = make_train_step(fg.accumulate(per_example_loss, 2), optax.adam(1e-3))
    _, metrics = step(step.init(params), mbs)
    assert "learning_rate" not in metrics


# --- a schedule the step cannot read (issue 24, point 5.1) -------------------------------------

_UNREAD = (r"(?s)schedule that the step cannot read.*opt_state\[{index}\].*no \"learning_rate\""
           r".*optax\.inject_hyperparams\(optax\.sgd\)\(learning_rate=schedule\)")


def test_a_schedule_passed_straight_into_optax_is_said_once_and_still_applied():
    # optax.sgd(schedule) is chain(identity, scale_by_learning_rate(schedule)): its state is
    # (EmptyState(), ScaleByScheduleState(count)), so the count is opt_state[1] (optax's
    # structure, the second method for the path the warning names). The rate itself is
    # computed inside the update and kept nowhere: no "learning_rate" in the metrics.
    params, batch = _params(), _examples(16)
    parts = _split(batch, [4] * 4)
    tx = optax.sgd(optax.linear_schedule(0.1, 0.01, 10))
    step = make_train_step(fg.accumulate(per_example_loss, 2), tx)
    state = step.init(params)
    with pytest.warns(UserWarning, match=_UNREAD.format(index=1)) as caught:
        new, metrics = step(state, stack_microbatches(parts))
        # A second call with another shape traces the step again: it is not said twice.
        step(new, stack_microbatches(parts[:2]))
    assert len([w for w in caught if "cannot read" in str(w.message)]) == 1
    assert caught[0].filename == __file__  # at the user's line, not inside funcgrad or JAX
    assert "learning_rate" not in metrics
    # Training is unaffected: linear_schedule(0.1, 0.01, 10) gives 0.1 at count 0 and
    # 0.1 - 0.009 = 0.091 at count 1 (the count advances per update, one per 2 micro-batches).
    # Second method: plain SGD on the full-batch gradient of each group at those rates.
    hand = params
    for u, rate in enumerate([0.1, 0.091]):
        grads = full_grad(hand, _concat(parts[2 * u:2 * u + 2]))
        hand = jax.tree.map(lambda p, g, rate=rate: p - rate * g, hand, grads)
    assert _rel_err(new.params, hand) < 1e-5


def test_fit_says_so_at_the_users_line_and_a_readable_rate_is_not_warned_about():
    x, y = _examples(16)["x"], _examples(16)["y"]
    # optax.adam(schedule) keeps its count after adam's state: (ScaleByAdamState,
    # ScaleByScheduleState) -> opt_state[1]; without accumulation the same.
    tx = optax.adam(_halving)
    with pytest.warns(UserWarning, match=_UNREAD.format(index=1)) as caught:
        step = make_train_step(mean_loss, tx)
        result = fg.fit(step, step.init(_params()), fg.Batches(x, y, batch_size=8), epochs=1,
                        progress=False)
    assert caught[0].filename == __file__
    assert result.history.step_learning_rate == []
    # The same schedule made readable, both ways the warning names: no warning (an error
    # here), and fit records the two rates, 0.1 * 0.5**0 and 0.1 * 0.5**1.
    for readable in (optax.inject_hyperparams(optax.adam)(learning_rate=_halving),
                     fg.make_optimizer("adam", _halving)):
        step = make_train_step(mean_loss, readable)
        result = fg.fit(step, step.init(_params()), fg.Batches(x, y, batch_size=8),
                        epochs=1, progress=False)
        np.testing.assert_allclose(result.history.step_learning_rate, [0.1, 0.05], rtol=1e-7)


def test_fit_runs_a_scheduled_accumulating_step():
    x, y = _examples(32)["x"], _examples(32)["y"]
    tx = fg.make_optimizer("sgd", _halving)
    step = make_train_step(fg.accumulate(per_example_loss, 2), tx)
    result = fg.fit(step, step.init(_params()), fg.Batches(x, y, batch_size=8),
                    epochs=1, progress=False)
    # 4 batches of 8, 2 per update: 2 updates, the count the schedule saw; the last used 0.05.
    assert len(result.history.step_loss) == 2
    assert int(result.state.opt_state.count) == 2
    assert float(result.state.opt_state.hyperparams["learning_rate"]) == np.float32(0.05)


def test_the_mean_loss_refusal_says_not_to_divide_by_the_micro_batch_count():
    params, batch = _params(), _examples(8)
    stacked = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"(?s)do not divide them.*by the number of\s+"
                                         r"micro-batches.*shrink every gradient"):
        accumulate_grads(lambda p, b: mean_loss(p, b) / 2, params, stacked)
