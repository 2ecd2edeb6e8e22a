"""Host micro-batches: padded, stacked and grouped, with the mask of real rows carried along.

Issue 11, point 8: the mask used to come back beside the stacked arrays, and an accumulation
called without it counted the padding rows as examples.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.train.accumulate import accumulate_grads
from funcgrad.train.microbatches import group_microbatches, stack_microbatches
from funcgrad.train.step import make_train_step


def test_group_microbatches_yields_every_example_once_with_the_short_group_last():
    # 10 examples in micro-batches of 3: sizes 3, 3, 3, 1; groups of 3: (3, 3, 3) and (1,).
    x = np.arange(10, dtype=np.float32)[:, None]
    groups = list(group_microbatches(fg.Batches(x, np.arange(10), batch_size=3).epoch(0), 3))
    assert [g.data["x"].shape for g in groups] == [(3, 3, 1), (1, 3, 1)]
    np.testing.assert_array_equal(groups[1].mask, [[True, False, False]])
    real = np.concatenate([g.data["x"][g.mask] for g in groups])
    np.testing.assert_array_equal(np.sort(real[:, 0]), np.arange(10))


@pytest.mark.parametrize("call, match", [
    (lambda: stack_microbatches([]), "no micro-batches"),
    (lambda: stack_microbatches([{"x": np.zeros((0, 2))}]), "one length >= 1"),
    (lambda: stack_microbatches([{"x": np.zeros((2,)), "y": np.zeros((3,))}]), "one length"),
    (lambda: stack_microbatches([{"x": np.zeros(3)}], size=2), "more than size=2"),
    (lambda: stack_microbatches([{"x": np.zeros(3)}, {"y": np.zeros(3)}]), "structure"),
    (lambda: group_microbatches([], 0), "positive int"),  # at the call, not when iterated
    (lambda: stack_microbatches([{"x": np.zeros(3), "n": 3}]), "scalar leaf"),  # was TypeError
], ids=["none", "empty", "ragged_leaves", "too_big", "structure", "group_zero", "scalar"])
def test_helper_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_group_microbatches_refuses_one_batch():
    # Iterating a dict gives its keys: one batch is not an iterable of micro-batches.
    with pytest.raises(TypeError, match=r"got one dict; iterating it would give its keys"):
        group_microbatches({"x": np.zeros((8, 2))}, 4)
    with pytest.raises(TypeError, match=r"would give its rows"):
        group_microbatches(np.zeros((8, 2)), 4)


def test_padded_micro_batches_carry_their_mask_and_refuse_to_unpack():
    # Issue 11, point 8: `stacked, mask = stack_microbatches(...)` followed by
    # accumulate_grads(loss_fn, params, stacked) counted the padding rows. The stacked arrays
    # and the mask now travel as one Microbatches: passed whole, only real rows count.
    # Hand value: loss_i = w * x_i, x = [1, 2] and [3] (padded with a copy of 3): the mean
    # over the 3 real examples is w * 6 / 3 = 2 at w = 1, its gradient 2 (with the padding
    # row counted it would be 9 / 4 = 2.25).
    loss_fn = lambda p, b: p["w"] * b["x"]
    mbs = stack_microbatches([{"x": np.float32([1, 2])}, {"x": np.float32([3])}])
    acc = jax.jit(lambda p, b: accumulate_grads(loss_fn, p, b))({"w": jnp.float32(1.0)}, mbs)
    assert int(acc.count) == 3
    assert float(acc.loss) == 2.0 and float(acc.grads["w"]) == 2.0
    with pytest.raises(TypeError, match=r"does not unpack.*mbs\.data and mbs\.mask"):
        stacked, mask = stack_microbatches([{"x": np.float32([1, 2])}, {"x": np.float32([3])}])
    with pytest.raises(TypeError, match=r"already carry the mask"):
        accumulate_grads(loss_fn, {"w": jnp.float32(1.0)}, mbs, mask=mbs.mask)
    # The accumulating step takes it whole too: one update over the 3 real examples.
    tx = optax.sgd(1.0)
    step = make_train_step(fg.accumulate(loss_fn, 2), tx)
    state, metrics = step(step.init({"w": jnp.float32(1.0)}), mbs)
    assert int(metrics["examples"][0]) == 3
    assert float(state.params["w"]) == 1.0 - 2.0  # w - lr * 2


def _dropout_loss(params, batch):
    """Per-example dropout: example i's mask is drawn from its own key, batch["key"][i]; the
    bool leaf "use" switches an example's dropout off, the int8 leaf "y" is its label."""
    def one(x, y, key, use):
        keep = jax.random.bernoulli(key, 0.5, x.shape) | ~use
        h = jnp.where(keep, x / jnp.where(use, 0.5, 1.0), 0.0) @ params["w"]
        return optax.softmax_cross_entropy_with_integer_labels(h, y.astype(jnp.int32))
    return jax.vmap(one)(batch["x"], batch["y"], batch["key"], batch["use"])


def test_micro_batches_of_per_example_prng_keys_accumulate_the_full_batch_gradient():
    # Typed PRNG keys (one per example, for dropout) and bool / int8 leaves used to end in
    # JAX's "PRNGKey dtype cannot be converted to a NumPy array". Padding repeats the last
    # real key (a valid key; the row is masked out). The loss is per-example, so the mean of
    # the 7 real examples' gradients over micro-batches of 3, 3, 1 is the full-batch gradient,
    # computed independently by jax.grad of the full-batch mean.
    n = 7
    full = {"x": jax.random.normal(jax.random.key(1), (n, 5)),
            "y": np.arange(n, dtype=np.int8) % 3,
            "key": jax.random.split(jax.random.key(0), n),
            "use": np.arange(n) % 4 != 3}
    params = {"w": jax.random.normal(jax.random.key(2), (5, 3))}
    want = jax.grad(lambda p: jnp.mean(_dropout_loss(p, full)))(params)
    parts = [jax.tree.map(lambda a, s=s: a[s], full)
             for s in (slice(0, 3), slice(3, 6), slice(6, 7))]
    mbs = stack_microbatches(parts)
    assert mbs.data["key"].shape == (3, 3) and mbs.data["key"].dtype == full["key"].dtype
    assert mbs.data["y"].dtype == np.int8 and mbs.data["use"].dtype == np.bool_
    # the short micro-batch's padding rows hold its last (only) key
    np.testing.assert_array_equal(jax.random.key_data(mbs.data["key"][2]),
                                  jax.random.key_data(full["key"][jnp.array([6, 6, 6])]))
    np.testing.assert_array_equal(mbs.mask, [[True] * 3, [True] * 3, [True, False, False]])
    acc = jax.jit(lambda p, b: accumulate_grads(_dropout_loss, p, b))(params, mbs)
    assert int(acc.count) == n
    np.testing.assert_allclose(acc.grads["w"], want["w"], rtol=1e-5, atol=1e-6)
    # group_microbatches takes the same micro-batches: groups of 2, then the short group.
    groups = list(group_microbatches(parts, 2))
    assert [g.data["key"].shape for g in groups] == [(2, 3), (1, 3)]
    sums = [accumulate_grads(_dropout_loss, params, g) for g in groups]
    total = sum(float(a.count) * a.grads["w"] for a in sums) / sum(float(a.count) for a in sums)
    np.testing.assert_allclose(total, want["w"], rtol=1e-5, atol=1e-6)
