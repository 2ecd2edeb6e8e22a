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
from funcgrad.accumulate import accumulate_grads
from funcgrad.microbatches import group_microbatches, stack_microbatches
from funcgrad.train import make_train_step


def test_group_microbatches_yields_every_example_once_with_the_short_group_last():
    # 10 examples in micro-batches of 3: sizes 3, 3, 3, 1; groups of 3: (3, 3, 3) and (1,).
    x = np.arange(10, dtype=np.float32)[:, None]
    groups = list(group_microbatches(fg.batches(x, np.arange(10), batch_size=3, seed=0), 3))
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
], ids=["none", "empty", "ragged_leaves", "too_big", "structure", "group_zero"])
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
    step = make_train_step(loss_fn, tx, accumulate=2)
    state, metrics = step(fg.init_train_state({"w": jnp.float32(1.0)}, tx), mbs)
    assert int(metrics["examples"][0]) == 3
    assert float(state.params["w"]) == 1.0 - 2.0  # w - lr * 2
