"""Traced values used as Python values, and arguments that are not differentiated, in every tool."""
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad import TracedValueError


def branchy(params, x):
    y = params["w"] * x
    if y.sum() > 0:  # a Python if on a value computed from params
        return jnp.sum(y ** 2)
    return jnp.sum(y)


def counted(params, x, n):
    y = params["w"] * x
    for _ in range(n):  # n used as a Python int
        y = y * 2.0
    return jnp.sum(y)


def with_numpy(params, x):
    return jnp.sum(np.tanh(params["w"]) * x)  # NumPy on a traced value


def _line(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


_P = {"w": jnp.ones(3)}
_X = jnp.arange(3.0)
_SGD = optax.sgd(0.1)

#: Each tool, called as a user would on `fn(params, *rest)`, differentiating params.
TOOLS = {
    "check_grads": lambda fn, *rest: fg.check_grads(fn, _P, *rest),
    "check_directional": lambda fn, *rest: fg.check_directional(fn, _P, *rest),
    "audit": lambda fn, *rest: fg.audit(fn, _P, *rest),
    "explain_grads": lambda fn, *rest: fg.explain_grads(fn, _P, *rest),
    "find_nonfinite": lambda fn, *rest: fg.find_nonfinite(fn, _P, *rest),
    "trace": lambda fn, *rest: fg.trace(fn, _P, *rest),
    "intermediate_grads": lambda fn, *rest: fg.intermediate_grads(fn)(_P, *rest),
    "with_dead_relu": lambda fn, *rest: fg.with_dead_relu(fn)(_P, *rest),
    # backward runs fn eagerly, where a Python if works; under fn's own jit it cannot.
    "backward": lambda fn, *rest: fg.backward(jax.jit(fn), _P, *rest),
    "train_step": lambda fn, *rest: (step := fg.make_train_step(
        lambda params, batch: fn(params, *batch), _SGD))(step.init(_P), rest),
}
_OWN_TRACE = {"backward"}  # the value is traced by fn's own jit, not by the tool


@pytest.mark.parametrize("tool", list(TOOLS), ids=list(TOOLS))
def test_python_if_on_a_differentiated_value_names_the_line_and_jnp_where(tool):
    line = _line(branchy, "if y.sum() > 0")
    with pytest.raises(TracedValueError) as error:
        TOOLS[tool](branchy, _X)
    text = str(error.value)
    assert f"test_traced.py:{line} (branchy)" in text
    assert "if y.sum() > 0:" in text and "Python bool" in text
    assert "jnp.where" in text and "jax.lax.cond" in text
    if tool not in _OWN_TRACE:  # params is differentiated: closing over it is no fix
        # trace differentiates every floating argument (for the residuals): x too.
        depends = "params and x" if tool == "trace" else "params"
        assert re.search(rf"depends on {depends}, which [\w ]+ differentiates", text)
        assert "functools.partial(fn" not in text
    # The fix the message gives works: the where form has the same gradient as the if form
    # eagerly, where the if runs (y = (0, 1, 2) > 0: d/dw sum((w x)^2) = 2 w x^2 = (0, 2, 8)).
    fixed = lambda params, x: jnp.where(jnp.sum(params["w"] * x) > 0,  # noqa: E731
                                        jnp.sum((params["w"] * x) ** 2), jnp.sum(params["w"] * x))
    assert fg.check_grads(fixed, _P, _X).ok
    np.testing.assert_allclose(jax.grad(fixed)(_P, _X)["w"], [0.0, 2.0, 8.0])
    np.testing.assert_allclose(jax.grad(branchy)(_P, _X)["w"], [0.0, 2.0, 8.0])


@pytest.mark.parametrize("tool", ["check_grads", "explain_grads", "find_nonfinite",
                                  "intermediate_grads", "trace"])
def test_python_int_from_an_argument_not_differentiated_gets_the_partial_fix(tool):
    line = _line(counted, "range(n)")
    with pytest.raises(TypeError) as error:
        TOOLS[tool](counted, _X, 2)
    text = str(error.value)
    assert f"test_traced.py:{line} (counted)" in text and "Python int" in text
    assert f"depends on n, which {tool} does not differentiate" in text
    assert "functools.partial(fn, n=...)" in text and "static_argnums" in text
    # d/dw sum(4 w x) = 4 x with n = 2 closed over
    report = fg.check_grads(functools.partial(counted, n=2), _P, _X)
    assert report.ok


def test_numpy_on_a_traced_value_points_to_jax_numpy():
    line = _line(with_numpy, "np.tanh")
    with pytest.raises(TracedValueError, match=rf"test_traced\.py:{line} \(with_numpy\) "
                                               r"converts a traced value to a NumPy array"
                                               r"(.|\n)*jnp\.sum, not np\.sum"):
        fg.find_nonfinite(with_numpy, _P, _X)


def test_other_errors_pass_through_unchanged():
    def wrong_shapes(params, x):
        return jnp.sum(params["w"] @ jnp.ones((4, 4)))

    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        fg.check_grads(wrong_shapes, _P, _X)


# --- arguments that are not differentiated: typed keys, integer tokens, bools ---------------

def dropout_loss(params, key, tokens, train):
    h = params["emb"][tokens]                                   # (3, 4)
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    h = jnp.where(train, jnp.where(keep, h / 0.5, 0.0), h)     # inverted dropout when training
    return jnp.sum(jnp.tanh(h @ params["w"]))


_PARAMS = {"emb": jax.random.normal(jax.random.key(1), (5, 4)), "w": jnp.linspace(-1.0, 1.0, 4)}
_KEY = jax.random.key(0)                     # typed key, the form JAX recommends
_TOKENS = jnp.array([0, 2, 4], jnp.int32)
_TRAIN = jnp.bool_(True)
_ARGS = (_PARAMS, _KEY, _TOKENS, _TRAIN)


def _reference_grads():
    return jax.grad(dropout_loss)(*_ARGS)  # the second method every tool is compared with


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_check_grads_accepts_a_typed_key_and_integer_tokens(mode):
    report = {"full": fg.check_grads, "directional": fg.check_directional}[mode](dropout_loss,
                                                                                 *_ARGS)
    assert report.ok
    assert [r.path for r in report.rows] == ["params['emb']", "params['w']"]
    # Only rows 0, 2, 4 of emb are gathered: the other rows' gradient is exactly 0, which the
    # finite differences agree with (checked above); the key really is used: another key gives
    # another loss.
    assert float(dropout_loss(*_ARGS)) != float(dropout_loss(_PARAMS, jax.random.key(7),
                                                            _TOKENS, _TRAIN))


def test_audit_accepts_a_typed_key_and_integer_tokens():
    assert fg.audit(dropout_loss, _PARAMS, _KEY, _TOKENS, _TRAIN).ok


def test_the_other_tools_accept_a_typed_key_and_integer_tokens():
    expected = _reference_grads()
    flat = jax.tree.leaves(expected)
    # explain_grads: every leaf connected, with jax.grad's norms.
    explanation = fg.explain_grads(dropout_loss, *_ARGS)
    norms = [float(np.linalg.norm(g)) for g in flat]
    np.testing.assert_allclose([r.grad_norm for r in explanation.rows], norms, rtol=1e-6)
    # find_nonfinite: finite, the same loss.
    report = fg.find_nonfinite(dropout_loss, *_ARGS)
    assert report.ok and report.value == pytest.approx(float(dropout_loss(*_ARGS)), rel=1e-6)
    # trace: the key, the tokens and the flag are leaves of the graph.
    graph = fg.trace(dropout_loss, *_ARGS)
    assert {"key", "tokens", "train"} <= {leaf.path for leaf in graph.leaves}
    # intermediate_grads and backward: jax.grad's gradient.
    _, grads, _ = fg.intermediate_grads(dropout_loss)(*_ARGS)
    for got in (grads, fg.backward(dropout_loss, *_ARGS)):
        for a, b in zip(jax.tree.leaves(got), flat):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    # the train step, with the key and tokens in the batch: SGD moves params by -0.1 * grad.
    step = fg.make_train_step(lambda p, b: dropout_loss(p, *b), _SGD)
    state, _ = step(step.init(_PARAMS), (_KEY, _TOKENS, _TRAIN))
    for new, old, g in zip(jax.tree.leaves(state.params), jax.tree.leaves(_PARAMS), flat):
        np.testing.assert_allclose(new, old - 0.1 * g, rtol=1e-5, atol=1e-6)


def test_a_setting_inside_the_batch_is_named_by_its_leaf_path():
    def loss(params, batch):
        y = params["w"] * batch["x"]
        for _ in range(batch["n"]):  # a loop count that travels in the batch
            y = y * 2.0
        return jnp.sum(y)

    batch = {"x": _X, "n": 2}
    step = fg.make_train_step(loss, _SGD)
    with pytest.raises(TracedValueError, match=r"(?s)test_traced\.py:\d+ \(loss\).*"
                                               r"depends on batch\['n'\], which the train step "
                                               r"does not differentiate.*take batch\['n'\] out"):
        step(step.init(_P), batch)
    # Closed over, it trains: d/dw sum(4 w x) = 4 x = (0, 4, 8); SGD(0.1) moves w by -0.4 x.
    fixed = fg.make_train_step(lambda p, b: loss(p, {"x": b, "n": 2}), _SGD)
    state, _ = fixed(fixed.init(_P), _X)
    np.testing.assert_allclose(state.params["w"], 1.0 - 0.4 * _X, rtol=1e-6)
