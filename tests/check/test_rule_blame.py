"""A failed check names the custom rule it points at (issue 25 point 6): the rule is checked on
its own inputs at the check point against JAX's derivative of its primal."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg


def make_act(scale):
    """tanh with a custom_vjp whose backward is `scale` times the true 1 - tanh^2."""
    @jax.custom_vjp
    def act(h):
        return jnp.tanh(h)

    def act_fwd(h):
        y = jnp.tanh(h)
        return y, y

    def act_bwd(y, g):
        return (scale * g * (1 - y * y),)

    act.defvjp(act_fwd, act_bwd)
    return act


def two_layers(act):
    def loss(p, x):
        h = act(x @ p["l1"]["w"])
        return jnp.sum((h @ p["l2"]["w"]) ** 2)
    return loss


def _point():
    rng = np.random.default_rng(0)
    p = {"l1": {"w": jnp.asarray(rng.standard_normal((4, 5)) * 0.5, jnp.float32)},
         "l2": {"w": jnp.asarray(rng.standard_normal((5, 3)) * 0.5, jnp.float32)}}
    return p, jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_a_1_percent_wrong_activation_rule_is_named_with_its_lines(mode):
    # The bug sits between the layers: dL/dW1 = x^T (dL/dh * act'(x W1)) carries the 1.01
    # factor (a 1% relative error on every element), dL/dW2 = h^T dL/dout does not.
    p, x = _point()
    check = {"full": fg.check_grads, "directional": fg.check_directional}[mode]
    report = check(two_layers(make_act(1.01)), p, x)
    l1, l2 = report.rows
    assert not l1.ok and l2.ok
    named = [n for n in report.notes if "custom_vjp rule of act" in n]
    assert len(named) == 1
    # The call site (this file, the line of `act(x @ ...)`) and the backward's own line.
    assert "test_rule_blame.py:" in named[0] and "act_bwd at test_rule_blame.py:" in named[0]
    assert "0.01 relative" in named[0]  # 1.01 vs 1: 1% on every element of the vjp
    assert any("custom_vjp rule of act" in n for n in l1.notes)
    assert not any("custom_vjp rule" in n for n in l2.notes)


def test_a_right_rule_is_not_blamed_for_a_failure_elsewhere():
    # The rule is right; W2's gradient is cut by a stop_gradient (a different fault): the
    # check fails on W2 and names no rule.
    p, x = _point()

    def loss(p, x):
        h = make_act(1.0)(x @ p["l1"]["w"])
        return jnp.sum((h @ jax.lax.stop_gradient(p["l2"]["w"])) ** 2)

    report = fg.check_grads(loss, p, x)
    assert not report.ok and report.rows[1].status == "stop_gradient"
    assert not any("rule of" in n for n in report.notes)


def test_a_rule_inside_a_scan_is_said_to_be_unchecked():
    p, x = _point()
    act = make_act(1.05)

    def loss(p, x):
        def body(h, _):
            return act(h @ jnp.eye(5)), None
        h, _ = jax.lax.scan(body, x @ p["l1"]["w"], None, length=2)
        return jnp.sum((h @ p["l2"]["w"]) ** 2)

    report = fg.check_grads(loss, p, x)
    assert not report.ok
    assert any("rule of act" in n and "not checked on its own" in n and "scan" in n
               for n in report.notes)
