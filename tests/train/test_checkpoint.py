"""Checkpoints of a TrainState: a run stopped, saved, restored and continued gives the bits of
the run that never stopped, for every kind of state the train step keeps."""
import ast
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.train.checkpoint import (
    Restored,
    latest_checkpoint_step,
    restore_checkpoint,
    save_checkpoint,
)
from tests.train._problems import mlp_problem


def _bits(leaf):
    """A leaf as its raw bits (a typed key: its key data): equal bits, not just equal values
    (NaN statistics in the monitor's vector, -0.0)."""
    data = np.asarray(jax.random.key_data(leaf) if jax.dtypes.issubdtype(
        leaf.dtype, jax.dtypes.prng_key) else leaf)
    return data.view(f"u{data.dtype.itemsize}")


def assert_same_bits(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _batches(n, x_shape, classes):
    keys = jax.random.split(jax.random.key(7), n)
    return [{"x": jax.random.normal(k, x_shape), "y": jnp.arange(x_shape[0]) % classes}
            for k in keys]


def _noisy_mlp_loss(params, batch, *, key):
    # The key enters the loss (a random logit shift), so a wrong restored key changes the run.
    logits = fg.mlp_apply(params, batch["x"])
    return fg.softmax_cross_entropy(logits + 0.1 * jax.random.normal(key, logits.shape),
                                    batch["y"])


def _mlp(optimizer=("adam", 1e-2), *, cast=None, takes_key=False, trainable=None,
         monitor=None, loss_scale=None, **init):
    """A case: (step, make_state(**step.init options to change), five batches)."""
    params, _, loss_fn = mlp_problem()
    params = params if cast is None else fg.cast_floating(params, cast)
    opt = fg.make_optimizer(*optimizer)
    if monitor is not None:
        opt = optax.chain(monitor, opt)
    mask = None if trainable is None else fg.trainable_mask(params, train=trainable)
    loss = fg.Loss(_noisy_mlp_loss, takes_key=True) if takes_key else loss_fn
    if loss_scale is not None:
        loss = fg.mixed_precision(loss, jnp.bfloat16, loss_scale=loss_scale)
    step = fg.make_train_step(loss, opt, trainable=mask)
    make_state = lambda **like: step.init(params, **{**init, **like})
    return step, make_state, _batches(5, (5, 6), 3)


def _cnn():
    params, model_state = fg.cnn_init(jax.random.key(0), channels=(1,), num_classes=3)
    loss = fg.Loss(functools.partial(fg.cnn_loss, dropout_rate=0.5), has_state=True,
                   takes_key=True)
    opt = fg.make_optimizer("momentum", 1e-2)
    step = fg.make_train_step(loss, opt)
    make_state = lambda seed=0: step.init(params, model_state=model_state, seed=seed)
    return step, make_state, _batches(5, (4, 8, 8), 3)


# Each case compiles one step (most of this file's time), so the kinds of state share cases.
CASES = {
    "adam-monitor-loss-scale": lambda: _mlp(monitor=fg.grad_monitor(),
                                            loss_scale=fg.dynamic_loss_scale()),
    "cnn-batchnorm-typed-key": _cnn,  # seed=0: a typed key
    "raw-key-trainable-schedule": lambda: _mlp(
        ("adam", optax.linear_schedule(1e-2, 1e-3, 4)), takes_key=True, trainable="1/*",
        key=jax.random.PRNGKey(0)),
    "bfloat16-adam": lambda: _mlp(cast=jnp.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.filterwarnings("ignore:params.* is bfloat16, and the step updates it:RuntimeWarning")
def test_stop_save_restore_continue_equals_the_run_that_never_stopped(case, tmp_path):
    step, make_state, batches = CASES[case]()
    # `like` is a step-0 state built as the run's, but with another base key: its values are
    # not what comes back (the key does not change as the run steps: only a restore sets it).
    like = {"cnn-batchnorm-typed-key": {"seed": 1},
            "raw-key-trainable-schedule": {"key": jax.random.PRNGKey(1)}}.get(case, {})
    k = 3
    uninterrupted = make_state()
    for batch in batches:
        uninterrupted, _ = step(uninterrupted, batch)

    state = make_state()
    for batch in batches[:k]:
        state, _ = step(state, batch)
    path = save_checkpoint(tmp_path, state, position={"batch": k}, history={"step": [1, 2, 3]})
    assert path == os.path.join(tmp_path, str(k)) and os.path.isdir(path)

    restored = restore_checkpoint(tmp_path, make_state(**like))
    assert isinstance(restored, Restored) and restored.step == k == int(restored.state.step)
    assert (restored.position, restored.history) == ({"batch": k}, {"step": [1, 2, 3]})
    assert_same_bits(restored.state, state)
    continued = restored.state
    for batch in batches[k:]:
        continued, _ = step(continued, batch)
    assert_same_bits(continued, uninterrupted)
    assert int(continued.step) == len(batches)


def _sgd_step(**init):
    """A step that is never called (nothing compiles): its `init` makes the states below.
    SGD (no optimizer state); `init` the step.init options (model_state=, seed=, key=)."""
    loss = lambda p, b: jnp.sum(p["p"] ** 2)
    if "model_state" in init:
        loss = fg.Loss(lambda p, b, *, model_state: (jnp.sum(p["p"] ** 2), model_state),
                       has_state=True)
    elif "seed" in init or "key" in init:
        loss = fg.Loss(lambda p, b, *, key: jnp.sum(p["p"] ** 2), takes_key=True)
    return fg.make_train_step(loss, "sgd")


def _init(params, **init):
    """``step.init(params, **init)`` of a `_sgd_step` made for those options."""
    return _sgd_step(**init).init(params, **init)


def _tiny_state(value, step):
    # A state saved without compiling a step: params {"p": value}, SGD (no optimizer state).
    state = fg.make_train_step(lambda p, b: jnp.sum(p["p"] ** 2), optax.sgd(0.1)).init(
        {"p": jnp.full((2,), value, jnp.float32)})
    return state._replace(step=jnp.asarray(step, jnp.int32))


def test_keep_prunes_older_checkpoints_and_step_restores_a_kept_one(tmp_path):
    for s in range(1, 5):
        save_checkpoint(tmp_path, _tiny_state(float(s), s), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["3", "4"] and latest_checkpoint_step(tmp_path) == 4
    like = _tiny_state(0.0, 0)
    assert float(restore_checkpoint(tmp_path, like).state.params["p"][0]) == 4.0
    assert float(restore_checkpoint(tmp_path, like, step=3).state.params["p"][0]) == 3.0
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 1 .*steps \[3, 4\]"):
        restore_checkpoint(tmp_path, like, step=1)


def test_a_save_interrupted_before_its_commit_leaves_the_previous_one(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _tiny_state(1.0, 1))
    rename = os.rename

    def crash_at_commit(src, dst):  # orbax renames <step>.orbax-checkpoint-tmp to <step> last
        if os.path.basename(dst) == "2":
            raise OSError("simulated crash before the commit")
        rename(src, dst)
    monkeypatch.setattr(os, "rename", crash_at_commit)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, _tiny_state(2.0, 2))
    monkeypatch.setattr(os, "rename", rename)
    left = [n for n in os.listdir(tmp_path) if n != "1"]
    assert len(left) == 1 and left[0].startswith("2.orbax-checkpoint-tmp")  # the partial save
    # A hand-made partial folder of a later step (a process killed mid-write) is ignored too.
    os.makedirs(tmp_path / "9.orbax-checkpoint-tmp-1234" / "state")
    assert latest_checkpoint_step(tmp_path) == 1
    restored = restore_checkpoint(tmp_path, _tiny_state(0.0, 0))
    assert restored.step == 1 and float(restored.state.params["p"][0]) == 1.0
    # The next save succeeds and removes the unfinished folders.
    save_checkpoint(tmp_path, _tiny_state(3.0, 3))
    assert sorted(os.listdir(tmp_path)) == ["1", "3"]


def test_position_and_history_round_trip_as_json_with_nan_and_inf(tmp_path):
    position = {"epoch": 2, "batch": np.int64(7), "seed": 0, "order": (3, 1, 2)}
    history = {"loss": [np.float32(0.5), float("nan"), float("inf")],
               "accuracy": jnp.array([0.25, 0.75]), "note": None, "ok": True}
    save_checkpoint(tmp_path, _tiny_state(1.0, 1), position=position, history=history)
    r = restore_checkpoint(tmp_path, _tiny_state(0.0, 0))
    # JSON types: numpy/JAX numbers and arrays as Python ones, the tuple as a list.
    assert r.position == {"epoch": 2, "batch": 7, "seed": 0, "order": [3, 1, 2]}
    assert type(r.position["batch"]) is int
    loss = r.history["loss"]
    assert loss[0] == 0.5 and math.isnan(loss[1]) and loss[2] == math.inf
    assert r.history["accuracy"] == [0.25, 0.75] and r.history["note"] is None
    assert r.history["ok"] is True
    assert restore_checkpoint(tmp_path, _tiny_state(0.0, 0)).step == 1


def test_position_and_history_without_json_form_are_refused(tmp_path):
    with pytest.raises(TypeError,
                       match=r"history\['log'\]\[1\] has type object, which has no JSON"):
        save_checkpoint(tmp_path, _tiny_state(1.0, 1), history={"log": [1, object()]})
    with pytest.raises(TypeError, match="position has the key 0; keys must be str"):
        save_checkpoint(tmp_path, _tiny_state(1.0, 1), position={0: 1})
    assert latest_checkpoint_step(tmp_path) is None  # nothing was written


def test_no_checkpoint_is_a_clear_error(tmp_path):
    like = _tiny_state(0.0, 0)
    with pytest.raises(FileNotFoundError, match="no checkpoint at any step .* it does not exist"):
        restore_checkpoint(tmp_path / "missing", like)
    assert latest_checkpoint_step(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        restore_checkpoint(tmp_path, like)


def test_a_checkpoint_written_by_something_else_is_refused(tmp_path):
    from funcgrad.train.checkpoint import _orbax
    ocp = _orbax()  # orbax, with its own deprecated uses of JAX silenced
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path, options=options, item_names=("state", "meta")) as m:
        m.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(2)}),
                                          meta=ocp.args.JsonSave({"epoch": 1})))
    with pytest.raises(ValueError, match=r"not a funcgrad checkpoint .*format entry is None"):
        restore_checkpoint(tmp_path, _tiny_state(0.0, 0))


def test_a_like_of_another_structure_names_the_first_differing_leaf(tmp_path):
    params = {"p": jnp.ones((2,), jnp.float32)}
    loss = lambda p, b: jnp.sum(p["p"] ** 2)
    monitored = fg.make_train_step(loss, optax.chain(fg.grad_monitor(),
                                                      fg.make_optimizer("sgd")))
    save_checkpoint(tmp_path, monitored.init(params))
    # Saved: params['p'], the monitor's values (the first state of the chain, a tuple), step;
    # like without a monitor has params['p'], step (plain SGD keeps no optimizer state).
    with pytest.raises(ValueError, match=r"leaf 1 is state\.opt_state\[0\]\.values where like "
                                         r"has state\.step \(3 saved leaves, 2 in like; fields "
                                         r"set when saved: params, opt_state, step; in like: "
                                         r"params, step\)\. Build `like`"):
        restore_checkpoint(tmp_path, fg.make_train_step(loss, "sgd").init(params))


@pytest.mark.parametrize("like, message", [
    (lambda p: _init(fg.cast_floating(p, jnp.bfloat16), seed=0),
     r"state\.params\['p'\] was saved as float32 of shape \(2,\), but like has bfloat16 of "
     r"shape \(2,\)"),
    (lambda p: _init({"p": jnp.ones((3,), jnp.float32)}, seed=0),
     r"state\.params\['p'\] was saved as float32 of shape \(2,\), but like has float32 of "
     r"shape \(3,\)"),
    (lambda p: _init(p, key=jax.random.PRNGKey(0)),
     r"state\.key was saved as a typed PRNG key \(threefry2x32\) with key data uint32 of shape "
     r"\(2,\), but like has uint32 of shape \(2,\)"),
], ids=["dtype", "shape", "raw-key-for-typed-key"])
def test_a_like_with_another_dtype_or_shape_is_refused(tmp_path, like, message):
    params = {"p": jnp.ones((2,), jnp.float32)}
    save_checkpoint(tmp_path, _init(params, seed=0))
    with pytest.raises(ValueError, match=message):
        restore_checkpoint(tmp_path, like(params))


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="state must be a funcgrad TrainState"):
        save_checkpoint(tmp_path, {"p": jnp.ones(2)})
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        save_checkpoint(tmp_path, _tiny_state(1.0, 1), keep=0)
    with pytest.raises(TypeError, match="like must be a funcgrad TrainState"):
        restore_checkpoint(tmp_path, {"p": jnp.ones(2)})
    save_checkpoint(tmp_path, _tiny_state(1.0, 5))
    # Saving an earlier or the same step next to a later one would make restore return the
    # other run's state.
    for step in (5, 2):
        with pytest.raises(ValueError, match=r"already holds checkpoints at steps \[5\]"):
            save_checkpoint(tmp_path, _tiny_state(1.0, step))


def test_missing_orbax_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import then raises ImportError
    with pytest.raises(ImportError, match="pip install orbax-checkpoint"):
        save_checkpoint(tmp_path, _tiny_state(1.0, 1))
    with pytest.raises(ImportError, match="pip install orbax-checkpoint"):
        restore_checkpoint(tmp_path, _tiny_state(1.0, 1))


def test_no_funcgrad_module_imports_orbax_when_imported():
    # orbax takes seconds to import: funcgrad imports it inside the checkpoint functions only,
    # so `import funcgrad` stays as fast as it was. Every module-level import is checked (not
    # those inside a def): a run of `python -c "import funcgrad"` costs seconds of this suite.
    root = os.path.dirname(fg.__file__)
    found = []
    for folder, _, files in os.walk(root):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            found += [f"{os.path.relpath(path, root)}:{node.lineno}"
                      for node in _module_level(tree)
                      if isinstance(node, ast.Import) and any(
                          a.name.split(".")[0] == "orbax" for a in node.names)
                      or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0]
                      == "orbax"]
    assert found == []
    assert any(name == "checkpoint.py" for name in os.listdir(os.path.join(root, "train")))


def _module_level(tree):
    """The statements that run when the module is imported (not inside a def or lambda)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def test_numpy_python_and_empty_leaves_come_back_as_the_kind_like_holds(tmp_path):
    # A model state may hold numpy arrays and Python numbers (a counter); orbax cannot store
    # an array of size 0, so its dtype and shape are checked and the leaf is like's.
    model_state = {"seen": 7, "rate": 0.25, "hist": np.arange(3, dtype=np.int32),
                   "empty": jnp.zeros((0, 2), jnp.float32)}
    state = _init({"p": jnp.ones((2,), jnp.float32)}, model_state=model_state)
    save_checkpoint(tmp_path, state)
    like = _init({"p": jnp.zeros((2,), jnp.float32)}, model_state={
        "seen": 0, "rate": 0.0, "hist": np.zeros(3, np.int32), "empty": jnp.zeros((0, 2))})
    r = restore_checkpoint(tmp_path, like).state
    assert r.model_state["seen"] == 7 and type(r.model_state["seen"]) is int
    assert r.model_state["rate"] == 0.25 and type(r.model_state["rate"]) is float
    assert type(r.model_state["hist"]) is np.ndarray
    np.testing.assert_array_equal(r.model_state["hist"], [0, 1, 2])
    assert r.model_state["empty"].shape == (0, 2)
    np.testing.assert_array_equal(r.params["p"], [1.0, 1.0])
