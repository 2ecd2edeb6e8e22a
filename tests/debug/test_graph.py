"""funcgrad.debug.graph: nodes, leaves, fan-out points, nested jaxprs, residuals, text, DOT output.

Every expected value is derived by hand in the comment above its assertion, from the jaxpr
JAX records (``jax.make_jaxpr``) or from the vjp rules of the primitives involved.
"""
import json
import math
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_rules import tanh_residuals

import funcgrad as fg
from funcgrad.debug.graph import Graph, trace


def affine(x, w, b):
    return x * w + b


def test_affine_nodes_leaves_and_edges():
    x, w, b = (jnp.ones((3, 4), jnp.float32) for _ in range(3))
    g = trace(affine, x, w, b)
    # x * w + b on equal shapes records two equations, mul then add (no broadcast needed).
    assert [n.primitive for n in g.nodes] == ["mul", "add"]
    # Leaves are named by parameter name (each argument is a single array, so no key path).
    assert [leaf.path for leaf in g.leaves] == ["x", "w", "b"]
    assert all(leaf.reaches_output for leaf in g.leaves)
    mul, add = g.nodes
    # mul takes the leaves x and w; its single output is add's first input.
    assert [g.values[i].name for i in mul.inputs] == ["x", "w"]
    assert add.inputs[0] == mul.outputs[0] and g.values[add.inputs[1]].name == "b"
    # Every edge is an elementwise result of (3, 4) float32 arrays.
    for vid in (*mul.inputs, *mul.outputs, *add.inputs, *add.outputs):
        assert (g.values[vid].shape, g.values[vid].dtype) == ((3, 4), "float32")
    # The output is add's result, named "out" (a single array is returned).
    assert [(o.name, o.value) for o in g.outputs] == [("out", add.outputs[0])]
    assert g.values[add.outputs[0]].producer == add.id
    # Each value has one use here: no fan-out.
    assert g.fanouts == ()
    # vjp of mul: ct_x = ct * w and ct_w = ct * x, so x and w are saved: 2 x 12 x 4 B = 96 B;
    # the vjp of add needs nothing.
    assert g.residual_bytes == 96
    assert sorted(r.leaf for r in g.residuals) == ["w", "x"]
    text = str(g)
    for word in ("mul", "add", "x:f32[3,4]", "out:f32[3,4]", "96 bytes"):
        assert word in text


def test_pytree_leaves_and_outputs_are_named_by_path():
    params = {"layers": [{"w": jnp.ones(2)}], "scale": jnp.float32(2.0)}

    def f(params, x):
        return {"loss": jnp.sum(params["layers"][0]["w"] * x) * params["scale"], "x": x}

    g = trace(f, params, jnp.ones(2))
    # jax.tree.leaves orders dict keys alphabetically: layers before scale; then x.
    assert [leaf.path for leaf in g.leaves] == ["params['layers'][0]['w']", "params['scale']", "x"]
    # Outputs are named "out" plus the key path of the returned dict, keys sorted.
    assert [o.name for o in g.outputs] == ["out['loss']", "out['x']"]


def square_plus_sin(x):
    return x * x + jnp.sin(x)


def test_fan_out_counts_each_use_and_cotangents_sum():
    g = trace(square_plus_sin, jnp.float32(0.5))
    # make_jaxpr records: v1 = mul x x; v2 = sin x; out = add v1 v2. x is an operand twice in
    # mul and once in sin: 3 uses. v1 and v2 are used once each.
    assert [n.primitive for n in g.nodes] == ["mul", "sin", "add"]
    assert [(f.name, f.uses) for f in g.fanouts] == [("x", 3)]
    mul, sin, _ = g.nodes
    assert g.fanouts[0].consumers == (mul.id, mul.id, sin.id)
    # The backward pass sums one cotangent per use: d(a*b)/da = b = x, d(a*b)/db = a = x,
    # d sin(c)/dc = cos(x); so dL/dx = x + x + cos(x) = 2x + cos(x).
    x = 0.5
    grad = jax.grad(square_plus_sin)(jnp.float32(x))
    # float32 arithmetic on values near 1.9: a few ulps (1.2e-7 each) of rounding.
    np.testing.assert_allclose(float(grad), 2 * x + math.cos(x), rtol=1e-6)

    # Second method: give each use its own input; no fan-out remains, and the three partial
    # derivatives (x, x, cos x) add up to the gradient above.
    def separate_uses(a, b, c):
        return a * b + jnp.sin(c)

    assert trace(separate_uses, 0.5, 0.5, 0.5).fanouts == ()
    parts = jax.grad(separate_uses, argnums=(0, 1, 2))(*[jnp.float32(x)] * 3)
    np.testing.assert_allclose(float(sum(parts)), float(grad), rtol=1e-6)


def test_unused_leaf_does_not_reach_the_output():
    def f(params, x):
        return params["w"] * x  # params["unused"] is never read

    g = trace(f, {"unused": jnp.ones(3), "w": jnp.ones(3)}, jnp.ones(3))
    reach = {leaf.path: leaf.reaches_output for leaf in g.leaves}
    assert reach == {"params['unused']": False, "params['w']": True, "x": True}
    text = g.to_text()
    assert "does NOT reach" in text and "params['unused']" in text


def test_stop_gradient_leaf_still_reaches_the_output_structurally():
    def f(x, w):
        return jnp.sum(x * jax.lax.stop_gradient(w))

    g = trace(f, jnp.ones(3), jnp.ones(3))
    # w flows through stop_gradient into mul and on to the output: structural dependence.
    assert [n.primitive for n in g.nodes] == ["stop_gradient", "mul", "reduce_sum"]
    assert all(leaf.reaches_output for leaf in g.leaves)
    # ... while its gradient is zero, which is what stop_gradient changes.
    assert jnp.array_equal(jax.grad(f, argnums=1)(jnp.ones(3), jnp.ones(3)), jnp.zeros(3))


@jax.jit
def _inner(x):
    return jnp.tanh(x) * 2.0


def _with_jit(x):
    return jnp.sum(_inner(x))


def _with_scan(x):
    carry, ys = jax.lax.scan(lambda c, a: (c + a, c * a), jnp.zeros(3), x)
    return jnp.sum(carry) + jnp.sum(ys)


def _with_checkpoint(x):
    return jnp.sum(jax.checkpoint(lambda v: jnp.sin(v) * v)(x))


# (function, nested primitive's names, its part, primitives inside): the inner bodies are
# tanh(x) * 2 -> [tanh, mul]; scan's body (c + a, c * a) -> [add, mul]; the checkpointed
# sin(v) * v -> [sin, mul]. jax.checkpoint's primitive is named "remat2" in JAX 0.10 and
# "checkpoint" in some other releases.
NESTED = [
    (_with_jit, {"jit"}, "jaxpr", ["tanh", "mul"]),
    (_with_scan, {"scan"}, "jaxpr", ["add", "mul"]),
    (_with_checkpoint, {"remat2", "checkpoint"}, "jaxpr", ["sin", "mul"]),
]


@pytest.mark.parametrize("fn,primitive,part,inside", NESTED, ids=["jit", "scan", "checkpoint"])
def test_nested_jaxpr_is_one_expandable_node(fn, primitive, part, inside):
    x = jnp.ones((5, 3)) if fn is _with_scan else jnp.ones(3)
    g = trace(fn, x)
    (node,) = [n for n in g.nodes if n.subgraphs]
    assert node.primitive in primitive
    assert list(node.subgraphs) == [part]
    inner = g.expand(node)
    assert [n.primitive for n in inner.nodes] == inside
    assert g.expand(node.id) is inner and g.node(inner.nodes[0].id) is inner.nodes[0]
    # Depth 0 shows the nested node only; depth 1 lists the equations inside it.
    assert inner.nodes[0].id not in g.to_text(depth=0)
    assert inner.nodes[0].id in g.to_text(depth=1)


def test_cond_has_one_part_per_branch():
    def f(x):
        return jax.lax.cond(jnp.sum(x) > 0, lambda v: v * 2.0, lambda v: v - 1.0, x)

    g = trace(f, jnp.ones(3))
    (node,) = [n for n in g.nodes if n.subgraphs]
    # lax.cond stores branches as (false_fun, true_fun), indexed by the predicate as int.
    assert node.primitive == "cond" and list(node.subgraphs) == ["branches[0]", "branches[1]"]
    with pytest.raises(ValueError, match="part="):
        g.expand(node)
    assert [n.primitive for n in g.expand(node, "branches[0]").nodes] == ["sub"]
    assert [n.primitive for n in g.expand(node, "branches[1]").nodes] == ["mul"]
    with pytest.raises(ValueError, match="no nested jaxpr"):
        g.expand(g.nodes[0])
    # Expanded in DOT, the node becomes a cluster holding one sub-cluster per branch.
    dot = g.to_dot(depth=1)
    assert "cluster_" in dot and "branches[1]" in dot and "cluster_" not in g.to_dot(depth=0)


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos_x, ct: (ct * cos_x,))


def test_while_and_custom_vjp_are_nested_nodes():
    def f(x):
        _, y = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2.0), (0, x))
        return jnp.sum(_sin(y))

    g = trace(f, jnp.ones(3))
    loop, custom = [n for n in g.nodes if n.subgraphs]
    # while holds the predicate s[0] < 3 -> [lt] and the body (s[0] + 1, s[1] * 2) -> [add, mul].
    assert loop.primitive == "while" and list(loop.subgraphs) == ["cond_jaxpr", "body_jaxpr"]
    assert [n.primitive for n in g.expand(loop, "cond_jaxpr").nodes] == ["lt"]
    assert [n.primitive for n in g.expand(loop, "body_jaxpr").nodes] == ["add", "mul"]
    # custom_vjp records the primal function, sin(x) -> [sin], with its name.
    assert custom.label == "custom_vjp_call(_sin)"
    assert [n.primitive for n in g.expand(custom).nodes] == ["sin"]


def tanh_sum(x, w):
    return jnp.sum(jnp.tanh(x * w))


def test_residual_bytes_of_tanh_sum_match_the_hand_count():
    g = trace(tanh_sum, jnp.ones((3, 4), jnp.float32), jnp.ones((3, 4), jnp.float32))
    # Each residual is a (3, 4) float32 array: 12 x 4 = 48 bytes.
    # mul: ct_x = ct * w, ct_w = ct * x, so both arguments x and w are saved (96 B).
    # tanh: JAX's jvp rule (jax/_src/lax/lax.py, tanh_p) is linear in t with primal-only
    #   coefficients, and those are saved. JAX <= 0.11: t -> (t + t*y) * (1 - y) with
    #   y = tanh(u): y and 1 - y, "output of tanh" and "output of sub" (96 B). JAX 0.12:
    #   t -> t * one_minus_square(y): 1 - y**2 alone, "output of one_minus_square" (48 B).
    # reduce_sum: its transpose broadcasts the cotangent and needs only the shape (0 B).
    # Total: 96 + 96 = 192 bytes, or 96 + 48 = 144 on JAX 0.12.
    tanh_rows = ([("output", "tanh", 48), ("output", "sub", 48)] if tanh_residuals() == 2
                 else [("output", "one_minus_square", 48)])
    total = 96 + 48 * len(tanh_rows)
    assert g.residual_bytes == total
    assert [(r.origin, r.leaf or r.primitive, r.nbytes) for r in g.residuals] == [
        ("argument", "x", 48), ("argument", "w", 48), *tanh_rows]
    tanh_node = g.nodes[1]
    # What tanh's rule keeps comes from the source line of the tanh equation.
    assert [r.node for r in g.residuals[2:]] == [tanh_node.id] * len(tanh_rows)
    assert f"{total} bytes" in g.to_text()


def test_a_jitted_function_is_traced_through_with_the_users_lines():
    # trace(jax.jit(f)) must show f's equations and residuals as trace(f) does (the hand
    # count above: x, w and what tanh's rule keeps), not one opaque jit node whose
    # residuals are "output of jit" at funcgrad's own line.
    x = jnp.ones((3, 4), jnp.float32)
    plain, jitted = trace(tanh_sum, x, x), trace(jax.jit(tanh_sum), x, x)
    assert [n.primitive for n in jitted.nodes] == ["mul", "tanh", "reduce_sum"]
    assert [n.source for n in jitted.nodes] == [n.source for n in plain.nodes]
    assert all("test_graph.py" in n.source for n in jitted.nodes)
    assert jitted.residual_bytes == plain.residual_bytes == 96 + 48 * tanh_residuals()
    assert [(r.origin, r.leaf or r.primitive, r.source, r.node) for r in jitted.residuals] == [
        (r.origin, r.leaf or r.primitive, r.source, r.node) for r in plain.residuals]
    assert not any("graph.py" in r.source and "test_graph.py" not in r.source
                   for r in jitted.residuals)
    # A jit inside a larger function stays one expandable node (nothing else changes).
    outer = trace(lambda x, w: 2.0 * jax.jit(tanh_sum)(x, w), x, x)
    assert [n.primitive for n in outer.nodes] == ["jit", "mul"]


def _mlp_loss(params, x, y):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, x), y)


@pytest.fixture
def mlp(key):
    params = fg.mlp_init(key, (64, 32, 10))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    y = jnp.arange(8, dtype=jnp.int32) % 10
    return params, x, y


def test_mlp_residuals_are_the_layers_hand_count_plus_the_loss(mlp):
    params, x, y = mlp
    g = trace(_mlp_loss, params, x, y)
    # The layers, batch 8, float32 (4 B), every float leaf differentiated:
    #   x @ W0:  ct_x = ct W0^T needs W0 (64*32*4 = 8192), ct_W0 = x^T ct needs x (8*64*4 = 2048)
    #   relu:    jax.nn.relu's jvp is select(z > 0, t, zeros): the mask (bool 8*32 = 256) and
    #            the zeros (8*32*4 = 1024) are made in the forward pass and saved
    #   h @ W1:  needs W1 (32*10*4 = 1280) and h = relu output (8*32*4 = 1024)
    #   biases:  add needs nothing.
    layers = 8192 + 2048 + 256 + 1024 + 1280 + 1024
    assert layers == 13824
    # The loss's own residuals, measured on the loss alone as a function of the logits; it
    # does not save the logits themselves, so the two parts add up.
    logits = fg.mlp_apply(params, x)
    loss_only = trace(lambda z: fg.softmax_cross_entropy(z, y), logits)
    assert not any(r.origin == "argument" for r in loss_only.residuals)
    assert g.residual_bytes == layers + loss_only.residual_bytes
    # The argument residuals are exactly the three leaves named above; y (int32) is not saved
    # and has no cotangent.
    assert sorted(r.leaf for r in g.residuals if r.leaf) == [
        "params[0]['w']", "params[1]['w']", "x"]


def test_mlp_text_and_dot(mlp, tmp_path):
    g = trace(_mlp_loss, *mlp)
    names = ["params[0]['b']", "params[0]['w']", "params[1]['b']", "params[1]['w']", "x", "y"]
    assert [leaf.path for leaf in g.leaves] == names
    text, dot = g.to_text(), g.to_dot()
    assert dot.startswith("digraph") and dot.count("{") == dot.count("}")
    for name in names:
        assert name in text and name in dot
    json.dumps(g.to_dict())  # plain data only
    if shutil.which("dot") is None:
        pytest.skip("the Graphviz `dot` program is not installed; DOT text checked above")
    # `dot` parses the text (a syntax error exits non-zero) ...
    subprocess.run(["dot", "-Tcanon"], input=dot, text=True, check=True, capture_output=True)
    # ... and renders it.
    path = g.render(tmp_path / "mlp.svg")
    with open(path, "rb") as f:
        head = f.read(200).lstrip()
    assert head.startswith(b"<?xml") or head.startswith(b"<svg")


def test_render_without_dot_says_how_to_install(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    g = trace(affine, 1.0, 2.0, 3.0)
    with pytest.raises(RuntimeError, match=r"`dot` program is not on PATH.*apt install graphviz"):
        g.render(tmp_path / "g.svg")
    assert g.to_dot().startswith("digraph")  # DOT text needs no `dot`


def test_render_refuses_a_suffix_it_cannot_write(tmp_path):
    # A .jpg path would get SVG bytes under a .jpg name: refused before `dot` is needed.
    with pytest.raises(ValueError, match=r"cannot write a \.jpg file"):
        trace(affine, 1.0, 2.0, 3.0).render(tmp_path / "g.jpg")
    assert not (tmp_path / "g.jpg").exists()


def test_to_dot_without_the_graphviz_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)  # makes `import graphviz` fail
    with pytest.raises(ImportError, match="pip install 'graphviz"):
        trace(affine, 1.0, 2.0, 3.0).to_dot()


def test_integer_leaves_fallback_closes_over_them(mlp, monkeypatch):
    # Some JAX versions refuse saved_residuals with integer arguments; trace then closes over
    # them. Simulate that refusal and check the residuals come out the same.
    from jax._src import ad_checkpoint
    original = ad_checkpoint.saved_residuals

    def refuses_integers(f, *args):
        if any(not jnp.issubdtype(a.dtype, jnp.floating) for a in args):
            raise TypeError("integer argument")
        return original(f, *args)

    expected = trace(_mlp_loss, *mlp).residuals
    monkeypatch.setattr(ad_checkpoint, "saved_residuals", refuses_integers)
    assert trace(_mlp_loss, *mlp).residuals == expected


def test_shape_dtype_structs_trace_without_values(mlp):
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mlp)
    # The graph depends on shapes and dtypes only, so it equals the concrete one.
    assert trace(_mlp_loss, *abstract) == trace(_mlp_loss, *mlp)


def test_bad_inputs_get_clear_errors():
    with pytest.raises(TypeError, match="fn must be a callable"):
        trace(3, jnp.ones(2))
    with pytest.raises(TypeError, match=r"leaf params\['mode'\] is a str.*expected an array"):
        trace(lambda params: params["w"], {"w": jnp.ones(2), "mode": "fast"})
    g = trace(affine, 1.0, 2.0, 3.0)
    with pytest.raises(KeyError, match="no node 'n9'"):
        g.node("n9")
    with pytest.raises(ValueError, match="format"):
        g.render("g.gif", format="gif")


def test_residuals_can_be_skipped():
    g = trace(tanh_sum, jnp.ones(2), jnp.ones(2), residuals=False)
    assert isinstance(g, Graph) and g.residuals is None and g.residual_bytes == 0
    assert "residuals" not in g.to_text()


def test_trace_works_on_a_jitted_function():
    g = trace(jax.jit(tanh_sum), jnp.ones(2), jnp.ones(2))
    # jax.jit(f) records as one jit equation around f's three; trace shows the three (it
    # showed the one opaque jit node before issue 11), under f's name.
    assert g.name == "tanh_sum"
    assert [n.primitive for n in g.nodes] == ["mul", "tanh", "reduce_sum"]
