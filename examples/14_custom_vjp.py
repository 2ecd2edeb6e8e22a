"""Custom backward rules, checked (concept 14, article A §3.4): autograd.Function as custom_vjp.

1. A clipped identity: forward y = x, backward clips the cotangent to [-c, c]. Where the
   cotangent is inside [-c, c] the rule is the true derivative (finite differences agree);
   where it is outside, the checker reports exactly the difference clipping makes.
2. A straight-through estimator: forward round(x), backward the identity. Finite differences
   of round are 0 away from half-integers, so the rule is *not* the derivative: that
   difference is the point of an STE, shown next to the hand-derived rule.
3. A backward rule with the classic broadcast bug (a bias cotangent not summed over the
   batch): caught by funcgrad before JAX, naming the input and both shapes.
4. A backward rule that forgets a cotangent (None for the scale w, which the output depends
   on): funcgrad warns while the backward pass is traced, and explain_grads names the rule
   as what blocks w (not "numerically zero").

    $ python examples/14_custom_vjp.py
"""
import functools
import warnings

import jax
import jax.numpy as jnp
from _check import Check

import funcgrad as fg
from funcgrad.check.custom import custom_vjp

# --- 1. clipped identity: c is a Python float, passed to bwd first (nondiff_argnums) -----------

@functools.partial(custom_vjp, nondiff_argnums=(1,))
def clipped_identity(x, c):
    return x


def clipped_identity_fwd(x, c):
    return x, None                                  # nothing to save for the backward pass


def clipped_identity_bwd(c, residuals, g):
    return (jnp.clip(g, -c, c),)                    # one cotangent per differentiable input


clipped_identity.defvjp(clipped_identity_fwd, clipped_identity_bwd)


# --- 2. straight-through estimator ---------------------------------------------------------

@custom_vjp
def round_ste(x):
    return jnp.round(x)


round_ste.defvjp(lambda x: (jnp.round(x), None), lambda residuals, g: (g,))


# --- 3. a bias add whose backward forgets the broadcast --------------------------------------

@custom_vjp
def add_bias(x, b):                                 # x: (batch, n), b: (n,)
    return x + b[None, :]


def add_bias_bwd_buggy(residuals, g):
    return g, g                                     # bug: db must be g.sum(axis=0), shape (n,)


add_bias.defvjp(lambda x, b: (add_bias(x, b), None), add_bias_bwd_buggy)


# --- 4. a bwd rule that forgets a cotangent --------------------------------------------------

@custom_vjp
def scale(x, w):                                    # x: (n,), w: () ; out = x * w
    return x * w


def scale_bwd_forgetful(residuals, g):
    x, w = residuals
    return g * w, None                              # bug: dL/dw = sum(g * x) is dropped


scale.defvjp(lambda x, w: (x * w, (x, w)), scale_bwd_forgetful)


def main() -> None:
    x = jnp.array([0.2, 1.7, -0.6])
    c = Check("clipped identity, c = 1: loss = sum(w * y), y = x", left="funcgrad",
              right="expected")

    # dL/dy = w; the rule returns clip(w, -1, 1), the true derivative is w (y = x).
    w_in = jnp.array([0.5, -0.25, 0.75])            # |w| < c: the rule is the true derivative
    loss_in = lambda x: jnp.sum(w_in * clipped_identity(x, 1.0))
    g = jax.jit(jax.grad(loss_in))(x)
    for i in range(3):
        c.row(f"dL/dx[{i}] (jit), |w| < c", g[i], w_in[i])
    report = fg.check_grads(loss_in, x)
    c.same("check_grads where |w| < c", report.rows[0].status, "ok")
    c.below("  max |rule - finite diff|", report.rows[0].max_abs_error, 1e-7)

    w_out = jnp.array([0.5, 3.0, 0.75])             # |w[1]| = 3 > c: clipped to 1
    loss_out = lambda x: jnp.sum(w_out * clipped_identity(x, 1.0))
    c.row("dL/dx[1], w[1] = 3 clipped to c", jax.grad(loss_out)(x)[1], 1.0)
    report = fg.check_grads(loss_out, x)
    row = report.rows[0]
    c.same("check_grads where |w| > c", row.status, "fail")
    c.same("  located at element", row.worst_index, (1,))
    c.row("  rule there", row.analytic, 1.0)
    c.row("  finite differences (true dL/dx)", row.numeric, 3.0, tol=1e-7)  # float64 FD of a line

    print()
    s = Check("straight-through estimator: loss = sum(w * round(x))", left="funcgrad",
              right="expected")
    w = jnp.array([0.5, -2.0, 1.5])
    loss_ste = lambda x: jnp.sum(w * round_ste(x))
    loss_round = lambda x: jnp.sum(w * jnp.round(x))
    s.row("loss = 0.5*0 - 2*2 + 1.5*(-1)", loss_ste(x), -5.5)
    g = jax.jit(jax.grad(loss_ste))(x)
    for i in range(3):
        s.row(f"dL/dx[{i}] by the STE rule (= w)", g[i], w[i])
    s.row("dL/dx by jax.grad of plain round", jnp.abs(jax.grad(loss_round)(x)).max(), 0.0)
    # Away from half-integers round is flat: both finite differences are 0, so the checker
    # sees |rule - finite diff| = |w| everywhere and the largest is |w[1]| = 2.
    row = fg.check_grads(loss_ste, x).rows[0]
    s.same("check_grads (STE is not d round)", row.status, "fail")
    s.row("  finite differences at the worst", row.numeric, 0.0)
    s.row("  max |rule - finite diff| = max|w|", row.max_abs_error, 2.0)

    print()
    b = Check("a bwd rule with a broadcast bug", left="found", right="expected")
    try:
        jax.grad(lambda x, bias: jnp.sum(add_bias(x, bias)), argnums=1)(
            jnp.ones((4, 3)), jnp.zeros(3))
        message, kind = "", "no error"
    except (TypeError, ValueError) as e:
        message, kind = str(e), type(e).__name__
    print("  " + message.replace("\n", "\n  "))
    b.same("error", kind, "ValueError")
    b.same("raised by funcgrad, not JAX", message.startswith("custom_vjp: the bwd rule"), True)
    b.same("names the input", "  b: expected float32[3]" in message, True)
    b.same("and what it got", "got float32[4,3]" in message, True)

    print()
    d = Check("a bwd rule that forgets a cotangent", left="found", right="expected")
    loss = lambda p, x: jnp.sum(scale(x, p["w"]) ** 2)
    params, xs = {"w": jnp.float32(2.0)}, jnp.array([1.0, 2.0, 3.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fg.explain_grads(loss, params, xs)
    messages = [str(w.message) for w in caught if w.category is fg.DroppedCotangentWarning]
    print("  warning: " + (messages[0] if messages else "none"))
    print("  " + str(report).replace("\n", "\n  "))
    d.same("warned, naming w", bool(messages) and "for w (float32[])" in messages[0], True)
    # The true dL/dw = sum(2 (x w) x) = 2 w sum(x^2) = 2 * 2 * 14 = 56; the rule gives 0.
    d.row("true dL/dw = 2 w sum(x^2)", jax.grad(lambda w: jnp.sum((xs * w) ** 2))(2.0), 56.0)
    d.same("explain_grads status of w", report.status("p['w']"), "blocked_by_zero_derivative_op")
    d.same("  names the rule", "scale_bwd_forgetful" in report["p['w']"].detail, True)
    c.failed += s.failed + b.failed + d.failed
    c.done()


if __name__ == "__main__":
    main()
