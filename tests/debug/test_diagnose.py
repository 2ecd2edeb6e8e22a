"""Tests for funcgrad.debug.diagnose.explain_grads: one status per leaf, each built by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg
from funcgrad.debug.diagnose import STATUSES, explain_grads

X = jnp.arange(6.0).reshape(2, 3) / 6.0 - 0.2   # rows [-0.2, -0.033, 0.133], [0.3, 0.467, 0.633]


def one_of_each(params, x):
    # w1 feeds a live ReLU: connected. w_dead feeds a ReLU whose pre-activation x @ w - 100 < 0
    # for every example: numerically zero. w_sg only through stop_gradient, w_round only
    # through round, unused never read.
    live = jax.nn.relu(x @ params["w1"] + 1.0)
    dead = jax.nn.relu(x @ params["w_dead"] - 100.0)
    return (jnp.sum(live) + jnp.sum(dead) + jnp.sum(jax.lax.stop_gradient(params["w_sg"]) * 2.0)
            + jnp.sum(jnp.round(params["w_round"])))


PARAMS = {"w1": jnp.ones((3, 4)), "w_dead": jnp.ones((3, 2)), "w_sg": jnp.ones(2),
          "w_round": jnp.ones(2), "unused": jnp.ones(5)}


def test_one_leaf_of_each_status():
    report = explain_grads(one_of_each, PARAMS, X)
    assert {r.path: r.status for r in report.rows} == {
        "params['unused']": "unused",
        "params['w1']": "connected",
        "params['w_dead']": "numerically_zero",
        "params['w_round']": "blocked_by_zero_derivative_op",
        "params['w_sg']": "blocked_by_stop_gradient",
    }
    # Second method: jax.grad is exactly zero for every leaf but the connected one.
    grads = jax.grad(one_of_each)(PARAMS, X)
    for row, g in zip(report.rows, jax.tree.leaves(grads)):
        assert (row.status == "connected") == bool(jnp.any(g != 0))
        np.testing.assert_allclose(row.grad_norm, np.linalg.norm(np.ravel(g)), rtol=1e-6)
    # Hand: every live unit has pre-activation x @ 1 + 1 > 0, so dloss/dw1[i, j] = sum_b x[b, i]
    # = [0.1, 0.433, 0.767] per row, 4 columns: norm = 2 * sqrt(0.01 + 0.1878 + 0.5878).
    np.testing.assert_allclose(report["params['w1']"].grad_norm,
                               2 * np.sqrt(0.1 ** 2 + 0.4333333 ** 2 + 0.7666667 ** 2), rtol=1e-5)
    assert "round at test_diagnose.py" in report["params['w_round']"].detail
    assert "stop_gradient at test_diagnose.py" in report["params['w_sg']"].detail
    assert "2/2 at test_diagnose.py" in report["params['w_dead']"].detail
    text = str(report)
    for status in ("connected", "unused", "numerically_zero", "blocked_by_stop_gradient",
                   "blocked_by_zero_derivative_op"):
        assert status in text
    assert set(r["status"] for r in report.to_dict()["leaves"]) <= set(STATUSES)


@pytest.mark.parametrize("op, name", [
    (jnp.round, "round"), (jnp.floor, "floor"), (jnp.ceil, "ceil"), (jnp.sign, "sign"),
    (lambda w: (w > 0.5).astype(jnp.float32), "gt"),
    (lambda w: (w == 1.0).astype(jnp.float32), "eq"),
    (lambda w: jnp.argmax(w).astype(jnp.float32), "argmax"),
    (lambda w: jnp.argmin(w).astype(jnp.float32), "argmin"),
    (lambda w: w.astype(jnp.int32).astype(jnp.float32), "convert_element_type (to int32)"),
])
def test_each_zero_derivative_family(op, name):
    report = explain_grads(lambda p: jnp.sum(op(p["w"]) * 3.0), {"w": jnp.array([0.3, 1.7])})
    row = report["p['w']"]
    assert row.status == "blocked_by_zero_derivative_op"
    assert f"cut by {name}" in row.detail and "test_diagnose.py" in row.detail


def test_stop_gradient_inside_jit_and_inside_scan():
    inner = jax.jit(lambda w: jax.lax.stop_gradient(w) * 2.0)

    def in_jit(p):  # a reaches the loss only through the stop_gradient inside the jitted call
        return jnp.sum(inner(p["a"])) + jnp.sum(p["b"] * p["b"])

    r = explain_grads(in_jit, {"a": jnp.ones(2), "b": jnp.ones(2)})
    assert r.status("p['a']") == "blocked_by_stop_gradient"
    assert "stop_gradient at test_diagnose.py" in r["p['a']"].detail
    assert r.status("p['b']") == "connected"

    def in_scan(p):
        def body(c, _):
            return c + jax.lax.stop_gradient(p["a"]) + p["b"], None
        return jnp.sum(jax.lax.scan(body, jnp.zeros(2), None, length=3)[0])

    r = explain_grads(in_scan, {"a": jnp.ones(2), "b": jnp.ones(2)})
    assert r.status("p['a']") == "blocked_by_stop_gradient"
    assert r.status("p['b']") == "connected"
    np.testing.assert_allclose(r["p['b']"].grad_norm, 3 * np.sqrt(2))  # 3 steps, 2 elements


def test_multiplying_by_zero_is_numerically_zero_not_blocked():
    # a * 0.0 is a differentiable path whose value happens to be zero.
    r = explain_grads(lambda p: jnp.sum(p["a"] * 0.0), {"a": jnp.ones(2)})
    assert r.status("p['a']") == "numerically_zero"


def test_scan_carry_reaches_the_loss_only_after_a_fixpoint():
    # The carry is (c1, c2) -> (c2 * w... ) : u enters c2 at step 1 and reaches the output c1 at
    # step 2 only through the carry: the dependence needs two rounds of the fixpoint.
    def loss(p):
        def body(c, _):
            c1, c2 = c
            return (c1 + c2, p["u"] * 1.0), None
        return jax.lax.scan(body, (0.0, 0.0), None, length=3)[0][0]

    r = explain_grads(loss, {"u": jnp.float32(2.0)})
    assert r.status("p['u']") == "connected"
    # Hand: c1 after 3 steps = 0 + 0 + u + u... step1 c1=0,c2=u; step2 c1=u,c2=u; step3 c1=2u.
    np.testing.assert_allclose(r["p['u']"].grad_norm, 2.0)


def test_cond_branch_not_taken_and_where():
    def loss(p, flag):
        return jax.lax.cond(flag, lambda: jnp.sum(p["a"]), lambda: jnp.sum(p["b"]))

    r = explain_grads(loss, {"a": jnp.ones(2), "b": jnp.ones(2)}, True)
    assert r.status("p['a']") == "connected"
    assert r.status("p['b']") == "numerically_zero"  # a branch this input did not take

    r = explain_grads(lambda p, x: jnp.sum(jnp.where(x > 10.0, p["a"], 0.0)), {"a": jnp.ones(3)},
                      jnp.arange(3.0))
    assert r.status("p['a']") == "numerically_zero"  # no element took the p branch


def test_custom_jvp_straight_through_counts_as_connected():
    @jax.custom_jvp
    def ste_round(x):
        return jnp.round(x)
    ste_round.defjvp(lambda primals, tangents: (ste_round(primals[0]), tangents[0]))

    r = explain_grads(lambda p: jnp.sum(ste_round(p["a"])) + jnp.sum(jnp.round(p["b"])),
                      {"a": jnp.array([0.3, 1.6]), "b": jnp.ones(2)})
    assert r.status("p['a']") == "connected"  # judged by JAX's rules: the STE passes gradient
    np.testing.assert_allclose(r["p['a']"].grad_norm, np.sqrt(2))
    assert r.status("p['b']") == "blocked_by_zero_derivative_op"


def test_dead_relu_fraction_on_the_mlp_by_hand(key):
    # Bias of the hidden layer at -1000 for units 0..5 of 16: those units are dead for every
    # example (|x @ w| is far below 1000 on standardised digits); 6/16 dead by construction.
    params = fg.mlp_init(key, (64, 16, 10))
    params[0]["b"] = params[0]["b"].at[:6].set(-1000.0)
    data = fg.load_digits(seed=0)
    x, y = data.x_train[:32], data.y_train[:32]
    loss = lambda p, x, y: fg.softmax_cross_entropy(fg.mlp_apply(p, x), y)
    r = explain_grads(loss, params, x, y)
    assert [(s.units, s.dead) for s in r.relus] == [(16, 6)]
    assert all(row.status == "connected" for row in r.rows)
    # Kill all 16: every parameter upstream of and including layer 0 is numerically zero; the
    # last layer's bias still gets dloss/db2 = mean(softmax - onehot) != 0.
    params[0]["b"] = jnp.full((16,), -1000.0)
    r = explain_grads(loss, params, x, y)
    assert [(s.units, s.dead) for s in r.relus] == [(16, 16)]
    assert {row.path: row.status for row in r.rows} == {
        "p[0]['b']": "numerically_zero", "p[0]['w']": "numerically_zero",
        "p[1]['b']": "connected", "p[1]['w']": "numerically_zero"}
    assert "16/16 at" in r["p[0]['w']"].detail


def test_integer_leaves_and_bad_losses():
    r = explain_grads(lambda p: jnp.sum(p["w"]) * p["n"], {"w": jnp.ones(2), "n": jnp.array(3)})
    assert r.status("p['n']") == "not_differentiable"
    assert r.status("p['w']") == "connected"
    with pytest.raises(ValueError, match=r"real scalar loss; got shape \(2,\) dtype float32"):
        explain_grads(lambda p: p["w"] * 2.0, {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="needs a callable loss_fn"):
        explain_grads("loss", {"w": jnp.ones(2)})
    # All-integer params make an integer loss: the message points at the params.
    with pytest.raises(ValueError, match=r"dtype int32\. The params leaf p is an integer array"):
        explain_grads(lambda p: jnp.sum(p * 2), jnp.arange(3))
    r = explain_grads(lambda p: (jnp.sum(p["w"]), {"aux": 1}), {"w": jnp.ones(2)}, has_aux=True)
    assert r.status("p['w']") == "connected"


def test_a_string_argument_is_named_with_the_partial_fix():
    with pytest.raises(TypeError, match=r"explain_grads: argument mode is a str"):
        explain_grads(lambda p, mode: jnp.sum(p ** 2), jnp.ones(2), "sq")


def test_a_nan_or_inf_gradient_is_nonfinite_not_connected():
    # Hand: d/dw sqrt(w * x) = x / (2 sqrt(w x)): inf at w = 0 (element 0), 0.5 at w = x = 1.
    r = explain_grads(lambda p, x: jnp.sum(jnp.sqrt(p["w"] * x)), {"w": jnp.array([0.0, 1.0])},
                      jnp.ones(2))
    row = r["p['w']"]
    assert row.status == "nonfinite" and np.isinf(row.grad_norm)
    assert "1 of 2 gradient elements are NaN or inf (the first at index [0]: inf)" in row.detail
    assert "find_nonfinite" in row.detail
    # Hand: the gradient of ||w|| at w = 0 is w / ||w|| = 0 / 0 = NaN (JAX's convention).
    r = explain_grads(lambda p: jnp.linalg.norm(p["w"]) + jnp.sum(p["v"]),
                      {"w": jnp.zeros(3), "v": jnp.ones(2)})
    assert r.status("p['w']") == "nonfinite" and "3 of 3" in r["p['w']"].detail
    assert r.status("p['v']") == "connected"


def test_complex_leaves_are_differentiated():
    # JAX's gradient of the real loss |z|^2 is 2 conj(z) (second method: jax.grad below), so
    # for z = [1+2i, 3i] the norm is 2 sqrt(5 + 9). A complex leaf the loss never reads is
    # unused, as a real one would be.
    params = {"z": jnp.array([1 + 2j, 3j], jnp.complex64), "u": jnp.ones(2, jnp.complex64)}
    loss = lambda p: jnp.sum(jnp.abs(p["z"]) ** 2)
    r = explain_grads(loss, params)
    assert r.status("p['z']") == "connected" and r.status("p['u']") == "unused"
    np.testing.assert_allclose(r["p['z']"].grad_norm, 2 * np.sqrt(14.0), rtol=1e-6)
    np.testing.assert_allclose(r["p['z']"].grad_norm,
                               np.linalg.norm(jax.grad(loss)(params)["z"]), rtol=1e-6)


def _relu_rnn(p, xs):
    def body(h, x):
        h = jax.nn.relu(h @ p["w"] + x)
        return h, h
    h, hs = jax.lax.scan(body, jnp.zeros(4), xs)
    return jnp.sum(h) + jnp.sum(hs)


def test_relus_inside_scan_are_dead_only_if_dead_at_every_iteration():
    # Hand: W = -I, h0 = 0 and every x_t = -1, so every pre-activation h @ W + x is -1 at every
    # iteration: 4/4 units dead, and the gradient is exactly zero.
    xs = -jnp.ones((3, 4))
    r = explain_grads(_relu_rnn, {"w": -jnp.eye(4)}, xs)
    assert [(s.units, s.dead, s.dead_per_iteration) for s in r.relus] == [(4, 4, (4, 4, 4))]
    assert "_relu_rnn" in r.relus[0].where
    assert r.status("p['w']") == "numerically_zero" and "4/4 at" in r["p['w']"].detail
    # x_1[2] = +1: unit 2 is alive at iteration 1 only, so 3 of 4 units are dead over the scan.
    r = explain_grads(_relu_rnn, {"w": -jnp.eye(4)}, xs.at[1, 2].set(1.0))
    assert [(s.units, s.dead) for s in r.relus] == [(4, 3)]
    # reverse=True visits the iterations the other way; the outputs are the same as JAX's.
    rev = lambda p, xs: jnp.sum(jax.lax.scan(lambda h, x: (jax.nn.relu(h * p + x),) * 2,
                                             jnp.zeros(2), xs, reverse=True)[1])
    xs2 = jnp.array([[1.0, -1.0], [-1.0, -1.0]])
    r = explain_grads(rev, jnp.float32(0.5), xs2)
    np.testing.assert_allclose(r.loss, rev(jnp.float32(0.5), xs2), rtol=1e-6)
    assert [(s.units, s.dead) for s in r.relus] == [(2, 1)]  # unit 0 alive at t = 0


def test_a_scan_over_stacked_layers_reports_dead_units_per_iteration():
    # Hand: x = ones, layers I, -I, I: iteration 0 gives relu(1) = 1 (0 dead), iteration 1
    # relu(-1) = 0 (3 dead), iteration 2 relu(0) = 0 (3 dead). No unit is dead at every
    # iteration, but the per-iteration counts say which layer killed the gradient.
    def loss(p, x):
        h, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, p["ws"])
        return (h @ p["out"]).sum()
    params = {"ws": jnp.stack([jnp.eye(3), -jnp.eye(3), jnp.eye(3)]), "out": jnp.ones((3, 1))}
    r = explain_grads(loss, params, jnp.ones((2, 3)))
    assert [(s.units, s.dead, s.dead_per_iteration) for s in r.relus] == [(3, 0, (0, 3, 3))]
    assert r.status("p['ws']") == "numerically_zero"
    assert "per scan iteration: 0, 3, 3" in r["p['ws']"].detail
    assert "dead per run: 0, 3, 3" in str(r)


def test_an_integer_clamp_is_not_a_relu():
    # jnp.maximum(i, 0) on integers is a clamp, not an activation: no ReLU site.
    r = explain_grads(lambda p, i: jnp.sum(p * jnp.maximum(i, 0)), jnp.ones(2), jnp.array([-1, 2]))
    assert r.relus == () and r.status("p") == "connected"


def test_relus_in_the_taken_cond_branch_and_two_calls_of_one_jitted_helper():
    # Hand: the branch taken (index 1) has a ReLU of x - 5 over x = [0, 1, 2]: all 3 dead.
    # The other branch is not evaluated, so its ReLU is not listed.
    def loss(p, x):
        return jax.lax.cond(p > 0, lambda: jnp.sum(jax.nn.relu(p * x - 5.0)),
                            lambda: jnp.sum(jax.nn.relu(-x)))
    r = explain_grads(loss, jnp.float32(1.0), jnp.arange(3.0))
    assert [(s.units, s.dead) for s in r.relus] == [(3, 3)]
    # jax.nn.relu is one jitted function; called by two layers it is two sites.
    two = lambda p, x: jnp.sum(jax.nn.relu(jax.nn.relu(x * p) - 1.5))
    r = explain_grads(two, jnp.float32(1.0), jnp.array([-1.0, 1.0, 2.0]))
    # Hand: relu(x) = [0, 1, 2] (1 dead); relu([0, 1, 2] - 1.5) = [0, 0, 0.5] (2 dead).
    assert [(s.units, s.dead) for s in r.relus] == [(3, 1), (3, 2)]


def test_a_param_dependent_while_loop_gets_a_clear_error():
    def loss(p, x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * p),
                                  (0, x))[1].sum()
    with pytest.raises(ValueError,
                       match="reverse mode.*lax.while_loop.*Write the loop as lax.scan"):
        explain_grads(loss, jnp.float32(2.0), jnp.ones(2))


# --- custom VJP rules that drop a cotangent (issue 11, point 2) ---------------------------------

def _dropping_rule(kind):
    """out = x * w with a rule that returns x's cotangent g * w and no cotangent for w (None, or
    zeros that ignore g), although d out / d w = x != 0."""
    if kind == "funcgrad":
        scale = fg.custom_vjp(lambda x, w: x * w)
        decorate = dict(zero_cotangents=("w",))  # declared, so no warning; still a cut
    else:
        scale, decorate = jax.custom_vjp(lambda x, w: x * w), {}

    def scale_bwd(res, g):
        x, w = res
        return g * w, (None if kind != "zeros" else jnp.zeros_like(w))

    scale.defvjp(lambda x, w: (x * w, (x, w)), scale_bwd, **decorate)
    return scale


@pytest.mark.parametrize("kind", ["jax_none", "zeros", "funcgrad"])
def test_a_custom_vjp_rule_that_drops_a_cotangent_is_named_as_the_blocker(kind):
    scale = _dropping_rule(kind)

    def loss_fn(p, x):
        return jnp.sum(scale(jnp.tanh(x * p["a"]), p["w"]) ** 2)

    params = {"a": jnp.ones(3), "w": jnp.float32(2.0)}
    report = explain_grads(loss_fn, params, jnp.ones(3))
    # d loss / d a flows through the rule's cotangent for x (g * w != 0): connected. w's
    # cotangent is dropped by the rule: before, "numerically_zero ... dead ReLU units".
    assert report.status("p['a']") == "connected"
    row = report["p['w']"]
    assert row.status == "blocked_by_zero_derivative_op" and row.grad_norm == 0.0
    assert "custom_vjp rule of" in row.detail and "scale_bwd" in row.detail
    assert "test_diagnose.py" in row.detail and "dead ReLU" not in row.detail
    assert "custom.py" not in row.detail  # the user's call, not funcgrad's wrapper
    if kind == "funcgrad":
        assert "(None) for w," in row.detail  # funcgrad's rule knows the parameter names


def test_a_custom_vjp_rule_with_a_real_cotangent_stays_connected():
    scale = jax.custom_vjp(lambda x, w: x * w)
    scale.defvjp(lambda x, w: (x * w, (x, w)), lambda res, g: (g * res[1], jnp.sum(g * res[0])))
    report = explain_grads(lambda p, x: jnp.sum(scale(x, p)), jnp.float32(2.0), jnp.ones(3))
    # d/dw sum(x * w) = sum(x) = 3.
    assert report.status("p") == "connected" and report["p"].grad_norm == 3.0


def test_the_table_keeps_a_gap_after_a_long_shape():
    """A 4-D kernel's shape "[8, 1, 3, 3]" (12 characters) ran into its status column."""
    params = {"kernel": jnp.ones((8, 1, 3, 3)), "unused": jnp.ones((2,))}
    text = str(fg.explain_grads(lambda p, x: jnp.sum(p["kernel"] * x), params, jnp.ones(())))
    row = next(line for line in text.splitlines() if "kernel" in line)
    assert "[8, 1, 3, 3]  connected" in row, text
