"""The hint of an `AnomalyReport`: what a non-finite value made by a given primitive, in a given
pass, usually means, and the fix (`DOUBLE_WHERE`, clipping, a wider dtype, ...).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from funcgrad.debug._nonfinite_origin import _finite, _Origin

if TYPE_CHECKING:  # a type only: funcgrad.debug.anomaly imports this module
    from funcgrad.debug.anomaly import ValueStats

#: The safe form of ``jnp.where(x > 0, jnp.log(x), 0.0)``, shown in reports.
DOUBLE_WHERE = """\
    # forward finite, gradient NaN at x = 0: d/dx log(x) = 1/x is inf there, and the backward
    # pass multiplies it by the zero cotangent of the branch jnp.where did not take: 0 * inf.
    y = jnp.where(x > 0, jnp.log(x), 0.0)
    # fixed: give the primitive a harmless argument where its value is not used.
    safe_x = jnp.where(x > 0, x, 1.0)
    y = jnp.where(x > 0, jnp.log(safe_x), 0.0)"""

_INF_DERIVATIVE_AT_ZERO = {"sqrt", "rsqrt", "cbrt", "pow", "log", "log1p", "div", "integer_pow"}


def _rows(x, limit: int = 5) -> str:
    """"row(s) [3, 7]": the first indices (axis 0) where `x` is not finite."""
    a = np.asarray(x)
    if a.ndim == 0:
        return "its only element"
    rows = np.unique(np.argwhere(~np.isfinite(a.astype(np.float64) if a.dtype != bool
                                              else a))[:, 0]).tolist()
    more = f" (of {len(rows)})" if len(rows) > limit else ""
    return f"row{'s' if len(rows) > 1 else ''} {rows[:limit]}{more}"


def _zero_elements(x, limit: int = 5) -> str:
    """Where `x` is exactly 0, as the hints say it: "at element(s) [2] of its operand",
    "at element(s) [(0, 2), (1, 3)] of its operand" (the first `limit` indices), or "(its
    operand, a scalar, is 0)" for a 0-d `x` (a logsumexp over a whole array reduces to one)."""
    a = np.asarray(x)
    if a.ndim == 0:
        return "(its operand, a scalar, is 0)"
    found = [tuple(i) if len(i) > 1 else int(i[0]) for i in np.argwhere(a == 0)]
    more = f" (of {len(found)})" if len(found) > limit else ""
    return f"at element(s) {found[:limit]}{more} of its operand"


_FORWARD_HINTS = {
    "exp": "exp overflows {dtype} above {exp_limit:.1f} (the largest operand here is {max:.4g}). "
           "Subtract the maximum first, as jax.nn.softmax, jax.nn.log_softmax and "
           "jax.nn.logsumexp do.",
    "log": "log of 0 is -inf and of a negative number NaN (the smallest operand here is "
           "{min:.4g}). For jnp.log(softmax(z)) use jax.nn.log_softmax(z); otherwise clip the "
           "argument: jnp.log(jnp.maximum(x, eps)).",
    "div": "a denominator is 0, or the division is 0/0 or inf/inf. Add a small eps to the "
           "denominator, or guard it with the double where:\n" + DOUBLE_WHERE,
    "sqrt": "sqrt of a negative number is NaN (the smallest operand here is {min:.4g}). Clip "
            "the argument: jnp.sqrt(jnp.maximum(x, 0.0)).",
}
_FORWARD_HINTS |= {"exp2": _FORWARD_HINTS["exp"], "expm1": _FORWARD_HINTS["exp"],
                   "log1p": _FORWARD_HINTS["log"], "rem": _FORWARD_HINTS["div"],
                   "rsqrt": _FORWARD_HINTS["sqrt"]}


def _masked_lse_hint(origin: _Origin) -> str:
    """The backward pass of a logsumexp with a custom rule (jax >= 0.12.1) over rows that a
    -inf mask covers entirely."""
    a = np.asarray(origin.operands[0][1])
    where = ("(every element of its operand is -inf)" if a.ndim < 2 else
             "at row(s) " + str(np.argwhere(np.all(np.isneginf(a), axis=-1))[:5, 0].tolist())
             + " of its operand, all -inf")
    return ("logsumexp " + where + ": a row that a -inf mask covers entirely (a fully masked "
            "row). Its derivative, the softmax of the row, is exp(-inf - (-inf)) = NaN there, "
            "and the zero cotangent of the jnp.where that hides the row keeps it: 0 * NaN = "
            "NaN. Fill the masked entries with a large negative finite number instead of -inf, "
            "e.g. jnp.where(mask, s, jnp.finfo(s.dtype).min) (exp of it is 0 too, so other rows "
            "do not change), or leave one element of every row unmasked; then drop the fully "
            "masked rows from the loss with jnp.where.")


def _masked_row_hint(origin: _Origin, backward: bool) -> str:
    """log of a sum of exp over rows that a -inf mask covers entirely (a logsumexp)."""
    operand = origin.operands[0][1]
    zeros = _zero_elements(operand)
    row = "a row" if np.ndim(operand) else "the whole array (reduced to one value)"
    effect = ("its derivative 1/0 is infinite there, and the zero cotangent of the jnp.where "
              "that hides the row turns it into 0 * inf = NaN" if backward else
              "the logsumexp of that row is -inf")
    return ("log of 0 " + zeros + ": a sum of exp over " + row + " "
            "that a -inf mask covers entirely (a fully masked row; exp(-inf) = 0), so "
            + effect + ". Fill the masked entries with a large negative finite number instead "
            "of -inf, e.g. jnp.where(mask, s, jnp.finfo(s.dtype).min) (exp of it is 0 too, so "
            "other rows do not change), or leave one element of every row unmasked; then drop "
            "the fully masked rows from the loss with jnp.where.")


def _nan_source_hint(origin: _Origin, name: str) -> str:
    """A NaN operand in the backward pass, connected to the argument (data row) it came from."""
    data = [o for o in origin.sources if o.phase == "input"]
    operand = next((v for n, v in origin.operands if not n.startswith("cotangent")
                    and not _finite(v)), None)
    at = f" at {_rows(operand)}" if operand is not None else ""
    if not data:
        return (f"an operand of {name} holds NaN{at} (data, or an earlier NaN) that a jnp.where "
                "or mask hides in the forward pass; the backward pass multiplies it by the zero "
                "cotangent of the hidden elements, and 0 * NaN is NaN. Replace the NaN before "
                f"{name} (e.g. jnp.where(mask, x, 0) on its input), not only after it.")
    src = data[0]
    return (f"an operand of {name} holds NaN{at}, which comes from the argument "
            f"{src.produced_name} (non-finite in {_rows(src.produced)}): a padded or masked "
            "row? The forward pass hides it (a jnp.where or a zero weight), but the backward "
            f"pass multiplies {name}'s derivative there by the zero cotangent, and 0 * NaN is "
            f"NaN. Replace the NaN in {src.produced_name} itself (pad with zeros, or "
            "jnp.where(valid[:, None], x, 0.0) before the model), not only in the loss.")


def _hint(origin: _Origin, inputs: tuple[ValueStats, ...], produced: ValueStats,
          minus_inf_mask: bool = False) -> str:
    name = origin.primitive.split(" ")[0]
    zero_log = (name == "log" and minus_inf_mask and bool(origin.operands)
                and np.any(np.asarray(origin.operands[0][1]) == 0))
    if origin.own_transpose:
        return (f"{name} belongs to a derivative that fn computes itself (name stack "
                "'transpose(jvp(...))'); the line is that of the forward operation it "
                "differentiates. Run find_nonfinite on the loss itself, without jax.grad "
                "(grad=True differentiates it), to name the forward primitive and its operands.")
    if name == "constant":
        return "fn returns a non-finite constant."
    if origin.phase == "forward":
        if zero_log:
            return _masked_row_hint(origin, backward=False)
        if origin.constant and "softmax_cross_entropy" in origin.loc.where:
            return ("a label is outside [0, classes): softmax_cross_entropy makes the loss NaN "
                    "for it (a negative label, or one past the last class). Check the targets "
                    "of this batch.")
        if origin.constant:
            return (f"an operand of {name} is a non-finite constant (a literal inf or NaN, e.g. "
                    "-jnp.inf used as a mask), and it reached the output.")
        if origin.from_infinities:
            return (f"{name} made NaN of infinities that come from a constant, such as a -inf "
                    "mask: -inf - (-inf), 0 * inf or inf / inf. If it is a mask, a row is "
                    "masked entirely (the softmax of a row of -inf is NaN): leave at least one "
                    "element unmasked, or mask with a large negative number instead of -inf.")
        if name == "gather" and not any(s.nonfinite for s in inputs):
            return ("an index is out of range: JAX's indexing and take_along_axis fill an "
                    "out-of-bound index with NaN (a label outside [0, classes) in a "
                    "cross-entropy, say). Check the indices, e.g. the labels of this batch.")
        if name in _FORWARD_HINTS:
            return _FORWARD_HINTS[name].format(
                dtype=produced.dtype, exp_limit=float(np.log(float(jnp.finfo(produced.dtype).max))),
                min=inputs[0].min, max=inputs[0].max)
        big = float(jnp.finfo(produced.dtype).max)
        if name == "convert_element_type":
            return (f"a value beyond {produced.dtype}'s range (largest finite {big:.4g}) was "
                    f"cast to {produced.dtype}: the operand reaches "
                    f"{max(abs(inputs[0].min), abs(inputs[0].max)):.4g}. "
                    "A mask constant such as -1e9 does not fit in float16: use "
                    "jnp.finfo(dtype).min, or cast after masking.")
        if any(max(abs(s.min), abs(s.max)) >= big / 4 for s in inputs):
            return (f"{name} left the range of {produced.dtype} (largest finite {big:.4g}): an "
                    "operand is already near that limit, as a mask of jnp.finfo(dtype).min is. "
                    "Adding two such masks overflows: combine them as booleans (mask_a & "
                    "mask_b) or with jnp.minimum, then apply one.")
        low = (" In a 16-bit dtype, compute this part in float32 or scale the loss "
               "(funcgrad.train.precision)." if big < 1e10 else "")
        return (f"{name} left the range of {produced.dtype} (largest finite {big:.4g}) with "
                "finite operands. Values this large usually mean a diverging run: lower the "
                "learning rate, clip the gradients (clip_norm) or normalise the inputs." + low)
    if any(s.nan for s in inputs if not s.name.startswith("cotangent")):
        return _nan_source_hint(origin, name)
    if zero_log:
        return _masked_row_hint(origin, backward=True)
    if (name == "logsumexp" and minus_inf_mask and bool(origin.operands)
            and np.any(np.isneginf(np.asarray(origin.operands[0][1])))):
        return _masked_lse_hint(origin)
    if any(not _finite(x) for x in origin.forward_out):
        first = ("for jnp.log(softmax(z)), use jax.nn.log_softmax(z). Otherwise, "
                 if name in ("log", "log1p") else "")
        return (f"in the forward pass {name} gave non-finite values that did not reach the "
                "loss (jnp.where, indexing or max/min left them out); its derivative is infinite "
                "there, and the backward pass multiplies it by the zero cotangent of those "
                f"elements: 0 * inf = NaN. Fix: {first}use the double where:\n" + DOUBLE_WHERE)
    if any("'norm'" in c for c in origin.context):
        return ("jnp.linalg.norm of a zero vector: its gradient x / ||x|| is 0/0 (sqrt's "
                "derivative is inf at 0). Use optax.safe_norm(x, 0.0), or "
                "jnp.sqrt(jnp.sum(x**2) + eps).")
    operand = inputs[0] if inputs else None
    if (name in _INF_DERIVATIVE_AT_ZERO and operand is not None and operand.nonfinite == 0
            and not operand.min <= 0 <= operand.max):
        # No zero among the operands: the derivative is finite in exact arithmetic, but the
        # cotangent times it leaves the dtype (1/x at x = 1e-5 is 1e5, above float16's 65504).
        big = float(jnp.finfo(produced.dtype).max)
        cotangent = max((max(abs(s.min), abs(s.max)) for s in inputs
                         if s.name.startswith("cotangent")), default=float("nan"))
        text = (f"the derivative of {name} at these operands (min {operand.min:.4g}; none is "
                f"0) times the cotangent (largest {cotangent:.4g}) exceeds the largest finite "
                f"{produced.dtype} ({big:.4g}). ")
        if jnp.finfo(produced.dtype).bits < 32:
            return text + "The dtype is too narrow: compute this part in float32, e.g. " \
                          "jnp.log(x.astype(jnp.float32))."
        return text + ("Keep the argument away from 0 (jnp.log(x + eps)), and check what "
                       "makes the cotangent this large (a loss scaled up too far?).")
    if name in _INF_DERIVATIVE_AT_ZERO:
        return (f"the derivative of {name} is infinite at these operands (sqrt'(x) = "
                "1/(2 sqrt(x)) and log'(x) = 1/x are inf at 0). Keep the argument away from 0 "
                "(jnp.sqrt(x + eps)), or use the double where so that no derivative is taken "
                "there:\n" + DOUBLE_WHERE)
    return (f"the derivative rule of {name} is not finite at these operands, although the "
            "cotangent it received is finite.")
