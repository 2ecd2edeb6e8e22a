"""funcgrad.interop.from_nnx: an nnx CNN with BatchNorm and dropout, against nnx itself.

Every expected value comes from nnx's own objects: the module called in place (its BatchNorm
statistics and its dropout stream's count advance), ``nnx.grad`` of nnx's own loss. The adapter
runs the same operations, so values agree exactly.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import funcgrad as fg  # noqa: E402
from funcgrad.interop import from_nnx  # noqa: E402


class CNN(nnx.Module):
    """Conv 3x3 (2 channels) -> BatchNorm -> relu -> dropout -> 2x2 mean pool -> Linear 10."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 2, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(2, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.bn1(self.conv1(x))))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        return self.out(x.reshape(x.shape[0], -1))


def _model():
    return CNN(nnx.Rngs(0, dropout=1))


def _batch(n=8):
    data = fg.load_digits(seed=0)
    return {"x": jnp.asarray(data.x_train[:n].reshape(n, 8, 8, 1)),
            "y": jnp.asarray(data.y_train[:n])}


def _ce(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


def _assert_trees_equal(a, b, rounding: bool = False):
    """Equal leaf by leaf: bit for bit, or with `rounding` up to float32 rounding (relative
    1e-6 of the leaf's largest value) for a jitted program against nnx's eager call: XLA may
    fuse a multiply-add in one and not in the other (jax 0.12.1 moved this model's output by
    1 ulp, and values near 0 by more ulps of their own)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if rounding and jnp.issubdtype(x.dtype, jnp.floating):
            scale = float(np.max(np.abs(np.asarray(y)))) if np.size(y) else 0.0
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6,
                                       atol=1e-6 * scale)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _pure(model, *filters):
    return nnx.to_pure_dict(nnx.state(model, *filters))


def test_split_names_and_round_trip_are_bit_exact():
    model = _model()
    m = from_nnx(model)
    # Plain dicts of arrays, no Variable .value level in the paths.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(m.params)[0]]
    assert paths == ["['bn1']['bias']", "['bn1']['scale']", "['conv1']['bias']",
                     "['conv1']['kernel']", "['out']['bias']", "['out']['kernel']"]
    assert set(m.model_state) == {"bn1", "dropout"}  # BatchStat and the dropout RngState
    assert m.model_state["dropout"]["rngs"]["count"].dtype == jnp.uint32
    rebuilt = m.rebuild(m.params, m.model_state)
    assert type(rebuilt) is CNN and rebuilt is not model
    _assert_trees_equal(_pure(rebuilt), _pure(model))
    assert type(nnx.state(rebuilt)["bn1"]["mean"]) is nnx.BatchStat  # Variable types kept
    # The given module is not touched by the adapter (nor by its train/eval graphdefs).
    assert model.dropout.deterministic is False and model.bn1.use_running_average is False


def test_apply_is_the_module_call_with_its_state_advancing():
    model, batch = _model(), _batch()
    m = from_nnx(model)
    out, new_state = jax.jit(lambda p, s, x: m.apply(p, s, x, train=True))(
        m.params, m.model_state, batch["x"])
    ref = model(batch["x"])  # nnx's own call: updates model's statistics and rng count
    _assert_trees_equal(out, ref, rounding=True)  # jitted against eager
    _assert_trees_equal(new_state, _pure(model, nnx.Not(nnx.Param)), rounding=True)
    assert int(new_state["dropout"]["rngs"]["count"]) == 1
    # A second call from the new state is nnx's second call: a new dropout mask.
    out2, _ = m.apply(m.params, new_state, batch["x"], train=True)
    _assert_trees_equal(out2, model(batch["x"]))
    assert not np.array_equal(out, out2)


def test_train_and_eval_modes_are_model_train_and_eval():
    model, batch = _model(), _batch()
    m = from_nnx(model)
    out, new_state = m.apply(m.params, m.model_state, batch["x"], train=False)
    model.eval()
    _assert_trees_equal(out, model(batch["x"]))
    _assert_trees_equal(new_state, m.model_state)  # eval: no statistics update, no rng draw
    model.train()
    out, new_state = m.apply(m.params, m.model_state, batch["x"], train=True)
    _assert_trees_equal(out, model(batch["x"]))
    _assert_trees_equal(new_state, _pure(model, nnx.Not(nnx.Param)))


def test_loss_gradients_equal_nnx_grad():
    model, batch = _model(), _batch()
    m = from_nnx(model)
    loss_fn = m.loss(_ce, train=True)
    assert (loss_fn.has_state, loss_fn.takes_key, loss_fn.has_aux) == (True, False, False)
    (loss, new_state), grads = jax.jit(jax.value_and_grad(
        lambda p: tuple(loss_fn(p, batch, model_state=m.model_state))[:2],
        has_aux=True))(m.params)

    def nnx_loss(model):
        return _ce(model(batch["x"]), batch)

    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(nnx_loss))(model)
    assert float(loss) == float(ref_loss)
    _assert_trees_equal(grads, nnx.to_pure_dict(ref_grads))
    _assert_trees_equal(new_state, _pure(model, nnx.Not(nnx.Param)))


def test_reports_name_leaves_by_nnx_paths():
    model, batch = _model(), _batch()
    m = from_nnx(model)
    loss = m.loss(_ce, train=True).bind(m.model_state)
    names = ["params['bn1']['bias']", "params['bn1']['scale']", "params['conv1']['bias']",
             "params['conv1']['kernel']", "params['out']['bias']", "params['out']['kernel']"]
    report = fg.check_grads(loss, m.params, batch)
    assert [r.path for r in report.rows] == names and report.ok
    monitor = fg.GradMonitor()
    _, metrics = monitor.measure(monitor.init(m.params), jax.grad(loss)(m.params, batch))
    assert metrics.leaf_names == tuple(names)
    # Grouped by module, not one "layer" per leaf.
    assert metrics.layer_names == ("params['bn1']", "params['conv1']", "params['out']")


def test_an_optimizer_and_other_objects_are_refused_clearly():
    import flax.linen as nn
    import optax

    model = _model()
    with pytest.raises(TypeError, match=r"(?s)nnx.Optimizer.*from_nnx\(model\).*optax"):
        from_nnx(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    with pytest.raises(TypeError, match=r"flax.linen module.*from_linen\(module, variables\)"):
        from_nnx(nn.Dense(3))
    with pytest.raises(TypeError, match="expected a flax.nnx module, got dict"):
        from_nnx(m := {"w": jnp.ones(2)})
    assert m  # (the dict itself is fine, just not a model)

    class Forward(nnx.Module):  # PyTorch habit: the computation in `forward`, no __call__
        def __init__(self):
            self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(TypeError, match=r"Forward has no __call__.*self\.forward\(x\)"):
        from_nnx(Forward())


def test_a_module_without_params_and_a_key_are_refused():
    with pytest.raises(ValueError, match="no nnx.Param"):
        from_nnx(nnx.Dropout(0.5, rngs=nnx.Rngs(0)))
    m = from_nnx(_model())
    with pytest.raises(ValueError, match="takes_key=True.*own nnx.Rngs"):
        m.loss(_ce, takes_key=True)
    with pytest.raises(ValueError, match="own nnx.Rngs"):
        m.apply(m.params, m.model_state, _batch()["x"], key=jax.random.key(0), train=True)


# --- point 4: funcgrad's train step through the adapter = nnx's own loop -------------------

STEPS = 5


class NoBiasCNN(CNN):
    """The CNN without the conv's bias: BatchNorm cancels it, so its gradient is float32 noise
    (~1e-8) which Adam's m/sqrt(v) turns into +-lr updates of no reproducible sign."""

    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.conv1 = nnx.Conv(1, 2, (3, 3), use_bias=False, rngs=rngs)


def _batches():
    data = fg.load_digits(seed=0)
    x = data.x_train[:STEPS * 16].reshape(STEPS, 16, 8, 8, 1)
    y = data.y_train[:STEPS * 16].reshape(STEPS, 16)
    return [{"x": jnp.asarray(a), "y": jnp.asarray(b)} for a, b in zip(x, y)]


def _nnx_loop(model, batches, tx):
    """nnx's own loop: nnx.Optimizer + nnx.value_and_grad under nnx.jit (the model's BatchNorm
    statistics and dropout stream advance in place)."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda model: _ce(model(batch["x"]), batch))(model)
        optimizer.update(model, grads)
        return loss

    return [float(train_step(model, optimizer, batch)) for batch in batches]


def test_train_step_matches_nnx_optimizer_loop():
    (m, tx, step), batches = _adam(), _batches()
    model = m.rebuild(m.params, m.model_state)  # a new module: nnx's loop trains it in place
    state = m.init_state(step)
    assert state.key is None  # nnx draws from its own Rngs
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_losses = _nnx_loop(model, batches, tx)
    # Two jitted programs of the same float32 operations: XLA may fuse and order the sums
    # differently, so values agree to float32 rounding amplified over 5 Adam steps (1e-5
    # relative; atol for leaves near 0).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-7)
    jax.tree.map(close, state.params, _pure(model, nnx.Param))
    jax.tree.map(close, state.model_state["bn1"], _pure(model, nnx.BatchStat)["bn1"])
    # The dropout stream drew once per step, as in nnx's loop.
    assert int(state.model_state["dropout"]["rngs"]["count"]) == STEPS
    assert int(model.dropout.rngs.count.get_value()) == STEPS


def test_dropout_masks_differ_between_steps_and_repeat_on_a_rerun():
    (m, _, step), batches = _adam(), _batches()
    state = m.init_state(step)
    # Same params, statistics and batch; the dropout stream's count 0 and 1 (what a step
    # leaves it at): a different loss means a different mask.
    after, at0 = step(state, batches[0])
    moved = state._replace(model_state={**state.model_state,
                                        "dropout": after.model_state["dropout"]})
    _, at1 = step(moved, batches[0])
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


_TRAIN = {"train": True}  # the mode of nnx's loop (a model fresh from its constructor)


def _train_model():
    return from_nnx(NoBiasCNN(nnx.Rngs(0, dropout=1)))


def test_a_module_that_takes_train_gets_it():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, train):
            return self.drop(self.lin(x), deterministic=not train)

    model, x = Net(nnx.Rngs(0, dropout=1)), jnp.ones((2, 3))
    m = from_nnx(model)
    out, _ = m.apply(m.params, m.model_state, x, train=False)
    _assert_trees_equal(out, model(x, train=False))  # no dropout: the Linear alone
    out, _ = m.apply(m.params, m.model_state, x, train=True)
    _assert_trees_equal(out, model(x, train=True))   # the same first dropout draw


@functools.lru_cache(maxsize=None)
def _adam():
    """The model, Adam(1e-2) and its funcgrad step, compiled once for the tests below."""
    import optax

    m, tx = _train_model(), optax.adam(1e-2)
    return m, tx, fg.make_train_step(m.loss(_ce, **_TRAIN), tx)


# --- issue 25.3: no silent mode -------------------------------------------------------------

def test_apply_and_loss_without_train_are_refused_for_batchnorm_and_dropout():
    model, batch = _model(), _batch()
    m = from_nnx(model)
    refused = (r"train=True or train=False.*model\.bn1 \(nnx\.BatchNorm\), model\.dropout "
               r"\(nnx\.Dropout\).*train=True.*model\.train\(\).*train=False.*model\.eval\(\)")
    with pytest.raises(ValueError, match=r"m\.apply.*" + refused):
        m.apply(m.params, m.model_state, batch["x"])
    with pytest.raises(ValueError, match=r"m\.loss.*" + refused):
        m.loss(_ce)

    class Attention(nnx.Module):  # a module with a `deterministic` attribute of its own
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)
            self.deterministic = False

        def __call__(self, x):
            return self.lin(x) * (1.0 if self.deterministic else 2.0)

    a = from_nnx(Attention(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"model \(Attention, its deterministic attribute\)"):
        a.apply(a.params, a.model_state, jnp.ones((1, 2)))
    # train=False is model.eval(): deterministic=True, the Linear alone.
    out, _ = a.apply(a.params, a.model_state, jnp.ones((1, 2)), train=False)
    lin = a.rebuild(a.params, a.model_state).lin
    _assert_trees_equal(out, lin(jnp.ones((1, 2))))
    # A model without mode-dependent layers runs without train=.
    plain = from_nnx(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    out, _ = plain.apply(plain.params, plain.model_state, jnp.ones((1, 2)))
    _assert_trees_equal(out, nnx.Linear(2, 3, rngs=nnx.Rngs(0))(jnp.ones((1, 2))))


class _EvalIgnoringBN(nnx.Module):
    """A BatchNorm called with use_running_average=False: it updates its statistics in every
    mode, model.eval() or not."""

    def __init__(self, rngs):
        self.bn = nnx.BatchNorm(1, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return self.bn(x, use_running_average=False)


def test_an_evaluation_call_that_changes_the_state_warns():
    m = from_nnx(_EvalIgnoringBN(nnx.Rngs(0)))
    x = jnp.array([[1.0], [2.0]])
    with pytest.warns(fg.interop.EvalModeWarning,
                      match=r"train=False.*changed the model state: "
                            r"model_state\['bn'\]\['mean'\], model_state\['bn'\]\['var'\]"):
        _, new_state = m.apply(m.params, m.model_state, x, train=False)
    # nnx's momentum is the decay: 0.5 * 0 + 0.5 * 1.5 = 0.75 (a real change).
    np.testing.assert_allclose(new_state["bn"]["mean"], [0.75])
    # The CNN's own layers follow the mode: its evaluation call warns nothing.
    c = from_nnx(_model())
    c.apply(c.params, c.model_state, _batch()["x"], train=False)


def test_a_pytorch_momentum_is_noted():
    class Net(nnx.Module):
        def __init__(self, momentum, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)
            self.bn = nnx.BatchNorm(2, momentum=momentum, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    with pytest.warns(fg.interop.MomentumWarning,
                      match=r"model\.bn: nnx\.BatchNorm\(momentum=0\.1\).*decay.*0\.99.*"
                            r"PyTorch.*weight of the new batch.*0\.9"):
        from_nnx(Net(0.1, nnx.Rngs(0)))
    from_nnx(Net(0.9, nnx.Rngs(0)))  # flax's meaning: no warning
