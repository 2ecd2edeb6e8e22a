"""Tests for funcgrad.debug.anomaly.find_nonfinite: each case located to primitive, pass and line.

Expected lines are found by the marker comment at the end of the line (``# <- name``) in this
file, so the tests survive edits above them; the primitive and the pass come from the maths
in each case's comment.
"""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental import checkify

import funcgrad as fg
from funcgrad.debug.anomaly import AnomalyReport, ValueStats, _locate, find_nonfinite

SOURCE = pathlib.Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """The 1-based line of this file that ends with ``# <- marker``."""
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times"
    return hits[0]


def assert_located(report: AnomalyReport, phase: str, primitive: str, marker: str) -> None:
    assert not report.ok, str(report)
    assert (report.phase, report.primitive, report.line) == (phase, primitive, line_of(marker)), \
        str(report)
    assert report.file == __file__
    assert report.where.startswith(f"test_anomaly.py:{line_of(marker)}:")


def _lse_has_custom_rule() -> bool:
    """Whether this JAX's jax.nn.logsumexp is a custom_jvp (from 0.12.1 on): its backward pass
    is then its own rule, which find_nonfinite names "logsumexp" (the user's word); before, it
    was differentiated primitive by primitive, and the log was the first non-finite value."""
    return "custom_jvp_call" in str(jax.make_jaxpr(jax.nn.logsumexp)(jnp.ones(3)))


# --- the cases of the issue, one function each ------------------------------------------------

def where_log(x):
    # Forward: log(0) = -inf, but jnp.where picks 0 there, so the loss is finite (0 + log 1 = 0).
    # Backward: where sends cotangent 0 to log's output at x = 0; log's rule gives 0 / x = 0/0.
    return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))  # <- where_log


def sqrt_at_zero(x):
    # d/dx sqrt(x) = 1 / (2 sqrt(x)) = 1/0 = inf at x = 0; the value sqrt(0) = 0 is finite.
    return jnp.sqrt(x)  # <- sqrt


def norm_of_zero(v):
    # norm = sqrt(sum(v*v)); the gradient v / norm = 0/0. The first non-finite value of the
    # backward pass is sqrt's cotangent 1 / (2 sqrt(0)) = inf, inside jnp.linalg.norm.
    return jnp.linalg.norm(v)  # <- norm


def softmax_by_hand(z):
    e = jnp.exp(z)  # <- exp
    return e / jnp.sum(e)


def first_probability(z):
    # exp(1000) = inf in float32 (largest finite exp input: ln(3.4e38) = 88.7); then inf/inf = NaN
    # in the division. The first primitive to go non-finite is exp.
    return softmax_by_hand(z)[0]


def ratio(x, y):
    return x / y  # <- div


def scan_forward(c0):
    # c = 2.5 - (t + 1): 1.5, 0.5, -0.5, ... so sqrt(c) is NaN first at iteration 2.
    def body(c, _):
        c = c - 1.0
        return c, jnp.sqrt(c)  # <- scan_sqrt
    return jnp.sum(lax.scan(body, c0, None, length=4)[1])


def scan_backward(c0):
    # c = 2 - (t + 1): 1, 0, so sqrt is finite, and its derivative is inf at iteration 1.
    def body(c, _):
        c = c - 1.0
        return c, jnp.sqrt(c)  # <- scan_sqrt_grad
    return jnp.sum(lax.scan(body, c0, None, length=2)[1])


@jax.jit
def jitted_log(x):
    return jnp.log(x)  # <- jit_log


def through_jit(x):
    # log(-1) = NaN inside a jitted helper.
    return jnp.sum(jitted_log(x) * 2.0)


CASES = [
    # (function, argument, pass, primitive, marker)
    (where_log, jnp.array([0.0, 1.0]), "backward", "log", "where_log"),
    (sqrt_at_zero, jnp.float32(0.0), "backward", "sqrt", "sqrt"),
    (norm_of_zero, jnp.zeros(3), "backward", "sqrt", "norm"),
    (first_probability, jnp.array([1000.0, 0.0]), "forward", "exp", "exp"),
    (lambda x: ratio(x, jnp.float32(0.0)), jnp.float32(1.0), "forward", "div", "div"),
    (scan_forward, jnp.float32(2.5), "forward", "sqrt", "scan_sqrt"),
    (scan_backward, jnp.float32(2.0), "backward", "sqrt", "scan_sqrt_grad"),
    (through_jit, jnp.array([1.0, -1.0]), "forward", "log", "jit_log"),
    (jax.jit(where_log), jnp.array([0.0, 1.0]), "backward", "log", "where_log"),
]
IDS = ["where_log", "sqrt_at_0", "norm_of_zero", "softmax_exp_overflow", "div_by_zero",
       "scan_forward", "scan_backward", "inside_jit", "jit_of_loss"]


@pytest.mark.parametrize("fn, x, phase, primitive, marker", CASES, ids=IDS)
def test_each_case_is_located_to_primitive_pass_and_line(fn, x, phase, primitive, marker):
    assert_located(find_nonfinite(fn, x), phase, primitive, marker)


def test_where_log_report_suggests_the_double_where():
    report = find_nonfinite(where_log, jnp.array([0.0, 1.0]))
    assert report.value == 0.0                        # the forward pass is finite
    assert report.nonfinite == ("grad of x",)
    # Operands of log: x = [0, 1]; cotangent [0, 1] from where. Produced: [0/0, 1/1] = [NaN, 1].
    x_stats, ct_stats = report.inputs
    assert (x_stats.min, x_stats.max, x_stats.nonfinite) == (0.0, 1.0, 0)
    assert (ct_stats.min, ct_stats.max, ct_stats.nonfinite) == (0.0, 1.0, 0)
    assert (report.output.nonfinite, report.output.nan, report.output.size) == (1, 1, 2)
    assert "double where" in report.hint and "jnp.where(x > 0, x, 1.0)" in report.hint
    assert len(report.masked) == 1 and report.masked[0].startswith("log at test_anomaly.py")
    # The forward pass alone is fine, and says so (with the masked -inf noted).
    forward = find_nonfinite(where_log, jnp.array([0.0, 1.0]), grad=False)
    assert forward.ok and forward.masked == report.masked


def test_the_double_where_fixes_it():
    def safe(x):
        safe_x = jnp.where(x > 0, x, 1.0)
        return jnp.sum(jnp.where(x > 0, jnp.log(safe_x), 0.0))
    report = find_nonfinite(safe, jnp.array([0.0, 1.0]))
    assert report.ok and report.masked == () and "all finite" in str(report)


def test_sqrt_and_norm_report_inf_cotangent_and_hints():
    report = find_nonfinite(sqrt_at_zero, jnp.float32(0.0))
    # Cotangent 1 into sqrt at x = 0: 1 / (2 * 0) = +inf, one element.
    assert (report.output.max, report.output.nonfinite, report.output.nan) == (np.inf, 1, 0)
    norm = find_nonfinite(norm_of_zero, jnp.zeros(3))
    assert any("'norm'" in c for c in norm.context)
    assert "safe_norm" in norm.hint


def test_exp_overflow_reports_operand_statistics():
    report = find_nonfinite(first_probability, jnp.array([1000.0, 0.0]))
    (z,) = report.inputs
    assert (z.min, z.max, z.nonfinite, z.size) == (0.0, 1000.0, 0, 2)
    # exp([1000, 0]) = [inf, 1]: one non-finite element, and no NaN yet (that comes at div).
    assert (report.output.max, report.output.nonfinite, report.output.nan) == (np.inf, 1, 0)
    assert "88.7" in report.hint and "log_softmax" in report.hint


def test_scan_reports_the_iteration():
    assert any("iteration 2 (0-based) of 4" in c
               for c in find_nonfinite(scan_forward, jnp.float32(2.5)).context)
    assert any("iteration 1 (0-based) of 2" in c
               for c in find_nonfinite(scan_backward, jnp.float32(2.0)).context)


def test_jit_context_is_named():
    report = find_nonfinite(through_jit, jnp.array([1.0, -1.0]))
    assert report.context[0].startswith("jit 'jitted_log' at test_anomaly.py")
    (x,) = report.inputs
    assert (x.min, x.max) == (-1.0, 1.0)


# --- where JAX's own tools stop ---------------------------------------------------------------

def test_jit_of_grad_located_where_debug_nans_names_only_the_primitive():
    x = jnp.array([0.0, 1.0])
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError) as info:
            jax.jit(jax.grad(where_log))(x)
    # jax_debug_nans (this JAX) names the transposed primitive but not the line.
    assert "div" in str(info.value) and f":{line_of('where_log')}" not in str(info.value)
    # The gradient function itself, checked as a plain function: log's transpose is a div on
    # the line of the log, in the backward pass (name stack transpose(jvp(...))).
    report = find_nonfinite(jax.jit(jax.grad(where_log)), x, grad=False)
    assert_located(report, "backward", "div", "where_log")
    assert "jax.grad" in report.hint
    # And the loss itself under jit, differentiated by find_nonfinite: log, backward, same line.
    assert_located(find_nonfinite(jax.jit(where_log), x), "backward", "log", "where_log")


def test_exp_overflow_located_where_checkify_float_checks_see_nothing():
    def total(z):
        return jnp.sum(jnp.exp(z))  # <- checkify_exp
    z = jnp.array([1000.0, 0.0])
    err, out = checkify.checkify(jax.jit(total), errors=checkify.float_checks)(z)
    assert err.get() is None and out == np.inf      # inf from overflow: no check fires
    assert_located(find_nonfinite(total, z), "forward", "exp", "checkify_exp")


# --- fine functions, nested programs, gradients -------------------------------------------------

def mlp_loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


@pytest.fixture(scope="module")
def mlp():
    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 16, 10))
    return params, {"x": jnp.asarray(data.x_train[:8]), "y": jnp.asarray(data.y_train[:8])}


def test_fine_function_is_reported_ok_with_its_loss(mlp):
    params, batch = mlp
    report, _, grads = _locate(mlp_loss, (params, batch), argnums=0, grad=True, has_aux=False)
    assert report.ok and report.phase is None and report.checked == "forward and backward"
    assert "all finite" in str(report)
    # Second method: jax.grad. Same rules in the same order; 1e-6 allows float32 reassociation
    # between op-by-op and jitted execution.
    loss, ref = jax.value_and_grad(mlp_loss)(params, batch)
    np.testing.assert_allclose(report.value, float(loss), rtol=1e-6)
    for g, r in zip(grads, jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@jax.custom_vjp
def scaled(a):
    return a * 2.0


scaled.defvjp(lambda a: (a * 2.0, a), lambda a, ct: (ct * 3.0 * a,))


def many_constructs(x):
    c, ys = lax.scan(lambda c, xi: (c * jnp.sin(xi) + xi, c ** 2), 0.5, x)
    w = lax.fori_loop(0, 3, lambda i, v: v * 0.9 + jnp.cos(v), x)
    k = lax.cond(x[0] > 0, jnp.sin, lambda v: v ** 3, x)
    r = jax.checkpoint(lambda v: jnp.tanh(v) * v)(x)
    back = lax.scan(lambda c, xi: (c * xi, c), 1.0, x, reverse=True)[1]
    return (c + ys.sum() + w.sum() + k.sum() + r.sum() + scaled(x).sum() + back.sum()
            + jax.nn.relu(x).sum() + jax.nn.softmax(x)[0] + jax.vmap(jnp.exp)(x).sum())


def test_gradient_equals_jax_grad_through_nested_programs():
    # scan (both directions), fori_loop (a scan), cond, remat, custom_vjp (our rule: 3 * a, not
    # the body's 2), custom_jvp (relu, softmax) and vmap, in float64 so that the two methods
    # agree to rounding (1e-12).
    with jax.enable_x64(True):
        x = jnp.linspace(-1.0, 2.0, 6, dtype=jnp.float64)
        report, _, (g,) = _locate(many_constructs, (x,), argnums=0, grad=True, has_aux=False)
        assert report.ok
        np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(many_constructs)(x)),
                                   rtol=1e-12, atol=1e-12)


def test_nan_in_custom_vjp_rule_is_blamed_on_the_rule():
    @jax.custom_vjp
    def clip_grad(a):
        return a

    clip_grad.defvjp(lambda a: (a, a), lambda a, ct: (ct / a,))   # 1/0 at a = 0

    def loss(x):
        return jnp.sum(clip_grad(x))  # <- custom_vjp
    report = find_nonfinite(loss, jnp.array([0.0, 1.0]))
    assert_located(report, "backward", "custom_vjp_call 'clip_grad'", "custom_vjp")


def test_nan_in_while_loop_and_cond_branch_forward():
    def loop(x):
        def body(c):
            i, v = c
            return i + 1, jnp.log(v - 1.0)  # <- while_log
        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]
    # v: 10 -> log 9 = 2.2 -> log 1.2 = 0.18 -> log(-0.82) = NaN at iteration 2.
    report = find_nonfinite(loop, jnp.float32(10.0), grad=False)
    assert_located(report, "forward", "log", "while_log")
    assert any("iteration 2 (0-based)" in c for c in report.context)

    def branch(x):
        return lax.cond(x > 0, lambda v: v / 0.0, lambda v: v, x)  # <- cond_div
    assert_located(find_nonfinite(branch, jnp.float32(1.0), grad=False), "forward", "div",
                   "cond_div")


def test_grad_false_checks_any_outputs_and_names_them():
    def two(x):
        return {"fine": x + 1.0, "bad": jnp.log(x)}  # <- two_outputs
    report = find_nonfinite(two, jnp.array([1.0, -1.0]), grad=False)
    assert_located(report, "forward", "log", "two_outputs")
    assert report.nonfinite == ("output['bad']",) and report.checked == "forward"


def test_masked_minus_inf_is_fine_and_noted():
    # A -inf attention mask: softmax gives exactly 0 there, the loss and gradient are finite.
    def attention(logits):
        masked = jnp.where(jnp.arange(3) < 2, logits, -jnp.inf)
        return jax.nn.softmax(masked)[0]
    report = find_nonfinite(attention, jnp.array([0.5, 1.0, 2.0]))
    assert report.ok and len(report.masked) == 1


def test_has_aux_and_argnums():
    def loss(w, b):
        return jnp.sum(jnp.sqrt(w) * b), {"w": w}  # <- aux
    w, b = jnp.array([0.0, 4.0]), jnp.array([1.0, 1.0])
    report = find_nonfinite(loss, w, b, has_aux=True)
    assert_located(report, "backward", "sqrt", "aux")
    assert report.nonfinite == ("grad of w",)
    # Differentiating b only: d/db = sqrt(w) = [0, 2], finite.
    assert find_nonfinite(loss, w, b, argnums=1, has_aux=True).ok


def test_nonfinite_input_is_reported_by_path(mlp):
    params, batch = mlp
    bad = [dict(layer) for layer in params]
    bad[1]["b"] = bad[1]["b"].at[3].set(jnp.nan)
    report = find_nonfinite(mlp_loss, bad, batch)
    assert (report.phase, report.where, report.nonfinite) == ("input", "params[1]['b']",
                                                               ("params[1]['b']",))
    assert (report.output.nonfinite, report.output.nan, report.output.size) == (1, 1, 10)
    x = batch["x"].at[0, 0].set(jnp.inf)
    assert find_nonfinite(mlp_loss, params, {**batch, "x": x}).where == "batch['x']"


def test_report_plain_data_and_text():
    report = find_nonfinite(where_log, jnp.array([0.0, 1.0]))
    d = report.to_dict()
    assert d["ok"] is False and d["phase"] == "backward" and d["primitive"] == "log"
    assert d["line"] == line_of("where_log") and d["inputs"][0]["shape"] == [2]
    text = str(report)
    assert "backward pass" in text and "primitive  log" in text and "double where" in text
    assert isinstance(report.inputs[0], ValueStats)


def test_bad_input_gets_a_clear_error():
    x = jnp.ones(3)
    with pytest.raises(TypeError, match="callable"):
        find_nonfinite("not a function", x)
    with pytest.raises(ValueError, match="argnums=2"):
        find_nonfinite(lambda a: jnp.sum(a), x, argnums=2)
    with pytest.raises(TypeError, match="argnums must be an int"):
        find_nonfinite(lambda a: jnp.sum(a), x, argnums="0")
    with pytest.raises(ValueError, match="real scalar loss"):
        find_nonfinite(lambda a: a * 2.0, x)
    # An integer leaf of params (a step counter) is passed through, not differentiated, as
    # eqx.filter_grad does (issue 13); a complex leaf is refused by name.
    assert find_nonfinite(lambda params: jnp.sum(params["w"]),
                          {"w": x, "step": jnp.int32(3)}).ok
    with pytest.raises(TypeError, match=r"params\['c'\] has dtype complex64"):
        find_nonfinite(lambda params: jnp.sum(params["w"]),
                       {"w": x, "c": jnp.ones(2, jnp.complex64)})
    with pytest.raises(TypeError, match=r"leaf args\[1\] is a str"):
        find_nonfinite(lambda a, *rest: jnp.sum(a), x, "text")
    # grad=False: any outputs, no argnums check.
    assert find_nonfinite(lambda a: a * 2.0, x, grad=False).ok


# --- per-element origins: a masked inf elsewhere in an array does not take the blame --------

def masked_overflow_then_division(x, d):
    u = jnp.exp(x)            # exp(1000) = inf in element 0, which the output never uses
    v = u / d                 # <- late_div
    return v[1]               # element 1: e / 0 = inf, made by the division


def test_a_masked_inf_in_the_same_array_does_not_take_the_blame():
    # Hand: u = [inf, e]; v = u / [1, 0] = [inf, inf]; the output v[1] is inf because of the
    # division by 0 (its operands e and 0 are finite), not because of exp's inf in element 0.
    report = find_nonfinite(masked_overflow_then_division, jnp.array([1000.0, 1.0]),
                            jnp.array([1.0, 0.0]), grad=False)
    assert_located(report, "forward", "div", "late_div")
    assert any(m.startswith("exp at") for m in report.masked)


def masked_attention(s, mask, t):
    logits = jnp.where(mask, s, -jnp.inf)   # <- attention_mask
    z = logits / t                          # <- temperature
    return jax.nn.softmax(z).sum()          # <- masked_softmax


def test_a_minus_inf_mask_is_outranked_by_a_computed_inf():
    # Hand: t = 0 divides the finite logits [1, 3] to +inf (new, made by div) and the masked
    # -inf stays -inf; softmax's max over the row mixes both, and the computed inf is blamed.
    report = find_nonfinite(masked_attention, jnp.array([1.0, 2.0, 3.0]),
                            jnp.array([True, False, True]), jnp.float32(0.0), grad=False)
    assert_located(report, "forward", "div", "temperature")


def test_a_fully_masked_row_names_the_nan_made_of_the_mask():
    # Hand: every logit is -inf, so softmax computes -inf - (-inf) = NaN: a NaN made of the
    # mask's infinities, named at the softmax line with the masked-row hint (the mask alone,
    # -inf where it is, is what attention wants).
    report = find_nonfinite(masked_attention, jnp.array([1.0, 2.0, 3.0]),
                            jnp.array([False, False, False]), jnp.float32(1.0), grad=False)
    assert_located(report, "forward", "sub", "masked_softmax")
    assert "masked entirely" in report.hint
    # With the mask as an additive argument, its infinities stay the argument's (an inf in
    # the data is not a mask): the argument that reached the output is named.
    report = find_nonfinite(lambda z, m: jax.nn.softmax(z + m).sum(), jnp.ones(3),
                            jnp.full(3, -jnp.inf))
    assert (report.phase, report.where) == ("input", "m")
    # With a valid row the -inf stays hidden: finite, and the mask is listed as masked.
    report = find_nonfinite(masked_attention, jnp.array([1.0, 2.0, 3.0]),
                            jnp.array([True, False, True]), jnp.float32(1.0))
    assert report.ok and report.masked


def test_a_non_finite_argument_that_is_not_differentiated_may_be_masked():
    # An additive -inf attention mask passed as an argument: logsumexp(w + mask) over
    # w = [1, 2, 3], mask = [0, -inf, 0] is log(e + e^3), finite, and so is its gradient
    # (softmax weights [e, 0, e^3] / (e + e^3)). It used to be refused as a bad input.
    loss = lambda w, mask: jax.nn.logsumexp(w + mask)
    w, mask = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.0, -jnp.inf, 0.0])
    report = find_nonfinite(loss, w, mask)
    assert report.ok and any(m.startswith("argument mask") for m in report.masked)
    # A differentiated argument that is already NaN is still reported before fn runs.
    report = find_nonfinite(loss, w.at[0].set(jnp.nan), mask)
    assert report.phase == "input" and report.where == "w"
    # A mask that hides everything reaches the output: the argument is named.
    report = find_nonfinite(lambda w, mask: jnp.sum(w + mask), w, mask)
    assert report.phase == "input" and report.where == "mask"


def test_a_while_loop_backward_and_a_shape_argument_get_clear_errors():
    cube = lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * x),
                                    (0, jnp.ones_like(x)))[1].sum()
    with pytest.raises(ValueError, match=r"no reverse-mode derivative.*grad=False"):
        find_nonfinite(cube, jnp.ones(2))
    assert find_nonfinite(cube, jnp.ones(2), grad=False).ok
    # n used as a shape: the message names the line and says to close over n (not over x)
    with pytest.raises(TypeError, match=r"test_anomaly\.py:\d+ \(<lambda>\)(.|\n)*depends on n,"
                                        r"(.|\n)*functools\.partial\(fn, n=\.\.\.\)"):
        find_nonfinite(lambda x, n: jnp.sum(x * jnp.ones(n)), jnp.ones(3), 3)


@pytest.mark.float16
def test_a_float16_derivative_overflow_is_not_blamed_on_a_zero():
    # Hand: log'(1e-5) = 1e5 > 65504, float16's largest finite value: the backward log
    # overflows although no operand is 0, and the hint says the dtype is too narrow.
    report = find_nonfinite(lambda x: jnp.log(x).sum(), jnp.array([1e-5, 1.0], jnp.float16))
    assert (report.phase, report.primitive) == ("backward", "log")
    assert "none is 0" in report.hint and "too narrow: compute this part in float32" in report.hint


def test_a_long_list_of_nonfinite_leaves_is_shortened_in_the_text():
    # Hand: sqrt at 0 has an infinite derivative, so all 20 leaves' gradients are non-finite.
    params = [jnp.zeros(2) for _ in range(20)]
    report = find_nonfinite(lambda ps: sum(jnp.sum(jnp.sqrt(p)) for p in ps), params)
    assert len(report.nonfinite) == 20
    assert "... (20 in all; all in .nonfinite)" in str(report)


def test_out_of_range_labels_get_the_label_hint_and_nothing_reached_is_listed_as_masked():
    # Label 7 of 5 classes: optax's gather fills NaN (an index out of range); label -1: our
    # softmax_cross_entropy adds the NaN itself. Both hints point at the labels, and no origin
    # that reached the loss is listed as masked.
    w, x = jax.random.normal(jax.random.key(0), (3, 5)), jnp.ones((2, 3))
    loss = lambda w, x, y: fg.softmax_cross_entropy(x @ w, y)
    report = find_nonfinite(loss, w, x, jnp.array([1, 7]))
    assert report.primitive == "gather" and "out of range" in report.hint
    assert report.masked == ()
    report = find_nonfinite(loss, w, x, jnp.array([-1, 2]))
    assert "label is outside [0, classes)" in report.hint


def test_a_float32_derivative_overflow_names_the_cotangent():
    # Hand: log'(1e-30) = 1e30, times the cotangent 1e10, is 1e40 > float32's 3.4e38.
    report = find_nonfinite(lambda x: 1e10 * jnp.sum(jnp.log(x)), jnp.array([1e-30, 1.0]))
    assert (report.phase, report.primitive) == ("backward", "log")
    assert "times the cotangent (largest 1e+10)" in report.hint
    assert "float32, e.g." not in report.hint


# --- per-element origins through broadcasts, custom rules, rows and matmuls -----------------

def test_an_origin_survives_a_broadcast_operand():
    # Hand: log(-1) = NaN in element 0; softmax subtracts the row max, an operand of shape (1,)
    # broadcast against (3,), so the NaN's origin must survive it: log is named, not sub.
    report = find_nonfinite(lambda x: jax.nn.softmax(jnp.log(x))[1], jnp.array([-1.0, 1.0, 2.0]))
    assert (report.phase, report.primitive) == ("forward", "log")


def test_origins_pass_through_a_custom_jvp_function_element_by_element():
    # Element 1 of the output is the mask's -inf (log(-1) = NaN sits in the hidden element 0):
    # through a custom_jvp identity the mask, not log, reaches the output.
    @jax.custom_jvp
    def ident(x):
        return x * 1.0
    ident.defjvp(lambda p, t: (ident(p[0]), t[0]))
    f = lambda x: ident(jnp.where(jnp.array([True, False]), jnp.log(x), -jnp.inf))[1]
    report = find_nonfinite(f, jnp.array([-1.0, 1.0]), grad=False)
    assert "non-finite constant" in report.hint


def test_row_wise_reductions_sorts_and_top_k_keep_each_row_s_origin():
    # Row 0 is all mask (-inf), row 1 holds exp(1000) = inf: what reaches the output from row 0
    # is the mask, whatever exp did in row 1.
    def masked(x):
        return jnp.where(jnp.array([[False, False], [True, True]]), jnp.exp(x), -jnp.inf)
    x = jnp.array([[0.0, 0.0], [1000.0, 0.0]])
    for pick in (lambda s: s.max(1)[0], lambda s: jnp.sort(s)[0, 0],
                 lambda s: jax.lax.top_k(s, 2)[0][0, -1]):
        report = find_nonfinite(lambda x, pick=pick: pick(masked(x)), x, grad=False)
        assert "non-finite constant" in report.hint, report.primitive


def test_a_matmul_of_a_minus_inf_mask_and_a_zero_is_named():
    # Hand: [1, -inf] @ [1, 0] = 1 + (-inf * 0) = NaN: dot_general made the NaN of the mask.
    f = lambda x, v: jnp.where(jnp.array([True, False]), x, -jnp.inf) @ v
    report = find_nonfinite(f, jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0]), grad=False)
    assert report.primitive == "dot_general" and report.hint.startswith("dot_general made NaN")


@pytest.mark.float16
def test_a_float16_mask_constant_that_does_not_fit_gets_its_hint():
    # -1e9 cast to float16 (largest 65504) is -inf; the whole row is masked.
    f = lambda s, pad: jax.nn.softmax(jnp.where(pad, s, -1e9).astype(jnp.float16)).sum()
    report = find_nonfinite(f, jnp.ones(3, jnp.float16), jnp.array([False] * 3), grad=False)
    assert report.primitive == "convert_element_type" and "does not fit in float16" in report.hint


def test_nan_data_hidden_by_a_mask_gets_the_zero_times_nan_hint():
    # Row 1 of x is NaN and masked out of the loss: the forward pass is finite, but dW = x^T ct
    # multiplies that NaN by the zero cotangent of the masked row: 0 * NaN = NaN.
    f = lambda w, x, m: jnp.where(m[:, None], x @ w, 0.0).sum()
    report = find_nonfinite(f, jnp.ones((2, 2)), jnp.array([[1.0, 1.0], [jnp.nan, 1.0]]),
                            jnp.array([True, False]))
    assert (report.phase, report.primitive) == ("backward", "dot_general")
    assert "0 * NaN is NaN" in report.hint


# --- masks and padded rows: the row is named, funcgrad's own sentinels are not news -----------

_X43 = jax.random.normal(jax.random.key(0), (4, 3))
_W33 = {"w": jax.random.normal(jax.random.key(1), (3, 3)) * 0.1}
# Row 2 is masked entirely (hand: no True in it); the other rows keep at least one element.
_ROW_MASK = jnp.array([[1, 1, 1], [1, 0, 1], [0, 0, 0], [1, 1, 0]], bool)


def test_a_healthy_model_with_softmax_cross_entropy_lists_nothing_masked():
    # The label guard inside fg.softmax_cross_entropy holds a NaN constant that only a bad label
    # lets through; on valid labels it is hidden by design and is not "a -inf mask?".
    def loss(p, x, y):
        return fg.softmax_cross_entropy(x @ p["w"], y)
    report = find_nonfinite(loss, _W33, _X43, jnp.array([0, 1, 2, 1]))
    assert report.ok and report.masked == () and "masked" not in str(report)
    # A bad label is still found and explained.
    bad = find_nonfinite(loss, _W33, _X43, jnp.array([0, 1, 3, 1]))
    assert bad.phase == "forward" and "label outside [0, classes)" in bad.hint


def test_logsumexp_of_a_fully_masked_row_names_the_row_and_the_finite_fill():
    def loss(p, x):
        s = jnp.where(_ROW_MASK, x @ p["w"], -jnp.inf)
        return jnp.sum(jax.nn.logsumexp(s, axis=-1))
    # Hand: row 2 sums exp(-inf) = 0 and log(0) = -inf; the other rows are finite.
    assert np.isneginf(jax.nn.logsumexp(jnp.where(_ROW_MASK, _X43 @ _W33["w"], -jnp.inf), -1))\
        .tolist() == [False, False, True, False]
    report = find_nonfinite(loss, _W33, _X43)
    assert report.phase == "forward" and report.primitive == "log"
    assert "element(s) [2]" in report.hint and "fully masked row" in report.hint
    assert "jnp.finfo(s.dtype).min" in report.hint and "double where" not in report.hint


def test_a_hidden_fully_masked_row_in_the_backward_pass_is_named_not_double_where():
    def loss(p, x):  # an additive -inf mask; the masked row's logsumexp is dropped by a where
        s = x @ p["w"] + jnp.where(_ROW_MASK, 0.0, -jnp.inf)
        return jnp.sum(jnp.where(_ROW_MASK.any(-1), jax.nn.logsumexp(s, -1), 0.0))
    assert np.isnan(jax.grad(loss)(_W33, _X43)["w"]).all()  # jax.grad agrees: NaN
    report = find_nonfinite(loss, _W33, _X43)
    if _lse_has_custom_rule():  # its rule: softmax of row 2, exp(-inf - (-inf)) = NaN
        assert report.phase == "backward" and report.primitive == "logsumexp"
        assert "row(s) [2]" in report.hint and "0 * NaN" in report.hint
    else:  # primitive by primitive: log's 1/0 at row 2 times the where's zero cotangent
        assert report.phase == "backward" and report.primitive == "log"
        assert "element(s) [2]" in report.hint and "0 * inf" in report.hint
    assert "fully masked row" in report.hint and "jnp.finfo" in report.hint
    assert "safe_x" not in report.hint  # not the generic double-where recipe


def test_a_nan_in_a_padded_row_is_connected_to_that_row():
    padded = _X43.at[3].set(jnp.nan)   # row 3 is padding, filled with NaN
    weights = jnp.array([1.0, 1.0, 1.0, 0.0])
    labels = jnp.array([0, 1, 2, 1])

    def hidden(p, x, y, w):  # the padded row is hidden by a where: NaN only in the gradient
        per = optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y)
        return jnp.sum(jnp.where(w > 0, per, 0.0)) / jnp.sum(w)

    assert np.isnan(jax.grad(hidden)(_W33, padded, labels, weights)["w"]).all()
    report = find_nonfinite(hidden, _W33, padded, labels, weights)
    assert report.phase == "backward"
    assert "comes from the argument x (non-finite in row [3])" in report.hint

    def weighted(p, x, y, w):  # weighted out: 0 * NaN is NaN already in the forward pass
        per = optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y)
        return jnp.sum(per * w) / jnp.sum(w)

    assert np.isnan(weighted(_W33, padded, labels, weights))
    report = find_nonfinite(weighted, _W33, padded, labels, weights)
    assert report.phase == "input" and report.where == "x"
    assert "row [3]" in report.hint and "0 * NaN is NaN" in report.hint


def test_funcgrads_own_guards_are_not_listed_as_masked_from_any_subpackage():
    """The label guard of fg.softmax_cross_entropy (funcgrad/demo/mlp.py, a -inf/NaN constant
    that never reaches the loss) is funcgrad's own: a clean batch lists nothing masked. It was
    listed when the own-code test looked only in the folder of anomaly.py itself."""
    params = fg.mlp_init(jax.random.key(0), (4, 8, 3))
    batch = {"x": jnp.ones((5, 4)), "y": jnp.array([0, 1, 2, 0, 1])}
    report = fg.find_nonfinite(
        lambda p, b: fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"]), params, batch)
    assert report.ok and report.masked == ()


# --- issue 25 point 4: a logsumexp over a whole array that is all -inf (a 0-d log operand) ----

_NONE = jnp.array([False, False, False])  # a mask that hides every element


def lse_all_masked_nn(x):
    return jax.nn.logsumexp(jnp.where(_NONE, x, -jnp.inf))  # <- lse_nn


def lse_all_masked_scipy(x):
    return jax.scipy.special.logsumexp(jnp.where(_NONE, x, -jnp.inf))  # <- lse_scipy


def lse_all_masked_hidden(x):  # an additive mask; the where drops the masked logsumexp
    s = x + jnp.where(_NONE, 0.0, -jnp.inf)
    return jnp.where(_NONE.any(), jax.nn.logsumexp(s), 0.0)  # <- lse_hidden


@pytest.mark.parametrize("fn, marker", [(lse_all_masked_nn, "lse_nn"),
                                        (lse_all_masked_scipy, "lse_scipy")],
                         ids=["jax.nn", "jax.scipy.special"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "forward"])
def test_logsumexp_over_an_all_minus_inf_array_is_reported_not_an_index_error(fn, marker, grad):
    # Hand: every element is -inf, so logsumexp's max is -inf (replaced by 0, not finite),
    # exp(-inf - 0) = 0, the sum is the scalar 0 and log(0) = -inf: the log is the first
    # primitive to make a non-finite value, with a 0-d operand. The hint's code used to call
    # np.argwhere on that 0-d operand and raise IndexError instead of returning the report.
    x = jnp.array([1.0, 2.0, 3.0])
    assert np.isneginf(fn(x))
    report = find_nonfinite(fn, x, grad=grad)
    assert_located(report, "forward", "log", marker)
    assert report.inputs[0].shape == () and report.inputs[0].max == 0.0  # log's operand: 0
    assert "its operand, a scalar, is 0" in report.hint and "fully masked row" in report.hint
    assert "jnp.finfo(s.dtype).min" in report.hint


def test_a_hidden_all_minus_inf_logsumexp_is_named_in_the_backward_pass():
    # The forward value is 0 (the where takes its 0.0), but the backward pass multiplies log's
    # infinite derivative 1/0 by the where's zero cotangent: 0 * inf = NaN, as jax.grad says.
    x = jnp.array([1.0, 2.0, 3.0])
    assert float(lse_all_masked_hidden(x)) == 0.0
    assert np.isnan(jax.grad(lse_all_masked_hidden)(x)).all()
    report = find_nonfinite(lse_all_masked_hidden, x)
    if _lse_has_custom_rule():  # named in the user's word, with the masked-row hint
        assert_located(report, "backward", "logsumexp", "lse_hidden")
        assert "every element of its operand is -inf" in report.hint
        assert "fully masked row" in report.hint and "0 * NaN" in report.hint
    else:
        assert_located(report, "backward", "log", "lse_hidden")
        assert "its operand, a scalar, is 0" in report.hint and "0 * inf" in report.hint
    assert "safe_x" not in report.hint  # the masked-row hint, not the generic double where


def test_an_all_minus_inf_mask_argument_gets_the_masked_row_hint():
    # The mask is an argument (not differentiated): w + mask is -inf everywhere, logsumexp's
    # sum of exp is the scalar 0 and log(0) = -inf, made by the log from a finite operand.
    loss = lambda w, mask: jax.nn.logsumexp(w + mask)  # <- lse_arg
    w, mask = jnp.array([1.0, 2.0, 3.0]), jnp.full(3, -jnp.inf)
    assert np.isneginf(loss(w, mask))
    report = find_nonfinite(loss, w, mask)
    assert_located(report, "forward", "log", "lse_arg")
    assert "its operand, a scalar, is 0" in report.hint and "fully masked row" in report.hint
    # Before: the generic log hint ("clip the argument: jnp.log(jnp.maximum(x, eps))"),
    # which does not apply to a logsumexp.
    assert "jnp.maximum(x, eps)" not in report.hint
