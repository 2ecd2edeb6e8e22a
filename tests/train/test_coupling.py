"""Coupled examples under accumulation: detected once per trace, never for a per-example loss.

Issue 11, point 4: a loss in which one example's value depends on the other examples of its
batch (centred on the batch mean, BatchNorm in training mode) gives another gradient when
accumulated, and nothing said so.
"""
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.train.accumulate import accumulate_grads, stack_microbatches
from funcgrad.train.coupling import CoupledExamplesWarning, find_coupling
from funcgrad.train.step import make_train_step


def centred(params, batch):  # (w x_i - mean_k w x_k)^2: the batch mean couples the examples
    h = params["w"] * batch["x"]
    return (h - jnp.mean(h)) ** 2


def batch_norm(params, batch):  # BatchNorm in training mode: statistics over the batch axis
    h = batch["x"] @ params["w"]
    h = (h - h.mean(0, keepdims=True)) / jnp.sqrt(h.var(0, keepdims=True) + 1e-5)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"])


def label_frequency(params, batch):  # coupled through the integer labels alone
    same = jnp.sum(batch["y"][:, None] == batch["y"][None, :], axis=1)
    return same.astype(jnp.float32) * jnp.sum(batch["x"] @ params["w"], axis=1) ** 2


def per_example(params, batch):  # an MLP: example i's loss reads example i alone
    return optax.softmax_cross_entropy_with_integer_labels(fg.mlp_apply(params, batch["x"]),
                                                           batch["y"])


def _linear_batch(n, key=0):
    x = np.asarray(jax.random.normal(jax.random.key(key), (n, 6)))
    return {"x": x, "y": np.arange(n, dtype=np.int32) % 3}


def test_a_centred_loss_over_micro_batches_of_one_warns_and_shows_why():
    # x = [0, 2] at w = 1: x - mean = [-1, 1]. Full batch: d/dw mean_i (w (x_i - xbar))^2 =
    # mean_i 2 w (x_i - xbar)^2 = 2. Micro-batches of one example: each is its own mean, loss
    # 0 and gradient 0.0 -- the silent wrong answer the warning now names.
    params = {"w": jnp.float32(1.0)}
    full = jax.grad(lambda p: jnp.mean(centred(p, {"x": jnp.float32([0.0, 2.0])})))(params)
    assert float(full["w"]) == 2.0
    mbs = stack_microbatches([{"x": np.float32([0.0])}, {"x": np.float32([2.0])}])
    with pytest.warns(CoupledExamplesWarning, match=r"(?s)loss_fn centred \(test_coupling"
                      r"\.py:\d+\) couples the examples.*full-batch gradient"):
        acc = jax.jit(lambda p, b: accumulate_grads(centred, p, b))(params, mbs)
    assert float(acc.grads["w"]) == 0.0


@pytest.mark.parametrize("jit", [True, False])
def test_batch_norm_in_training_mode_warns_in_the_accumulating_step_once(jit):
    params = {"w": jax.random.normal(jax.random.key(1), (6, 3))}
    tx = optax.sgd(0.1)
    step = make_train_step(fg.accumulate(batch_norm, 2), tx, jit=jit)
    state = step.init(params)
    mbs = {k: v.reshape(4, 4, *v.shape[1:]) for k, v in _linear_batch(16).items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, _ = step(state, mbs)
        state, _ = step(state, mbs)  # same shapes: no second probe (jitted or not)
    coupled = [w for w in caught if issubclass(w.category, CoupledExamplesWarning)]
    assert len(coupled) == 1, [str(w.message) for w in caught]
    assert "BatchNorm in training mode" in str(coupled[0].message)


@pytest.mark.parametrize("loss_fn", [centred, batch_norm, label_frequency],
                         ids=["centred", "batch_norm", "integer_labels"])
@pytest.mark.parametrize("m", [1, 4])
def test_find_coupling_finds_each_kind_at_any_micro_batch_size(loss_fn, m):
    params = {"w": jax.ShapeDtypeStruct((6, 3) if loss_fn is not centred else (), jnp.float32)}
    batch = ({"x": jax.ShapeDtypeStruct((m,), jnp.float32)} if loss_fn is centred else
             {"x": jax.ShapeDtypeStruct((m, 6), jnp.float32),
              "y": jax.ShapeDtypeStruct((m,), jnp.int32)})
    found = find_coupling(loss_fn, params, batch)
    assert found is not None and found.rows == max(m, 3)
    # The claim it reports holds: the example's loss moved with the other examples.
    assert abs(found.loss - found.loss_others_changed) > 1e-3 * abs(found.loss)


@pytest.mark.parametrize("m", [1, 4])
def test_a_per_example_loss_raises_no_false_alarm(m):
    # The MLP with integer labels, in accumulate_grads under jit and in the step: no warning
    # (pytest turns any warning into an error; the filter here makes that explicit).
    params = fg.mlp_init(jax.random.key(0), (6, 8, 3))
    assert find_coupling(per_example, params, {"x": jnp.zeros((m, 6)),
                                               "y": jnp.zeros((m,), jnp.int32)}) is None
    mbs = {k: v.reshape(8 // m, m, *v.shape[1:]) for k, v in _linear_batch(8).items()}
    tx = optax.sgd(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda p, b: accumulate_grads(per_example, p, b))(params, mbs)
        step = make_train_step(fg.accumulate(per_example, 2), tx)
        step(step.init(params), mbs)


def test_dropout_drawn_for_the_whole_batch_is_not_a_coupling():
    # One key for the batch: example i's mask depends on its position and the batch size,
    # not on the other examples' values, and accumulation averages the same distribution.
    def dropout(params, batch):
        keep = jax.random.bernoulli(jax.random.key(7), 0.5, batch["x"].shape)
        h = jnp.where(keep, batch["x"], 0.0) @ params["w"]
        return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"])
    params = {"w": jax.ShapeDtypeStruct((6, 3), jnp.float32)}
    for m in (1, 4):
        assert find_coupling(dropout, params, {"x": jnp.zeros((m, 6)),
                                               "y": jnp.zeros((m,), jnp.int32)}) is None


def test_a_loss_the_probe_cannot_run_is_not_judged():
    # A batch size written into the loss (reshape to 1 row) runs on micro-batches of one but
    # not on the probe's 2 rows: the probe claims nothing and the accumulation runs as before.
    # Hand value: loss_i = x_i . w with x_i = [1] * 6 and [2] * 6: d mean / dw = (1 + 2) / 2.
    def one_row(params, batch):
        return batch["x"].reshape(1, 6) @ params["w"]
    params = {"w": jnp.ones((6,))}
    assert find_coupling(one_row, params, {"x": jnp.zeros((1, 6))}) is None
    mbs = {"x": np.float32([[[1] * 6], [[2] * 6]])}
    acc = jax.jit(lambda p, b: accumulate_grads(one_row, p, b))(params, mbs)
    np.testing.assert_array_equal(acc.grads["w"], np.full(6, 1.5, np.float32))


def token_count(params, batch):
    # Each example's summed token loss over the batch's count of valid tokens (times the batch
    # size, so the full-batch mean is the usual per-token mean): the count couples the examples.
    logits = params["embed"][batch["t"][:, :-1]]
    token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"][:, 1:])
    valid = batch["m"][:, 1:]
    return jnp.sum(token * valid, axis=1) / jnp.sum(valid) * batch["t"].shape[0]


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int32, jnp.uint8])
def test_a_loss_over_the_batch_count_of_valid_tokens_warns_whatever_the_mask_dtype(dtype):
    # The classic accumulation bug: the first half of the batch is heavily padded, so each
    # micro-batch divides by its own token count and the accumulated gradient is not the
    # full-batch one (checked below against jax.grad of the full-batch mean). A bool mask used
    # to stay True in the probe's replaced rows, so the count never changed: no warning.
    params = {"embed": 0.1 * jax.random.normal(jax.random.key(0), (12, 12))}
    t = jax.random.randint(jax.random.key(1), (8, 6), 1, 12)
    mask = jnp.ones((8, 6), bool).at[:4, 2:].set(False).astype(dtype)
    full = jax.grad(lambda p: jnp.mean(token_count(p, {"t": t, "m": mask})))(params)
    mbs = {"t": t.reshape(4, 2, 6), "m": mask.reshape(4, 2, 6)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = jax.jit(lambda p, b: accumulate_grads(token_count, p, b))(params, mbs)
    assert [w.category for w in caught] == [CoupledExamplesWarning], [str(w.message)
                                                             for w in caught]
    assert not np.allclose(acc.grads["embed"], full["embed"], rtol=1e-2, atol=0)


def _leaf(dtype, m):
    shape = (m,) if dtype == "labels" else (m, 4)
    if dtype == "key":
        return jax.ShapeDtypeStruct((m,), jax.random.key(0).dtype)
    return jax.ShapeDtypeStruct(shape, jnp.int32 if dtype == "labels" else dtype)


def _as_float(z):
    if jnp.issubdtype(z.dtype, jax.dtypes.prng_key):  # a per-example key: draw with it
        z = jax.vmap(jax.random.uniform)(z)
    return z.astype(jnp.float32).reshape(z.shape[0], -1)


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int8, jnp.uint8, jnp.int32, jnp.uint32,
                                   pytest.param(jnp.float16, marks=pytest.mark.float16),
                                   jnp.bfloat16, jnp.float32, "key"],
                         ids=lambda d: d if isinstance(d, str) else jnp.dtype(d).name)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_a_coupling_through_the_batch_sum_of_a_leaf_of_any_dtype_is_found(dtype, m):
    # loss_i = (1 + (x_i . w)^2) * (1 + tanh(mean of z over the batch)): example i's loss moves
    # whenever the other rows of z change their total, as a token count does.
    def through_sum(params, batch):
        z = _as_float(batch["z"])
        return (1 + jnp.sum(batch["x"] @ params["w"], 1) ** 2) * (1 + jnp.tanh(jnp.mean(z)))
    params = {"w": jax.ShapeDtypeStruct((6, 3), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((m, 6), jnp.float32), "z": _leaf(dtype, m)}
    assert find_coupling(through_sum, params, batch) is not None


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int8, jnp.uint8, jnp.uint32, "labels"],
                         ids=lambda d: d if isinstance(d, str) else jnp.dtype(d).name)
def test_a_coupling_through_rows_equal_to_its_own_is_found(dtype):
    # loss_i = (x_i . w)^2 * (number of rows of z equal to row i): a label frequency, or a
    # count of examples with the same mask. Caught only if the replaced rows differ from the
    # kept one element by element (a bool mask kept True in every row never changed it).
    def same_rows(params, batch):
        z = _as_float(batch["z"])
        same = jnp.sum(jnp.all(z[:, None] == z[None, :], axis=-1), axis=1)
        return jnp.sum(batch["x"] @ params["w"], 1) ** 2 * same
    params = {"w": jax.ShapeDtypeStruct((6, 3), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((4, 6), jnp.float32), "z": _leaf(dtype, 4)}
    assert find_coupling(same_rows, params, batch) is not None


def _here() -> int:
    """The line number of the caller's next line."""
    return inspect.currentframe().f_back.f_lineno + 1


@pytest.mark.parametrize("path", ["accumulate_grads", "step", "step under jit=False"])
def test_the_warning_names_the_users_loss_fn_and_points_at_the_users_call(path):
    # The train step wraps loss_fn (to name the user's line on a traced-value error): the
    # warning used to name that wrapper, "loss_fn centred (_traced.py:251)", and was reported
    # at funcgrad/train/step.py. Both paths now name centred's def line and the call below.
    params = {"w": jnp.float32(1.0)}
    mbs = stack_microbatches([{"x": np.float32([0.0, 1.0])}, {"x": np.float32([2.0, 3.0])}])
    tx = optax.sgd(0.1)
    step = make_train_step(fg.accumulate(centred, 2), tx, jit=path == "step")
    state = step.init(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if path == "accumulate_grads":
            line = _here()
            accumulate_grads(centred, params, mbs)
        else:
            line = _here()
            step(state, mbs)
    assert [w.category for w in caught] == [CoupledExamplesWarning], [str(w.message)
                                                             for w in caught]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert (f"loss_fn centred (test_coupling.py:{centred.__code__.co_firstlineno})"
            in str(caught[0].message))
