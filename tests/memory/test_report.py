"""funcgrad.memory.report: the compiled program's bytes, the jaxpr's residuals, and their
reconciliation (compile only, small shapes: each test a fraction of a second to a few)."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax_rules import tanh_residuals

import funcgrad as fg
from funcgrad.memory import MemoryReport, memory_report


def one_layer(w, x):
    return jnp.sum(jnp.tanh(x @ w))


def three_layers(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h)


W = jnp.full((8, 16), 0.1, jnp.float32)   # 8 * 16 * 4 = 512 bytes
X = jnp.ones((4, 8), jnp.float32)         # 4 * 8 * 4 = 128 bytes
WS = [jnp.full((8, 8), 0.1, jnp.float32) for _ in range(3)]  # 3 x 256 bytes


def test_one_layer_gradient_bytes_by_hand():
    r = memory_report(one_layer, W, X, grad=True)
    assert isinstance(r, MemoryReport) and r.mode == "grad"
    # Arguments: w (512 B) + x (128 B). The gradient w.r.t. w has w's shape: 512 B.
    assert (r.argument_bytes, r.output_bytes, r.alias_bytes) == (640, 512, 0)
    # The forward pass alone returns one float32 scalar: output 4 B (temp as XLA decides).
    assert r.forward_bytes >= 4
    # d/dw sum(tanh(x @ w)) = x^T (ct * (1 - t^2)) with t = tanh(x w): the vjp keeps x (an
    # input, 128 B, not differentiated here, so closed over) and, from tanh's jvp rule, (4, 16)
    # float32 values made from t, 4 * 16 * 4 = 256 B each (the same rule as in
    # tests/debug/test_graph.py's tanh_sum): JAX <= 0.11 keeps "output of tanh" and "output
    # of sub" (g * (1 + ans) * (1 - ans)): 512 B; JAX 0.12 keeps "output of
    # one_minus_square" (g * (1 - ans^2)): 256 B.
    kept = ["sub", "tanh"] if tanh_residuals() == 2 else ["one_minus_square"]
    rows = [(r_.origin, r_.shape, r_.nbytes) for r_ in r.residuals]
    assert ("argument", (4, 8), 128) in rows
    assert r.saved_activation_bytes == 256 * len(kept)
    assert sorted(row.primitive for row in r.residuals if row.origin == "output") == kept
    assert r.residual_bytes == sum(row.nbytes for row in r.residuals) == 128 + 256 * len(kept)
    x_row = next(row for row in r.residuals if row.origin == "argument")
    assert x_row.leaf == "x (not differentiated)"
    made = [row for row in r.residuals if row.origin == "output"]
    assert all("test_report.py" in row.source and "one_layer" in row.source for row in made)
    assert all(row.kept_by == "vjp default (no checkpoint)" for row in made)
    # The estimated peak is argument + output + temp - alias.
    assert r.peak_bytes == 640 + 512 + r.temp_bytes
    assert r.new_bytes == 512 + r.temp_bytes
    # Shapes alone give the same compiled figures (nothing is run).
    shapes = memory_report(one_layer, jax.ShapeDtypeStruct(W.shape, W.dtype),
                           jax.ShapeDtypeStruct(X.shape, X.dtype), grad=True)
    assert (shapes.argument_bytes, shapes.output_bytes, shapes.residual_bytes) == (
        640, 512, r.residual_bytes)


def test_to_dict_json_and_text_carry_the_same_figures():
    r = memory_report(three_layers, WS, X, grad=True)
    d = json.loads(r.to_json())
    # Arguments: three (8, 8) float32 weights and x. Outputs: the three weight gradients,
    # plus, on XLA:CPU, the tuple that holds them: one 8-byte pointer per element.
    assert d["argument_bytes"] == 3 * 256 + 128
    assert d["output_bytes"] == 3 * 256 + 3 * 8
    assert d["residual_bytes"] == sum(row["nbytes"] for row in d["residuals"])
    # Three layers, each saving its tanh output t (the next layer's input) and/or 1 - t^2,
    # all (4, 8) float32 = 128 B each: a multiple of 128 B, at least one per layer.
    assert d["saved_activation_bytes"] % 128 == 0 and d["saved_activation_bytes"] >= 3 * 128
    assert d["peak_bytes"] == d["argument_bytes"] + d["output_bytes"] + d["temp_bytes"]
    assert d["remat"] is None
    text = str(r)
    assert f"{r.peak_bytes:,}" in text and "the jaxpr's view" in text
    assert r.dominant in text and "dominate" in r.dominant


def test_whole_function_checkpoint_is_reported_as_no_compiled_saving():
    plain = memory_report(three_layers, WS, X, grad=True)
    ck = memory_report(jax.checkpoint(three_layers), WS, X, grad=True)
    # Under a whole-function checkpoint the vjp keeps only the inputs: no saved activations.
    assert ck.saved_activation_bytes == 0 and plain.saved_activation_bytes > 0
    assert all(row.kept_by == "input or constant (held anyway)" for row in ck.residuals)
    # The no-remat figures the report computes itself equal the plain function's report.
    assert ck.remat["jaxpr_residual_bytes"] == plain.saved_activation_bytes
    assert ck.remat["compiled_bytes"] == plain.temp_bytes + plain.output_bytes
    # The compiled gradient does not get smaller: said so, not implied as a saving.
    assert ck.temp_bytes + ck.output_bytes >= plain.temp_bytes + plain.output_bytes
    assert ck.remat["compiled_saving"] is False
    assert ck.reconciliation.startswith("No compiled saving")


def test_named_residuals_say_which_name_and_policy_kept_them():
    def net(ws, x):
        h = x
        for w in ws:
            h = checkpoint_name(jnp.tanh(h @ w), "act")
        return jnp.sum(h)

    policy = jax.checkpoint_policies.save_only_these_names("act")
    r = memory_report(jax.checkpoint(net, policy=policy), WS, X, grad=True, argnums=(0, 1))
    named = [row for row in r.residuals if row.origin == "named"]
    # The policy saves only values named 'act', each a (4, 8) float32 tanh output: 128 B, at
    # most one per layer; everything else the vjp keeps is an input.
    assert 1 <= len(named) <= 3 and all(row.nbytes == 4 * 8 * 4 for row in named)
    assert all(row.origin in ("named", "argument") for row in r.residuals)
    # The policy by name: JAX 0.10's policy objects print as SaveOnlyTheseNames(...), 0.12's
    # are closures of save_only_these_names, named by the factory and its names.
    assert all("'act'" in row.kept_by and re.search(
        "SaveOnlyTheseNames|save_only_these_names", row.kept_by) for row in named)
    assert all("test_report.py" in row.source for row in named)
    assert r.saved_activation_bytes == 128 * len(named)


def test_a_train_step_is_compiled_as_given():
    params = fg.mlp_init(jax.random.key(0), (8, 4, 3))
    tx = optax.sgd(0.1)

    def loss(p, b):
        return fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])

    step = fg.make_train_step(loss, tx)
    state = step.init(params)
    batch = {"x": np.ones((5, 8), np.float32), "y": np.zeros((5,), np.int32)}
    r = memory_report(step, state, batch)
    assert r.mode == "step" and r.residuals is None and r.forward_bytes is None
    # The step's arguments are every leaf of the state and the batch, counted from the arrays.
    expected = sum(np.asarray(x).nbytes for x in jax.tree.leaves((state, batch))
                   if not jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key))
    assert r.argument_bytes == expected


def test_trace_labels_its_residuals_as_the_jaxpr_view():
    text = fg.trace(one_layer, W, X).to_text()
    assert "the jaxpr's view" in text and "fg.memory_report" in text


def test_bad_input_says_what_to_do():
    with pytest.raises(TypeError, match="no differentiable input.*argnums="):
        memory_report(lambda n, x: jnp.sum(x), jnp.arange(3), X, grad=True)
    with pytest.raises(ValueError, match=r"real scalar loss.*f32\[4,16\].*jnp.mean"):
        memory_report(lambda w, x: jnp.tanh(x @ w), W, X, grad=True)
    with pytest.raises(TypeError, match="argument mode is a str.*functools.partial"):
        memory_report(lambda w, mode: jnp.sum(w), W, "sq")
    with pytest.raises(ValueError, match="argnums=5"):
        memory_report(one_layer, W, X, grad=True, argnums=5)
    for bad in (True, (0, 0)):  # a bool is not an index; an argument named twice
        with pytest.raises(ValueError, match="pass distinct int indices"):
            memory_report(one_layer, W, X, grad=True, argnums=bad)
    with pytest.raises(TypeError, match="must be a callable"):
        memory_report("loss", W, X)


def test_a_policy_names_itself_on_the_rows_it_kept():
    policy = jax.checkpoint_policies.dots_saveable
    r = memory_report(jax.checkpoint(three_layers, policy=policy), WS, X, grad=True)
    made = [row for row in r.residuals if row.origin == "output"]
    # dots_saveable keeps the matmul outputs, one (4, 8) float32 per layer at most: 128 B.
    assert made and all(row.primitive == "dot_general" and row.nbytes == 128 for row in made)
    assert all("jax.checkpoint, policy" in row.kept_by
               and re.search("DotsSaveable|dots_saveable", row.kept_by) for row in made)


def test_a_checkpoint_inside_scan_is_not_claimed_either_way():
    def scanned(w, x):
        body = jax.checkpoint(lambda h, _: (jnp.tanh(h @ w), None))
        return jnp.sum(jax.lax.scan(body, x, None, length=3)[0])

    r = memory_report(scanned, WS[0], X, grad=True)
    assert r.remat["compiled_saving"] is None
    assert "inside a loop" in r.reconciliation and "trust the compiled figures" in r.reconciliation


def test_funcgrad_remat_is_compared_with_the_same_function_without_it():
    # fg.remat's recomputation sits in a custom_vjp and a cond: the report inlines it and
    # compiles the plain gradient, whose bytes we compile here independently.
    def layer(p, h):
        return jnp.tanh(h @ p)

    ps = [jnp.eye(32) * 0.5 for _ in range(6)]
    x = jnp.ones((128, 32))

    def plain(ps, x):
        h = x
        for p in ps:
            h = layer(p, h)
        return jnp.mean(h ** 2)

    def ours(ps, x):
        return jnp.mean(fg.remat_sequential(layer, ps, x, segments=2) ** 2)

    def temp_out(f):
        m = jax.jit(jax.grad(f)).lower(ps, x).compile().memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes

    r = memory_report(ours, ps, x, grad=True)
    assert r.remat["compiled_bytes"] == temp_out(plain)
    assert r.remat["compiled_saving_bytes"] == temp_out(plain) - temp_out(ours) > 0
    assert "loop or cond body" not in r.reconciliation


def test_a_funcgrad_loss_is_taken_and_one_needing_a_key_is_told_to_bind():
    loss = fg.Loss(lambda w, batch: jnp.mean(batch["x"] @ w))
    plain = memory_report(lambda w, batch: jnp.mean(batch["x"] @ w), W, {"x": X}, grad=True)
    got = memory_report(loss, W, {"x": X}, grad=True)
    assert (got.temp_bytes, got.output_bytes) == (plain.temp_bytes, plain.output_bytes)
    keyed = fg.Loss(lambda w, batch, key: jnp.mean(batch["x"] @ w), takes_key=True)
    with pytest.raises(TypeError, match=r"takes key=.*loss.bind\(model_state, key\)"):
        memory_report(keyed, W, {"x": X}, grad=True)


# --- the report tells the truth about checkpoints (issue 25 point 5) ----------------------

WS8 = jnp.full((8, 16, 16), 0.1, jnp.float32)
X16 = jnp.ones((4, 16), jnp.float32)


def test_a_scan_over_a_checkpointed_body_says_the_checkpoint_kept_its_residuals():
    def scan_ck(ws, x):
        def body(h, w):
            return jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w), None
        h, _ = jax.lax.scan(body, x, ws)
        return jnp.sum(h)

    r = memory_report(scan_ck, WS8, X16, grad=True)
    # jax.checkpoint with no policy saves only its inputs: the carry h of each of the 8
    # iterations, (8, 4, 16) float32 = 2048 B, stacked by the scan.
    (row,) = [row for row in r.residuals if row.origin == "output"]
    assert (row.shape, row.nbytes) == ((8, 4, 16), 2048)
    assert "jax.checkpoint inside the scan body" in row.kept_by
    assert "no policy" in row.kept_by and "vjp default" not in row.kept_by


def test_a_policy_naming_no_checkpoint_name_is_flagged_with_the_names_that_exist():
    def named(ws, x):
        h = x
        for i in range(3):
            h = checkpoint_name(jnp.tanh(h @ ws[i]), "hidden")
        return jnp.sum(h)

    typo = jax.checkpoint_policies.save_only_these_names("hiden")
    r = memory_report(jax.checkpoint(named, policy=typo), WS8, X16, grad=True)
    (warning,) = r.warnings
    assert "'hiden'" in warning and "'hidden'" in warning and "saves nothing" in warning
    assert f"Warning: {warning}" in str(r)
    right = jax.checkpoint_policies.save_only_these_names("hidden")
    assert memory_report(jax.checkpoint(named, policy=right), WS8, X16, grad=True).warnings == ()


def test_a_name_on_a_scan_carry_is_said_to_save_nothing_more():
    def carried(ws, x):
        def body(h, w):
            return checkpoint_name(jnp.tanh(h @ w), "h"), None
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    r = memory_report(carried, WS8, X16, grad=True)
    assert any("'h'" in w and "scan carry" in w for w in r.warnings)


def test_fg_remat_is_not_reported_as_xla_removing_it_nor_its_predicate_as_dominant():
    def mlp(ws, x):
        h = x
        for i in range(8):
            h = jnp.tanh(h @ ws[i])
        return h

    r = memory_report(lambda ws, x: jnp.sum(fg.remat(mlp)(ws, x)), WS8, X16, grad=True)
    (pred,) = [row for row in r.residuals if "_runtime_true" in row.source]
    assert pred.nbytes == 1 and pred.kept_by.startswith("fg.remat's runtime predicate")
    assert "_runtime_true" not in r.dominant
    assert r.remat["verdict"].count("fg.remat") >= 1
    assert "XLA merged" not in r.remat["verdict"] and "removes the recomputation" not in \
        r.remat["verdict"]


def test_forward_alone_in_a_library_fusion_is_not_printed_as_a_measurement():
    r = memory_report(lambda ws, x: jnp.sum(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1])), WS8, X16,
                      grad=True)
    text = str(r)
    line = next(t for t in text.splitlines() if t.strip().startswith("forward alone"))
    # XLA:CPU hands such a forward pass to a library (YNNPACK) whose buffers no analysis
    # counts; on a backend without library fusions the figure is XLA's own and is shown.
    assert ("not measured" in line) == (r.forward_library_fusions > 0)
    assert (f"{r.forward_bytes:,}" in line) == (r.forward_library_fusions == 0)


# --- fuzz-found (tests/test_fuzz.py) ------------------------------------------------------------

def test_grad_mode_passes_integer_bool_and_key_leaves_through():
    # Found by the fuzz: with grad=True an int, bool or PRNG-key leaf among the parameters made
    # jax.grad raise "grad requires real- or complex-valued inputs" from inside the compile.
    # They take no gradient (JAX's zero-byte float0), as in every other tool.
    params = {"w": jnp.array([0.5, -1.0]), "n": 3, "flag": True, "key": jax.random.key(0),
              "raw": jax.random.PRNGKey(1)}

    def loss(p):
        noise = jax.random.uniform(p["key"], ()) + jax.random.uniform(p["raw"], ())
        return jnp.sum(jnp.sin(p["w"]) * p["n"]) * jnp.where(p["flag"], 1.0, 2.0) + noise

    report = memory_report(loss, params, grad=True)
    # The gradient output holds at least w's float32[2] (8 bytes) and nothing float for the rest.
    assert report.output_bytes >= 8 and report.mode == "grad"
