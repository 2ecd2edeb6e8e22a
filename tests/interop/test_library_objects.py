"""equinox modules, nnx Modules, States and Optimizers given whole to every tool (issue 13).

The rule (funcgrad._library_objects): an equinox module is taken as ``eqx.filter_grad`` takes
it by the analysis tools, the masks, the monitor and accumulation, and refused with the
``eqx.partition`` fix by the train state; an nnx State's integer and key leaves are not
differentiated; the train state refuses nnx Modules, non-Param Variables and nnx.Optimizer.
Leaves are named by the library's own paths, an nnx Variable's ``.value`` not being a level
(funcgrad._paths). Reference values come from a second method: ``eqx.filter_grad`` /
``jax.grad`` on the split model, or optax applied by hand.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")


# --- an equinox CNN with a function leaf and a string leaf --------------------------------

class _CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear
    act: Callable  # a function leaf (jax.nn.silu)
    tag: str       # a string leaf

    def __call__(self, x):  # x: (1, 4, 4), channel-first as equinox's Conv2d takes it
        h = self.act(self.conv(x))  # (2, 2, 2)
        return self.head(h.reshape(-1))


def _eqx_problem():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    model = _CNN(eqx.nn.Conv2d(1, 2, 3, key=k1), eqx.nn.Linear(8, 3, key=k2), jax.nn.silu, "cnn")
    x = jax.random.normal(k3, (5, 1, 4, 4))
    y = jax.random.normal(k4, (5, 3))

    def loss(params, batch):  # params: the whole module
        xb, yb = batch
        return jnp.mean((jax.vmap(params)(xb) - yb) ** 2)

    return model, (x, y), loss


def _float_names(model) -> list[str]:
    """``params.conv.weight``, ...: the module's floating leaves by its own paths, from
    equinox's own partition (independent of funcgrad's naming)."""
    arrays = eqx.filter(model, eqx.is_inexact_array)
    return ["params" + jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(arrays)[0]]


def _assert_same_grads(got, want, rtol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=1e-7)


def test_check_grads_takes_an_equinox_module_as_filter_grad_does():
    model, batch, loss = _eqx_problem()
    report = fg.check_grads(loss, model, batch)
    want = eqx.filter_grad(loss)(model, batch)
    assert report.ok, str(report)
    assert [r.path for r in report.rows] == _float_names(model)
    # Each row's analytic derivative at its worst element is eqx.filter_grad's element there
    # (checked in float64, so float32 rounding apart).
    for row, g in zip(report.rows, jax.tree.leaves(want)):
        np.testing.assert_allclose(row.analytic, np.asarray(g)[row.worst_index], rtol=1e-4)


def test_audit_takes_an_equinox_module():
    model, batch, loss = _eqx_problem()
    report = fg.audit(loss, model, batch)
    assert report.ok and [r.path for r in report.rows] == _float_names(model), str(report)


def test_explain_grads_takes_an_equinox_module():
    model, batch, loss = _eqx_problem()
    explanation = fg.explain_grads(loss, model, batch)
    want = eqx.filter_grad(loss)(model, batch)
    assert [r.path for r in explanation.rows] == _float_names(model)
    for row, g in zip(explanation.rows, jax.tree.leaves(want)):
        assert row.status == "connected"
        np.testing.assert_allclose(row.grad_norm, np.linalg.norm(np.asarray(g)), rtol=1e-5)


def test_find_nonfinite_takes_an_equinox_module_and_names_its_leaf():
    model, batch, loss = _eqx_problem()
    assert fg.find_nonfinite(loss, model, batch).ok
    broken = eqx.tree_at(lambda m: m.head.weight, model, model.head.weight.at[1, 2].set(jnp.nan))
    report = fg.find_nonfinite(loss, broken, batch)
    assert not report.ok and "params.head.weight" in str(report), str(report)


def test_trace_takes_an_equinox_module():
    model, batch, loss = _eqx_problem()
    graph = fg.trace(loss, model, batch, residuals=False)
    names = [leaf.path for leaf in graph.leaves]
    assert names[:4] == _float_names(model) and names[4:] == ["batch[0]", "batch[1]"]
    assert all(leaf.reaches_output for leaf in graph.leaves)


def test_intermediate_grads_of_an_equinox_module_equal_filter_grad():
    model, batch, loss = _eqx_problem()

    def tapped(params, batch):
        xb, yb = batch
        out = fg.tap("out", jax.vmap(params)(xb))
        return jnp.mean((out - yb) ** 2)

    value, grads, taps = fg.intermediate_grads(tapped)(model, batch)
    _assert_same_grads(grads, eqx.filter_grad(loss)(model, batch))
    # d mean((out - y)^2) / d out = 2 (out - y) / out.size, by hand.
    out = jax.vmap(model)(batch[0])
    np.testing.assert_allclose(taps["out"], 2 * (out - batch[1]) / out.size, rtol=1e-6)
    np.testing.assert_allclose(value, loss(model, batch), rtol=1e-6)


def test_accumulate_grads_of_an_equinox_module_equal_filter_grad_of_the_mean():
    model, batch, loss = _eqx_problem()

    def per_example(params, batch):
        xb, yb = batch
        return jnp.mean((jax.vmap(params)(xb) - yb) ** 2, axis=-1)

    x, y = batch  # 5 examples: micro-batches of 2 + 2 + 1 (padded, masked)
    micro = fg.stack_microbatches([(x[i:i + 2], y[i:i + 2]) for i in (0, 2, 4)])
    acc = fg.accumulate_grads(per_example, model, micro)
    # The mean over all 5 examples of the per-example loss is `loss` itself.
    _assert_same_grads(acc.grads, eqx.filter_grad(loss)(model, batch), rtol=1e-5)


def test_trainable_mask_and_requires_grad_take_an_equinox_module():
    model, batch, loss = _eqx_problem()
    mask = fg.trainable_mask(model, freeze="conv/*")
    params, static = eqx.partition(model, eqx.is_inexact_array)
    # The mask has the structure of the floating part (what the optimizer sees) ...
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    assert jax.tree.leaves(mask) == [False, False, True, True]  # conv.weight/bias, head.*
    # ... and freezes exactly the conv in a step on that part (frozen: bit for bit).
    tx = fg.train_only(optax.sgd(0.1), mask)
    grads = eqx.filter_grad(loss)(model, batch)
    new = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    assert (new.conv.weight == params.conv.weight).all()
    np.testing.assert_allclose(new.head.weight, params.head.weight - 0.1 * grads.head.weight)

    def outputs(m, x):
        return m(x), jax.lax.stop_gradient(m(x)), m.conv(x)

    x = batch[0][0]
    assert fg.requires_grad(outputs, mask)(model, x) == (True, False, False)
    assert fg.requires_grad(outputs, True)(model, x) == (True, False, True)


def test_monitor_init_takes_an_equinox_module_and_groups_by_its_layers():
    model, batch, loss = _eqx_problem()
    monitor = fg.GradMonitor()
    state = monitor.init(model)
    _, metrics = monitor.measure(state, eqx.filter_grad(loss)(model, batch))
    assert metrics.layer_names == ("params.conv", "params.head")
    assert list(metrics.leaf_names) == _float_names(model)


def test_the_train_state_refuses_an_equinox_module_with_the_partition_fix():
    model, batch, loss = _eqx_problem()
    with pytest.raises(TypeError, match=r"equinox module \(_CNN\); its leaf params\.act is a "
                       r".*eqx\.partition\(model, eqx\.is_inexact_array\).*eqx\.combine"):
        fg.make_train_step(lambda p, b: loss(p, b), optax.adam(1e-2)).init(model)
    hand_made = fg.TrainState(params=model, opt_state=(), step=jnp.zeros((), jnp.int32))
    step = fg.make_train_step(lambda p, b: loss(p, (b["x"], b["y"])), optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"fit: params is an equinox module.*eqx\.partition"):
        fg.fit(step, hand_made, fg.Batches(batch[0], batch[1], batch_size=5), epochs=1,
               progress=False)
    # The fix the message gives trains: one step equals optax's update of eqx.filter_grad.
    params, static = eqx.partition(model, eqx.is_inexact_array)
    step = fg.make_train_step(lambda p, b: loss(eqx.combine(p, static), b), optax.adam(1e-2))
    state, _ = step(step.init(params), batch)
    tx = optax.adam(1e-2)
    updates, _ = tx.update(eqx.filter_grad(loss)(model, batch), tx.init(params), params)
    _assert_same_grads(state.params, optax.apply_updates(params, updates), rtol=1e-6)


# --- flax nnx -----------------------------------------------------------------------------

class _Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.bn1 = nnx.BatchNorm(4, use_running_average=True, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)
        self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn1(self.l1(x)))))


def _nnx_problem():
    module = _Net(nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(module)  # Params, BatchStats, RngCount (uint32), RngKey
    x = jax.random.normal(jax.random.key(1), (6, 3))
    y = jax.random.normal(jax.random.key(2), (6, 2))

    def loss(params, batch, *rest):  # params: an nnx State; rest: the other States, if split
        xb, yb = batch
        return jnp.mean((nnx.merge(graphdef, params, *rest)(xb) - yb) ** 2)

    return module, state, (x, y), loss


_PARAM_NAMES = ["params['bn1']['bias']", "params['bn1']['scale']", "params['l1']['bias']",
                "params['l1']['kernel']", "params['l2']['bias']", "params['l2']['kernel']"]


def test_nnx_leaves_are_named_without_the_value_level_in_every_report():
    module, state, batch, loss = _nnx_problem()
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    loss_p = lambda params, batch: loss(params, batch, rest)
    assert [r.path for r in fg.check_grads(loss_p, params, batch).rows] == _PARAM_NAMES
    assert [r.path for r in fg.explain_grads(loss_p, params, batch).rows] == _PARAM_NAMES
    assert [leaf.path for leaf in fg.trace(loss_p, params, batch, residuals=False).leaves
            ][:6] == _PARAM_NAMES
    kernel = params["l2"]["kernel"][...]
    broken = jax.tree.map(lambda v: v.at[0, 0].set(jnp.inf) if v is kernel else v, params)
    assert fg.find_nonfinite(loss_p, broken, batch).where == "params['l2']['kernel']"
    # An nnx Module given whole is a pytree of its Variables: attribute paths, no '.value';
    # the RngCount and RngKey are not differentiated.
    whole = fg.explain_grads(lambda params, b: jnp.mean((params(b[0]) - b[1]) ** 2), module,
                             batch)
    assert [(r.path, r.status) for r in whole.rows][3:7] == [
        ("params.bn1.var", "connected"), ("params.drop.rngs.count", "not_differentiable"),
        ("params.drop.rngs.key", "not_differentiable"), ("params.l1.bias", "connected")]
    # Mask patterns use the same paths: 'bn1/scale', not 'bn1/scale/value'.
    mask = fg.trainable_mask(params, freeze="bn1/scale")
    assert [bool(m) for m in jax.tree.leaves(mask)] == [True, False, True, True, True, True]


def test_the_monitor_groups_nnx_leaves_by_module():
    module, _, batch, loss = _nnx_problem()
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    grads = jax.grad(lambda p: loss(p, batch, rest))(params)
    monitor = fg.GradMonitor()
    _, metrics = monitor.measure(monitor.init(params), grads)
    assert metrics.layer_names == ("params['bn1']", "params['l1']", "params['l2']")
    assert list(metrics.leaf_names) == _PARAM_NAMES
    # Layer norm = root-sum-of-squares of its leaves' norms (Pascanu et al. 2013's norm).
    l1 = np.sqrt(sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(grads["l1"])))
    np.testing.assert_allclose(metrics.to_dict()["layer_norm"]["params['l1']"], l1, rtol=1e-5)


def test_an_nnx_state_with_rng_count_and_key_works_in_the_analysis_tools():
    module, state, batch, loss = _nnx_problem()
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    # Reference: jax.grad with allow_int (float leaves: Params and BatchStats).
    _, grads, _ = fg.intermediate_grads(loss)(state, batch)
    want = jax.grad(lambda s: loss(s, batch), allow_int=True)(state)
    for i, (g, w) in enumerate(zip(jax.tree.leaves(grads), jax.tree.leaves(want))):
        if jnp.issubdtype(w.dtype, jnp.floating):
            np.testing.assert_allclose(g, w, rtol=1e-6)
        else:  # RngCount (uint32), RngKey: not differentiated, JAX's float0
            assert g.dtype == jax.dtypes.float0, i
    assert fg.find_nonfinite(loss, state, batch).ok
    report = fg.check_grads(loss, state, batch)
    assert report.ok and any("params['drop']['rngs']['count'] (uint32" in s
                             for s in report.skipped), report.skipped


def test_the_train_state_refuses_nnx_objects_with_the_fix():
    module, state, batch, loss = _nnx_problem()
    optimizer = nnx.Optimizer(module, optax.adam(1e-3), wrt=nnx.Param)
    # (A state comes from a step, which refuses the nnx.Optimizer first.)
    for make in (lambda: fg.make_optimizer(optimizer),
                 lambda: fg.make_train_step(loss, optimizer)):
        with pytest.raises(TypeError, match=r"optimizer is an nnx\.Optimizer.*optax\.adam"
                                            r"\(1e-3\).*funcgrad\.interop\.from_nnx"):
            make()
    with pytest.raises(TypeError, match=r"params is an nnx Module \(_Net\).*"
                                        r"nnx\.split\(module, nnx\.Param, \.\.\.\).*from_nnx"):
        fg.make_train_step(loss, optax.adam(1e-3)).init(module)
    # BatchStats given to the optimizer would never move as running statistics: refused.
    with pytest.raises(TypeError, match=r"params\['bn1'\]\['mean'\] \(BatchStat\).*"
                                        r"params\['drop'\]\['rngs'\]\['count'\] \(RngCount\).*"
                                        r"nnx\.split\(module, nnx\.Param, \.\.\.\)"):
        fg.make_train_step(loss, optax.adam(1e-3)).init(state)
    # A state of Params alone trains; one step equals optax's update of jax.grad.
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    loss_p = lambda p, b: loss(p, b, rest)
    step = fg.make_train_step(loss_p, optax.sgd(0.1))
    new, _ = step(step.init(params), batch)
    grads = jax.grad(loss_p)(params, batch)
    _assert_same_grads(new.params, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))


def test_a_whole_linen_variables_dict_is_refused_with_the_split():
    """{'params', 'batch_stats'} given whole would train the statistics as weights (their
    gradient is 0, so they never move): refused, naming from_linen and the split."""
    variables = {"params": {"w": jnp.ones((2,))}, "batch_stats": {"mean": jnp.zeros((2,))}}
    with pytest.raises(TypeError, match=r"'batch_stats'.*from_linen"):
        fg.make_train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1)).init(variables)
    stateful = fg.make_train_step(
        fg.Loss(lambda p, b, *, model_state: (jnp.sum(p["w"]), model_state), has_state=True),
        optax.sgd(0.1))
    stateful.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})


# --- issue 25.2: a Python float field of an equinox module is named, never dropped ----------

class _Scaled(eqx.Module):
    """out = scale * (w . x): `scale` is a Python float, which equinox treats as static."""
    w: jax.Array
    scale: float

    def __call__(self, x):
        return self.scale * jnp.dot(self.w, x)


def _scaled_problem():
    model = _Scaled(jnp.array([1.0, 2.0]), 0.5)
    x = jnp.array([3.0, 4.0])

    def loss(m, x):
        return (m(x) - 10.0) ** 2

    # By hand: w . x = 11, out = 5.5, loss = (5.5 - 10)^2 = 20.25;
    # d loss / d w = 2 (out - 10) scale x = -4.5 x = [-13.5, -18];
    # d loss / d scale = 2 (out - 10) (w . x) = -99.
    return model, x, loss


_FLOAT_REASON = (r"Python float 0\.5: equinox treats it as static, so it is not differentiated "
                 r"and never trains; write jnp\.asarray\(0\.5\) to train it")


def test_check_grads_and_audit_list_a_python_float_field_as_skipped_with_the_reason():
    model, x, loss = _scaled_problem()
    for report in (fg.check_grads(loss, model, x), fg.audit(loss, model, x)):
        assert [r.path for r in report.rows] == ["m.w"] and report.ok, str(report)
        np.testing.assert_allclose(report.rows[0].analytic, -13.5, rtol=1e-6)  # by hand
        assert len(report.skipped) == 1, report.skipped
        assert re.match(r"m\.scale \(" + _FLOAT_REASON, report.skipped[0]), report.skipped
        assert "skipped: m.scale (Python float 0.5" in str(report)
    # A float outside the checked arguments is not the check's to list.
    two = fg.check_grads(lambda w, m: loss(eqx.tree_at(lambda m: m.w, m, w), x), model.w, model)
    assert two.skipped == []


def test_explain_grads_lists_a_python_float_field_with_status_static():
    model, x, loss = _scaled_problem()
    explanation = fg.explain_grads(loss, model, x)
    # One row per leaf of the module, in its order (jax.tree.leaves(model): w, scale).
    assert [(r.path, r.status) for r in explanation.rows] == [("m.w", "connected"),
                                                              ("m.scale", "static")]
    np.testing.assert_allclose(explanation["m.w"].grad_norm, np.hypot(13.5, 18.0), rtol=1e-6)
    row = explanation["m.scale"]
    assert row.grad_norm == 0.0 and re.match(_FLOAT_REASON, row.detail), row.detail
    assert "m.scale" in str(explanation) and "jnp.asarray(0.5)" in str(explanation)
    assert len(jax.tree.leaves(model)) == len(explanation.rows)


def test_the_other_tools_warn_about_a_python_float_field_they_leave_out():
    model, x, loss = _scaled_problem()
    with pytest.warns(fg.interop.StaticFieldWarning, match=r"m\.scale.*" + _FLOAT_REASON):
        _, grads, _ = fg.intermediate_grads(loss)(model, x)
    np.testing.assert_allclose(grads.w, [-13.5, -18.0], rtol=1e-6)  # by hand
    with pytest.warns(fg.interop.StaticFieldWarning, match=r"params\.scale"):
        fg.trainable_mask(model)
    with pytest.warns(fg.interop.StaticFieldWarning, match=r"m\.scale"):
        assert fg.find_nonfinite(loss, model, x).ok
    # equinox's own layers hold Python floats that are settings (eqx.nn.Dropout's rate p):
    # not listed, no warning (pyproject's filterwarnings turns one into an error).
    drop = eqx.nn.Sequential([eqx.nn.Linear(2, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.3)])
    assert fg.check_grads(lambda m, x: jnp.sum(eqx.nn.inference_mode(m)(x)), drop, x).skipped == []
    fg.trainable_mask(drop)


def test_the_train_state_refusal_gives_the_fix_that_trains_a_python_float_field():
    model, x, loss = _scaled_problem()
    with pytest.raises(TypeError, match=r"params\.scale is a Python float \(0\.5\).*static.*"
                       r"eqx\.partition.*from_equinox.*never train.*"
                       r"model = eqx\.tree_at\(lambda m: m\.scale, model, jnp\.asarray\(0\.5\)\)"
                       r".*eqx\.field\(static=True\)"):
        fg.make_train_step(loss, optax.sgd(0.1)).init(model)
    # The fix, then the partition the message gives: one SGD step moves scale by -0.1 x (-99).
    model = eqx.tree_at(lambda m: m.scale, model, jnp.asarray(0.5))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    step = fg.make_train_step(lambda p, b: loss(eqx.combine(p, static), b), optax.sgd(0.1))
    state, _ = step(step.init(params), x)
    np.testing.assert_allclose(state.params.scale, 0.5 + 0.1 * 99.0, rtol=1e-6)
    np.testing.assert_allclose(state.params.w, [1.0 + 1.35, 2.0 + 1.8], rtol=1e-6)
