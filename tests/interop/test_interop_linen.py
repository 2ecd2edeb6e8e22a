"""funcgrad.interop.from_linen: a linen CNN with BatchNorm and dropout, against flax itself.

Every expected value comes from flax's own call on the same variables (``module.apply(...,
mutable=["batch_stats"], rngs={"dropout": key})``, ``jax.grad`` of flax's own loss): the
adapter runs the same operations, so values agree exactly unless a comment says otherwise.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402

import funcgrad as fg  # noqa: E402
from funcgrad.interop import from_linen  # noqa: E402


class CNN(nn.Module):
    """Conv 3x3 (2 channels) -> BatchNorm -> relu -> dropout -> 2x2 mean pool -> Dense 10."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(2, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def _batch(n=8):
    data = fg.load_digits(seed=0)
    return {"x": jnp.asarray(data.x_train[:n].reshape(n, 8, 8, 1)),
            "y": jnp.asarray(data.y_train[:n])}


def _ce(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


@pytest.fixture(scope="module")
def setup():
    module, batch = CNN(), _batch()
    variables = module.init(jax.random.key(0), batch["x"], train=False)
    return module, variables, batch


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_split_and_round_trip_are_bit_exact(setup):
    module, variables, _ = setup
    m = from_linen(module, variables)
    assert m.params is variables["params"] and list(m.model_state) == ["batch_stats"]
    _assert_trees_equal(m.rebuild(m.params, m.model_state), variables)
    # After a change the rebuilt variables hold the new values, nothing else.
    params = jax.tree.map(lambda p: p + 1.0, m.params)
    rebuilt = m.rebuild(params, m.model_state)
    _assert_trees_equal(rebuilt["params"], params)
    _assert_trees_equal(rebuilt["batch_stats"], variables["batch_stats"])


def test_a_frozen_dict_round_trips_as_one(setup):
    module, variables, _ = setup
    frozen = flax.core.freeze(variables)
    m = from_linen(module, frozen)
    rebuilt = m.rebuild(m.params, m.model_state)
    assert isinstance(rebuilt, flax.core.FrozenDict)
    _assert_trees_equal(flax.core.unfreeze(rebuilt), variables)


def test_apply_is_flax_training_call(setup):
    module, variables, batch = setup
    m = from_linen(module, variables)
    key = jax.random.key(3)
    out, new_state = jax.jit(lambda p, s, x, k: m.apply(p, s, x, key=k, train=True))(
        m.params, m.model_state, batch["x"], key)
    ref_out, ref_new = jax.jit(lambda v, x, k: module.apply(
        v, x, train=True, mutable=["batch_stats"], rngs={"dropout": k}))(
        variables, batch["x"], key)
    _assert_trees_equal(out, ref_out)
    _assert_trees_equal(new_state, dict(ref_new))
    # The running statistics moved (training mode), and dropout zeroed some activations.
    assert not np.array_equal(new_state["batch_stats"]["BatchNorm_0"]["mean"],
                              variables["batch_stats"]["BatchNorm_0"]["mean"])


def test_eval_mode_uses_running_statistics_and_needs_no_key(setup):
    module, variables, batch = setup
    m = from_linen(module, variables)
    out, new_state = m.apply(m.params, m.model_state, batch["x"], train=False)
    _assert_trees_equal(out, module.apply(variables, batch["x"], train=False))
    _assert_trees_equal(new_state, m.model_state)  # eval mode leaves the statistics alone


def test_dropout_without_a_key_is_a_clear_error(setup):
    module, variables, batch = setup
    m = from_linen(module, variables)
    with pytest.raises(ValueError, match="needs a PRNG key.*Pass key="):
        m.apply(m.params, m.model_state, batch["x"], train=True)
    m2 = from_linen(module, variables, rngs=("noise",))
    with pytest.raises(ValueError, match=r"rng stream.*\['noise'\].*rngs="):
        m2.apply(m2.params, m2.model_state, batch["x"], train=True, key=jax.random.key(0))


def test_loss_gradients_equal_jax_grad_of_flax_loss(setup):
    module, variables, batch = setup
    m = from_linen(module, variables)
    key = jax.random.key(7)
    loss_fn = m.loss(_ce, inputs="x", train=True)
    assert (loss_fn.has_state, loss_fn.takes_key, loss_fn.has_aux) == (True, True, False)

    def flax_loss(params):  # flax's own loss of its TrainState loop
        logits, updates = module.apply({"params": params, **m.model_state}, batch["x"],
                                       train=True, mutable=["batch_stats"],
                                       rngs={"dropout": key})
        return _ce(logits, batch), updates

    (loss, new_state), grads = jax.jit(jax.value_and_grad(
        lambda p: tuple(loss_fn(p, batch, model_state=m.model_state, key=key))[:2],
        has_aux=True))(m.params)
    (ref_loss, ref_state), ref_grads = jax.jit(jax.value_and_grad(flax_loss, has_aux=True))(
        m.params)
    assert float(loss) == float(ref_loss)
    _assert_trees_equal(new_state, dict(ref_state))
    _assert_trees_equal(grads, ref_grads)


def test_loss_with_aux_and_bad_objectives(setup):
    module, variables, batch = setup
    m = from_linen(module, variables)
    key = jax.random.key(1)

    def with_acc(logits, batch):
        return _ce(logits, batch), {"accuracy": fg.accuracy(logits, batch["y"])}

    loss, new_state, aux = m.loss(with_acc, has_aux=True, train=True)(
        m.params, batch, model_state=m.model_state, key=key)
    logits, _ = m.apply(m.params, m.model_state, batch["x"], key=key, train=True)
    assert float(aux["accuracy"]) == float(fg.accuracy(logits, batch["y"]))
    assert float(loss) == float(_ce(logits, batch))
    bad = m.loss(with_acc, train=True)
    with pytest.raises(ValueError, match="has_aux=True"):
        bad(m.params, batch, model_state=m.model_state, key=key)
    with pytest.raises(ValueError, match="batch has no 'image'"):
        m.loss(_ce, inputs="image", train=True)(
            m.params, batch, model_state=m.model_state, key=key)


def test_reports_name_leaves_by_linen_paths(setup):
    module, variables, batch = setup
    m = from_linen(module, variables)
    loss = m.loss(_ce, train=True).bind(m.model_state, jax.random.key(2))
    names = ["params['BatchNorm_0']['bias']", "params['BatchNorm_0']['scale']",
             "params['Conv_0']['bias']", "params['Conv_0']['kernel']",
             "params['Dense_0']['bias']", "params['Dense_0']['kernel']"]
    report = fg.check_directional(loss, m.params, batch)
    assert [r.path for r in report.rows] == names and report.ok
    explanation = fg.explain_grads(loss, m.params, batch)
    assert [r.path for r in explanation.rows] == names
    # A conv bias followed by BatchNorm cancels in the batch mean: its gradient is 0 in
    # exact arithmetic; every other leaf is connected.
    assert explanation.status("params['Dense_0']['kernel']") == "connected"
    monitor = fg.GradMonitor()
    state = monitor.init(m.params)
    _, metrics = monitor.measure(state, jax.grad(loss)(m.params, batch))
    assert metrics.leaf_names == tuple(names)
    assert metrics.layer_names == ("params['BatchNorm_0']", "params['Conv_0']",
                                   "params['Dense_0']")


@pytest.mark.parametrize("bad, error, match", [
    (None, TypeError, "needs the module and its variables"),
    ("params", ValueError, "no 'params' collection.*look like the contents"),
    ({"batch_stats": {}}, ValueError, "no 'params' collection"),
    ([1, 2], TypeError, "dict of collections"),
], ids=["no-variables", "params-only", "no-params", "a-list"])
def test_bad_variables_are_refused_clearly(setup, bad, error, match):
    module, variables, _ = setup
    if bad == "params":
        bad = variables["params"]
    with pytest.raises(error, match=match):
        from_linen(module, bad)


def test_other_objects_are_pointed_to_their_adapter(setup):
    _, variables, _ = setup
    from flax import nnx
    with pytest.raises(TypeError, match="nnx module.*from_nnx"):
        from_linen(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), variables)
    with pytest.raises(TypeError, match="expected a flax.linen module, got dict"):
        from_linen({"a": 1}, variables)


def test_params_of_another_structure_are_refused(setup):
    module, variables, batch = setup
    m = from_linen(module, variables)
    params = {k: v for k, v in m.params.items() if k != "Dense_0"}
    with pytest.raises(ValueError, match=r"missing: params\['Dense_0'\]"):
        m.apply(params, m.model_state, batch["x"], train=False)
    with pytest.raises(ValueError, match="model_state is None"):
        m.rebuild(m.params)


# --- point 4: funcgrad's train step through the adapter = flax's documented loop ----------

STEPS = 5


class NoBiasCNN(nn.Module):
    """CNN with the conv's bias left out, as before any BatchNorm: BatchNorm cancels it, so its
    gradient is float32 noise (~1e-8) which Adam's m/sqrt(v) turns into +-lr updates whose sign
    two equally correct programs need not share."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(2, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def _flax_loop(module, variables, batches, tx, base_key):
    """flax's own loop: flax.training.train_state.TrainState with batch_stats, mutable=
    ["batch_stats"], rngs={"dropout": jax.random.fold_in(key, state.step)}."""
    import typing

    from flax.training import train_state

    class TrainState(train_state.TrainState):
        batch_stats: typing.Any

    @jax.jit
    def train_step(state, batch, dropout_key):
        dropout_key = jax.random.fold_in(dropout_key, state.step)

        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, batch["x"], train=True,
                rngs={"dropout": dropout_key}, mutable=["batch_stats"])
            return _ce(logits, batch), updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        return state.replace(batch_stats=updates["batch_stats"]), loss

    state = TrainState.create(apply_fn=module.apply, params=variables["params"], tx=tx,
                              batch_stats=variables["batch_stats"])
    losses = []
    for batch in batches:
        state, loss = train_step(state, batch, base_key)
        losses.append(float(loss))
    return state, losses


def _batches():
    data = fg.load_digits(seed=0)
    x = data.x_train[:STEPS * 16].reshape(STEPS, 16, 8, 8, 1)
    y = data.y_train[:STEPS * 16].reshape(STEPS, 16)
    return [{"x": jnp.asarray(a), "y": jnp.asarray(b)} for a, b in zip(x, y)]


def test_train_step_matches_flax_train_state_loop():
    (m, tx, step), batches, module = _adam(), _batches(), NoBiasCNN()
    variables = m.rebuild(m.params, m.model_state)  # module.init's, as _train_model made them
    state = m.init_state(step, seed=0)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    ref, ref_losses = _flax_loop(module, variables, batches, tx, state.key)
    # Two jitted programs of the same float32 operations: XLA may fuse and order the sums
    # differently, so values agree to float32 rounding amplified over 5 Adam steps (1e-5
    # relative; atol for leaves near 0, 1e-5 of the learning rate times the steps).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in [(state.params, ref.params),
                      (state.model_state["batch_stats"], ref.batch_stats)]:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-7),
                     got, want)
    # The statistics moved, and differ from a loop that never threads them through.
    assert not np.allclose(state.model_state["batch_stats"]["BatchNorm_0"]["var"],
                           variables["batch_stats"]["BatchNorm_0"]["var"])


def test_dropout_masks_differ_between_steps_and_repeat_on_a_rerun():
    (m, _, step), batches = _adam(), _batches()
    state = m.init_state(step, seed=0)
    # The same params, statistics and batch at step 0 and at step 1: only the dropout key
    # (fold_in(key, step)) differs, so a different loss means a different mask.
    _, at0 = step(state, batches[0])
    _, at1 = step(state._replace(step=jnp.ones((), jnp.int32)), batches[0])
    assert float(at0["loss"]) != float(at1["loss"])
    # A rerun from the same state draws the same masks: bit-identical results.
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


_TRAIN = {"train": True}


def _train_model():
    module = NoBiasCNN()
    return from_linen(module, module.init(jax.random.key(0), _batches()[0]["x"], train=False))


def test_import_funcgrad_imports_neither_flax_nor_equinox():
    import subprocess
    import sys

    code = ("import sys, funcgrad, funcgrad.interop; "
            "print('flax' in sys.modules, 'equinox' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


@functools.lru_cache(maxsize=None)
def _adam():
    """The model, Adam(1e-2) and its funcgrad step, compiled once for the tests below."""
    import optax

    m, tx = _train_model(), optax.adam(1e-2)
    return m, tx, fg.make_train_step(m.loss(_ce, **_TRAIN), tx)


# --- issue 25.3: PyTorch's momentum noted; an evaluation call that changes the state --------

class _BN(nn.Module):
    momentum: float = 0.9
    follows_train: bool = True

    @nn.compact
    def __call__(self, x, train: bool):
        running = not train if self.follows_train else False  # False: ignores the mode
        return nn.BatchNorm(use_running_average=running, momentum=self.momentum)(x)


def test_a_pytorch_momentum_is_noted_once():
    x = jnp.array([[1.0], [2.0]])
    module = _BN(momentum=0.1)
    m = from_linen(module, module.init(jax.random.key(0), x, train=False), rngs=())
    with pytest.warns(fg.interop.MomentumWarning,
                      match=r"model_state\['batch_stats'\]\['BatchNorm_0'\]: "
                            r"nn\.BatchNorm\(momentum=0\.1\).*decay.*0\.99.*PyTorch.*"
                            r"weight of the new batch.*0\.9"):
        _, state = m.apply(m.params, m.model_state, x, train=True)
    # flax's meaning, by hand: 0.1 * 0 + 0.9 * mean([1, 2]) = 1.35 (the batch's, nearly).
    np.testing.assert_allclose(state["batch_stats"]["BatchNorm_0"]["mean"], [1.35], rtol=1e-6)
    m.apply(m.params, state, x, train=True)  # once per adapter: no second warning
    good = _BN(momentum=0.9)
    g = from_linen(good, good.init(jax.random.key(0), x, train=False), rngs=())
    g.apply(g.params, g.model_state, x, train=True)  # flax's meaning: no warning


def test_an_evaluation_call_that_changes_the_state_warns():
    x = jnp.array([[1.0], [2.0]])
    module = _BN(follows_train=False)
    m = from_linen(module, module.init(jax.random.key(0), x, train=False), rngs=())
    with pytest.warns(fg.interop.EvalModeWarning,
                      match=r"train=False.*changed the model state: "
                            r"model_state\['batch_stats'\]\['BatchNorm_0'\]\['mean'\], "
                            r"model_state\['batch_stats'\]\['BatchNorm_0'\]\['var'\]"):
        _, state = m.apply(m.params, m.model_state, x, train=False)
    np.testing.assert_allclose(state["batch_stats"]["BatchNorm_0"]["mean"], [0.15], rtol=1e-6)
    # The CNN's own layers follow train=: its evaluation call warns nothing.
    cnn, batch = CNN(), _batch()
    c = from_linen(cnn, cnn.init(jax.random.key(0), batch["x"], train=False))
    c.apply(c.params, c.model_state, batch["x"], train=False)
