"""funcgrad.interop.from_equinox: an equinox CNN with eqx.nn.State BatchNorm and dropout.

Every expected value comes from equinox's own call, as its documentation writes it: ``jax.vmap(
model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))`` over (x, state, keys), and
``eqx.filter_grad`` of that loss. The adapter runs the same operations, so values agree exactly.
"""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")

import funcgrad as fg  # noqa: E402
from funcgrad.interop import from_equinox  # noqa: E402


class CNN(eqx.Module):
    """Conv 3x3 (2 channels) -> BatchNorm -> relu -> dropout -> 2x2 mean pool -> Linear 10."""
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    pool: eqx.nn.AvgPool2d
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, key=k1)
        self.bn = eqx.nn.BatchNorm(2, axis_name="batch", momentum=0.9, mode="ema")
        self.dropout = eqx.nn.Dropout(0.25)
        self.pool = eqx.nn.AvgPool2d(2, 2)
        self.out = eqx.nn.Linear(32, 10, key=k2)

    def __call__(self, x, state, *, key=None):
        x, state = self.bn(self.conv(x), state)
        x = self.pool(self.dropout(jax.nn.relu(x), key=key))
        return self.out(x.reshape(-1)), state


def _model():
    return eqx.nn.make_with_state(CNN)(jax.random.key(0))


def _batch(n=8):
    data = fg.load_digits(seed=0)
    return {"x": jnp.asarray(data.x_train[:n].reshape(n, 1, 8, 8)),
            "y": jnp.asarray(data.y_train[:n])}


def _ce(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


def _eqx_forward(model, state, x, key):
    """equinox's own batched call (its BatchNorm and stateful-model examples)."""
    keys = jax.random.split(key, x.shape[0])
    return jax.vmap(lambda x, state, key: model(x, state, key=key), axis_name="batch",
                    in_axes=(0, None, 0), out_axes=(0, None))(x, state, keys)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if not eqx.is_array(x):  # a module's non-array leaves: flags, names, functions
            assert x is y or x == y
            continue
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_split_names_and_round_trip_are_bit_exact():
    model, state = _model()
    m = from_equinox(model, state)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(m.params)[0]]
    assert paths == [".conv.weight", ".conv.bias", ".bn.weight", ".bn.bias", ".out.weight",
                     ".out.bias"]
    assert m.model_state is state
    rebuilt, rebuilt_state = m.rebuild(m.params, m.model_state)
    # Same pytree (static fields included: the treedefs compare them) and the same arrays.
    _assert_trees_equal(rebuilt, model)
    _assert_trees_equal(rebuilt_state, state)
    # A stateless model rebuilds as the module alone.
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(1))
    m2 = from_equinox(mlp)
    assert m2.model_state is None
    _assert_trees_equal(m2.rebuild(m2.params), mlp)


def test_apply_is_equinox_vmapped_call():
    (model, state), batch = _model(), _batch()
    m = from_equinox(model, state)
    key = jax.random.key(3)
    out, new_state = jax.jit(lambda p, s, x, k: m.apply(p, s, x, key=k, train=True))(
        m.params, m.model_state, batch["x"], key)
    ref_out, ref_state = eqx.filter_jit(_eqx_forward)(model, state, batch["x"], key)
    _assert_trees_equal(out, ref_out)
    _assert_trees_equal(new_state, ref_state)
    assert not np.array_equal(jax.tree.leaves(new_state)[0], jax.tree.leaves(state)[0])


def test_eval_mode_is_inference_mode():
    (model, state), batch = _model(), _batch()
    m = from_equinox(model, state)
    out, new_state = m.apply(m.params, m.model_state, batch["x"], train=False)
    ref_out, ref_state = jax.vmap(eqx.nn.inference_mode(model), axis_name="batch",
                                  in_axes=(0, None), out_axes=(0, None))(batch["x"], state)
    _assert_trees_equal(out, ref_out)
    _assert_trees_equal(new_state, state)  # inference: the running statistics stay


def test_loss_gradients_equal_eqx_filter_grad():
    (model, state), batch = _model(), _batch()
    m = from_equinox(model, state)
    key = jax.random.key(7)
    loss_fn = m.loss(_ce, train=True)
    assert (loss_fn.has_state, loss_fn.takes_key, loss_fn.has_aux) == (True, True, False)
    (loss, new_state), grads = jax.jit(jax.value_and_grad(
        lambda p: tuple(loss_fn(p, batch, model_state=m.model_state, key=key))[:2],
        has_aux=True))(m.params)

    @eqx.filter_jit
    @eqx.filter_value_and_grad(has_aux=True)
    def eqx_loss(model, state):
        logits, state = _eqx_forward(model, state, batch["x"], key)
        return _ce(logits, batch), state

    (ref_loss, ref_state), ref_grads = eqx_loss(model, state)
    assert float(loss) == float(ref_loss)
    _assert_trees_equal(grads, ref_grads)
    _assert_trees_equal(new_state, ref_state)


def test_reports_name_leaves_by_equinox_paths():
    (model, state), batch = _model(), _batch()
    m = from_equinox(model, state)
    loss = m.loss(_ce, train=True).bind(m.model_state, jax.random.key(2))
    names = ["params.conv.weight", "params.conv.bias", "params.bn.weight", "params.bn.bias",
             "params.out.weight", "params.out.bias"]
    report = fg.check_directional(loss, m.params, batch)
    assert [r.path for r in report.rows] == names and report.ok
    monitor = fg.GradMonitor()
    _, metrics = monitor.measure(monitor.init(m.params), jax.grad(loss)(m.params, batch))
    assert metrics.leaf_names == tuple(names)
    assert metrics.layer_names == ("params.conv", "params.bn", "params.out")


def test_a_model_without_a_key_argument_gets_no_key():
    mlp = eqx.nn.Sequential([eqx.nn.Linear(4, 3, key=jax.random.key(0)),
                             eqx.nn.Lambda(jax.nn.relu)])
    m = from_equinox(mlp)
    # eqx.nn.Sequential's __call__ takes key=; a Linear alone does too. A plain module that
    # takes none:

    class Affine(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return self.w * x

    m2 = from_equinox(Affine(jnp.ones(3)))
    assert m.loss(_ce).takes_key is True and m2.loss(_ce).takes_key is False
    out, _ = m2.apply(m2.params, None, jnp.ones((2, 3)))
    np.testing.assert_array_equal(out, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="takes no key="):
        m2.apply(m2.params, None, jnp.ones((2, 3)), key=jax.random.key(0))


@pytest.mark.parametrize("bad, error, match", [
    ("pair", TypeError, r"\(model, state\) pair.*from_equinox\(model, state\)"),
    ("no-arrays", ValueError, "no floating arrays"),
    ("bad-state", TypeError, "eqx.nn.State"),
    ("linen", TypeError, r"flax.linen module.*from_linen"),
    ("dict", TypeError, "expected an equinox module, got dict"),
], ids=["pair", "no-arrays", "bad-state", "linen", "dict"])
def test_bad_input_is_refused_clearly(bad, error, match):
    import flax.linen as nn

    model, state = _model()
    args = {"pair": ((model, state),), "no-arrays": (eqx.nn.Lambda(jax.nn.relu),),
            "bad-state": (model, {"mean": jnp.zeros(2)}), "linen": (nn.Dense(3),),
            "dict": ({"w": jnp.ones(2)},)}[bad]
    with pytest.raises(error, match=match):
        from_equinox(*args)


class BatchModeCNN(CNN):
    """The CNN with BatchNorm in mode="batch" (what equinox's warning recommends for new
    code): its state holds an int32 step counter that the layer adds 1 to and stores back,
    refusing a value of another dtype."""

    def __init__(self, key):
        super().__init__(key)
        self.bn = eqx.nn.BatchNorm(2, axis_name="batch", momentum=0.9, mode="batch")


@jax.custom_jvp
def _relu_wrong_rule(x):
    return jax.nn.relu(x)


@_relu_wrong_rule.defjvp
def _relu_wrong_rule_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jax.nn.relu(x), jnp.where(x > 0, 2.0 * t, 0.0)  # the true slope is 1, not 2


class BatchModeCNNWrongRule(BatchModeCNN):
    def __call__(self, x, state, *, key=None):
        x, state = self.bn(self.conv(x), state)
        x = self.pool(self.dropout(_relu_wrong_rule(x), key=key))
        return self.out(x.reshape(-1)), state


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong_rule"])
def test_check_grads_on_a_batch_mode_batchnorm(wrong):
    # Traced with x64 on (the check's float64 evaluation), the counter's `+ 1` is int64 and
    # equinox refused it (ValueError: weak_i32 vs weak_i64). The check now uses the program
    # as the caller runs it (traced with x64 off), still evaluated in float64: it passes the
    # right model and, through the same path, finds a relu rule whose slope is 2 instead of 1:
    # at the leaves before the relu (conv.weight, bn.weight, bn.bias), not at conv.bias, whose
    # gradient is 0 either way (BatchNorm subtracts the batch mean, cancelling the bias), nor
    # at the output layer, whose gradient does not go through the rule.
    model, state = eqx.nn.make_with_state(BatchModeCNNWrongRule if wrong
                                          else BatchModeCNN)(jax.random.key(0))
    m = from_equinox(model, state)
    loss = m.loss(_ce, train=True).bind(m.model_state, jax.random.key(2))
    report = fg.check_grads(loss, m.params, _batch())
    assert any("fails when traced with x64 on" in n and "weak_i64" in n for n in report.notes)
    failed = [r.path for r in report.rows if not r.ok]
    assert failed == (["params.conv.weight", "params.bn.weight", "params.bn.bias"] if wrong
                      else []), report


# --- point 4: funcgrad's train step through the adapter = equinox's own loop ---------------

STEPS = 5


class NoBiasCNN(CNN):
    """The CNN without the conv's bias: BatchNorm cancels it, so its gradient is float32 noise
    (~1e-8) which Adam's m/sqrt(v) turns into +-lr updates of no reproducible sign."""

    def __init__(self, key):
        super().__init__(key)
        self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, use_bias=False,
                                  key=jax.random.split(key)[0])


def _batches():
    data = fg.load_digits(seed=0)
    x = data.x_train[:STEPS * 16].reshape(STEPS, 16, 1, 8, 8)
    y = data.y_train[:STEPS * 16].reshape(STEPS, 16)
    return [{"x": jnp.asarray(a), "y": jnp.asarray(b)} for a, b in zip(x, y)]


def _eqx_loop(model, state, batches, tx, base_key):
    """equinox's own loop: eqx.filter_value_and_grad with state, optax on
    eqx.filter(model, eqx.is_inexact_array), key of step s = fold_in(key, s)."""

    @eqx.filter_jit
    def train_step(model, state, opt_state, batch, key):
        def loss_fn(model, state):
            logits, state = _eqx_forward(model, state, batch["x"], key)
            return _ce(logits, batch), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    opt_state, losses = tx.init(eqx.filter(model, eqx.is_inexact_array)), []
    for s, batch in enumerate(batches):
        model, state, opt_state, loss = train_step(model, state, opt_state, batch,
                                                   jax.random.fold_in(base_key, s))
        losses.append(float(loss))
    return model, state, losses


def test_train_step_matches_equinox_loop():
    (m, tx, step), batches = _adam(), _batches()
    model, state0 = m.rebuild(m.params, m.model_state)
    state = m.init_state(step, seed=0)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_model, ref_state, ref_losses = _eqx_loop(model, state0, batches, tx, state.key)
    # Two jitted programs of the same float32 operations: XLA may fuse and order the sums
    # differently, so values agree to float32 rounding amplified over 5 Adam steps (1e-5
    # relative; atol for leaves near 0).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-7)
    jax.tree.map(close, state.params, eqx.filter(ref_model, eqx.is_inexact_array))
    jax.tree.map(close, state.model_state, ref_state)
    assert not np.allclose(jax.tree.leaves(state.model_state)[-1],
                           jax.tree.leaves(state0)[-1])  # the running statistics moved


def test_dropout_masks_differ_between_steps_and_repeat_on_a_rerun():
    (m, _, step), batches = _adam(), _batches()
    state = m.init_state(step, seed=0)
    _, at0 = step(state, batches[0])
    _, at1 = step(state._replace(step=jnp.ones((), jnp.int32)), batches[0])
    assert float(at0["loss"]) != float(at1["loss"])
    a, _ = step(state, batches[0])
    b, _ = step(state, batches[0])
    _assert_trees_equal(a.params, b.params)
    _assert_trees_equal(a.model_state, b.model_state)


def test_mixed_precision_step_keeps_float32_statistics():
    (m, tx, step), batch = _adam(), _batches()[0]
    state = m.init_state(step, seed=0)
    full, at32 = step(state, batch)
    half, at16 = fg.make_train_step(fg.mixed_precision(m.loss(_ce, **_TRAIN), jnp.bfloat16), tx)(
        state, batch)
    assert int(at16["skipped"]) == 0
    # bfloat16 keeps 8 significant bits (relative rounding 2**-9 ~ 2e-3 per operation); a
    # few layers deep, 3e-2 relative bounds the loss and the statistics (which move by
    # (1 - momentum) * batch statistic, compared with an absolute 1e-2 as well).
    np.testing.assert_allclose(float(at16["loss"]), float(at32["loss"]), rtol=3e-2)
    floats = lambda tree: [x for x in jax.tree.leaves(tree)
                           if jnp.issubdtype(x.dtype, jnp.floating)]
    for a, b, before in zip(floats(half.model_state), floats(full.model_state),
                            floats(state.model_state)):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=1e-2)
        assert not np.array_equal(a, before)


_TRAIN = {"train": True}  # the mode of equinox's loop (a model fresh from its constructor)


def _train_model():
    return from_equinox(*eqx.nn.make_with_state(NoBiasCNN)(jax.random.key(0)))


def test_takes_key_for_a_model_without_a_key_argument_is_refused():
    class Affine(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return self.w * x

    with pytest.raises(ValueError, match=r"takes_key=True.*Affine.__call__ takes no key="):
        from_equinox(Affine(jnp.ones(3))).loss(_ce, takes_key=True)


@functools.lru_cache(maxsize=None)
def _adam():
    """The model, Adam(1e-2) and its funcgrad step, compiled once for the tests below."""
    import optax

    m, tx = _train_model(), optax.adam(1e-2)
    return m, tx, fg.make_train_step(m.loss(_ce, **_TRAIN), tx)


# --- issue 25.2: a Python float field is named by from_equinox, never dropped silently --------

class _Affine(eqx.Module):
    """out = scale * linear(x) + shift; `scale` and `shift` are Python floats (equinox: static)."""
    linear: eqx.nn.Linear
    scale: float
    shift: float

    def __call__(self, x, *, key=None):
        return self.scale * self.linear(x) + self.shift


def _affine():
    linear = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    linear = eqx.tree_at(lambda lin: (lin.weight, lin.bias), linear,
                         (jnp.array([[1.0, 2.0]]), jnp.array([0.0])))
    return _Affine(linear, 0.5, 0.25)


def _squared_error(out, batch):
    return jnp.sum((out - batch["y"]) ** 2)


def test_from_equinox_warns_once_per_python_float_field():
    model = _affine()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = from_equinox(model)
    messages = [str(w.message) for w in caught
                if issubclass(w.category, fg.interop.StaticFieldWarning)]
    assert len(messages) == 2 and len(caught) == 2, [str(w.message) for w in caught]
    assert re.search(r"model\.scale is a Python float \(0\.5\).*static.*never train.*"
                     r"eqx\.tree_at\(lambda m: m\.scale, model, jnp\.asarray\(0\.5\)\)"
                     r".*eqx\.field\(static=True\)", messages[0]), messages[0]
    assert "model.shift is a Python float (0.25)" in messages[1]
    assert m.params.scale is None and m.params.shift is None  # what the warning says
    assert issubclass(fg.interop.StaticFieldWarning, UserWarning)


def test_the_fix_from_equinox_gives_trains_the_field():
    model = _affine()  # the warning's fix:
    model = eqx.tree_at(lambda m: (m.scale, m.shift), model,
                        (jnp.asarray(model.scale), jnp.asarray(model.shift)))
    m = from_equinox(model)  # no warning now (pyproject turns one into an error)
    import optax

    step = fg.make_train_step(m.loss(_squared_error), optax.sgd(0.1))
    batch = {"x": jnp.array([[3.0, 4.0]]), "y": jnp.array([[10.0]])}
    state, _ = step(m.init_state(step), batch)
    # By hand: linear(x) = 11, out = 0.5 * 11 + 0.25 = 5.75, d/d out = 2 (5.75 - 10) = -8.5;
    # d/d scale = -8.5 * 11 = -93.5, d/d shift = -8.5; SGD(0.1) adds 9.35 and 0.85.
    np.testing.assert_allclose(state.params.scale, 0.5 + 9.35, rtol=1e-6)
    np.testing.assert_allclose(state.params.shift, 0.25 + 0.85, rtol=1e-6)


# --- issue 25.3: no silent mode -------------------------------------------------------------

def test_apply_and_loss_without_train_are_refused_for_batchnorm_and_dropout():
    (model, state), batch = _model(), _batch()
    m = from_equinox(model, state)
    refused = (r"train=True or train=False.*model\.bn \(eqx\.nn\.BatchNorm\), model\.dropout "
               r"\(eqx\.nn\.Dropout\).*train=True.*batch statistics.*train=False.*running "
               r"statistics")
    with pytest.raises(ValueError, match=r"m\.apply.*" + refused):
        m.apply(m.params, m.model_state, batch["x"], key=jax.random.key(3))
    with pytest.raises(ValueError, match=r"m\.loss.*" + refused):
        m.loss(_ce)
    # Given, the mode is the call's: train=True is equinox's training call.
    out, new_state = m.apply(m.params, m.model_state, batch["x"], key=jax.random.key(3),
                             train=True)
    ref_out, ref_state = _eqx_forward(model, state, batch["x"], jax.random.key(3))
    _assert_trees_equal(out, ref_out)
    _assert_trees_equal(new_state, ref_state)

    class Gated(eqx.Module):  # a module of the user's with an `inference` flag of its own
        w: jax.Array
        inference: bool = False

        def __call__(self, x):
            return jnp.where(self.inference, 0.0, self.w * x)

    g = from_equinox(Gated(jnp.ones(2)))
    with pytest.raises(ValueError, match=r"model \(Gated, its inference field\)"):
        g.apply(g.params, None, jnp.ones((1, 2)))
    np.testing.assert_array_equal(g.apply(g.params, None, jnp.ones((1, 2)), train=False)[0],
                                  jnp.zeros((1, 2)))


class _EvalIgnoringBN(eqx.Module):
    """A BatchNorm called with inference=False: it updates its statistics in every mode."""
    bn: eqx.nn.BatchNorm

    def __init__(self):
        self.bn = eqx.nn.BatchNorm(1, axis_name="batch", momentum=0.5, mode="ema")

    def __call__(self, x, state):
        return self.bn(x, state, inference=False)


def test_an_evaluation_call_that_changes_the_state_warns():
    model, state = eqx.nn.make_with_state(_EvalIgnoringBN)()
    m = from_equinox(model, state)
    _, state1 = m.apply(m.params, m.model_state, jnp.array([[1.0], [2.0]]), train=True)
    with pytest.warns(fg.interop.EvalModeWarning,
                      match=r"train=False.*changed the model state: model\.bn\."
                            r"ema_state_index\[0\], model\.bn\.ema_state_index\[1\]"):
        _, state2 = m.apply(m.params, state1, jnp.array([[19.0], [21.0]]), train=False)
    # The statistics moved as equinox's EMA moves them (the first call takes the batch mean,
    # 1.5; then 0.5 * 1.5 + 0.5 * 20 = 10.75): the warning is about a real change.
    mean = lambda s: float(s.get(model.bn.ema_state_index)[0][0])
    assert (mean(state1), mean(state2)) == (1.5, 10.75)
    with pytest.warns(fg.interop.EvalModeWarning):  # under jit too (found at trace time)
        jax.jit(lambda p, s, x: m.apply(p, s, x, train=False))(m.params, state1,
                                                               jnp.array([[19.0], [21.0]]))
    # The CNN's own layers follow the mode: its evaluation call warns nothing.
    (cnn, cnn_state), batch = _model(), _batch()
    c = from_equinox(cnn, cnn_state)
    c.apply(c.params, c.model_state, batch["x"], train=False)


def test_a_pytorch_momentum_is_noted():
    class Net(eqx.Module):
        bn: eqx.nn.BatchNorm

        def __init__(self, momentum):
            self.bn = eqx.nn.BatchNorm(1, axis_name="batch", momentum=momentum, mode="ema")

        def __call__(self, x, state):
            return self.bn(x, state)

    with pytest.warns(fg.interop.MomentumWarning,
                      match=r"model\.bn: eqx\.nn\.BatchNorm\(momentum=0\.1\).*decay.*0\.99.*"
                            r"PyTorch.*weight of the new batch.*0\.9"):
        from_equinox(*eqx.nn.make_with_state(Net)(0.1))
    from_equinox(*eqx.nn.make_with_state(Net)(0.9))  # equinox's meaning: no warning
