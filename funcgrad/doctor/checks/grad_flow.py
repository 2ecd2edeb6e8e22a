"""Every trained leaf gets a gradient: `funcgrad.explain_grads` on a tiny batch (the article's
checklist, B5.3 item 1), with the reason for each leaf that gets none."""
from __future__ import annotations

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding

NAME = "grad_flow"

#: explain_grads statuses that are faults for a trained leaf, with the fix.
FIXES = {
    "unused": "The loss never reads this leaf: remove it from the params, or use it (a layer "
              "defined but skipped in the forward pass, a misspelled key).",
    "blocked_by_stop_gradient": "A stop_gradient (or detach) cuts this leaf from the loss: "
                                "remove it, or freeze the leaf on purpose with trainable=.",
    "blocked_by_zero_derivative_op": "An operation with zero derivative (an integer cast, "
                                     "round, floor, argmax, a comparison) cuts the path: keep "
                                     "the computation in floating point.",
    "numerically_zero": "The path exists but the gradient is zero for this data: dead ReLU "
                        "units (all pre-activations <= 0). Use a fan-in init with a zero "
                        "bias (not a negative one), LeakyReLU, or a lower learning rate.",
    "nonfinite": "The gradient holds NaN/inf: see the nonfinite check.",
    "not_differentiable": "An integer or bool leaf among the trained params: make it float, "
                          "or freeze it with trainable=.",
}


def explanation(ctx: Context, batch=None):
    """`funcgrad.explain_grads` of the loss on the tiny batch (cached on `ctx`)."""
    from funcgrad.debug.diagnose import explain_grads

    key = "explanation" if batch is None else "explanation_batch"
    if key not in ctx.shared:
        ctx.shared[key] = explain_grads(ctx.subject.scalar_loss(), ctx.subject.params,
                                        ctx.tiny if batch is None else batch)
    return ctx.shared[key]


def check(ctx: Context) -> Finding:
    report = explanation(ctx)
    trained = dict(zip(ctx.paths, ctx.trained))
    bad = [r for r in report.rows if trained.get(r.path, True) and r.status != "connected"]
    if any(r.status == "numerically_zero" for r in bad):  # a tiny batch may miss a unit
        wider = explanation(ctx, ctx.batch)
        bad = [r for r in bad if r.status != "numerically_zero"
               or wider[r.path].status != "connected"]
    rows = len(report.rows)
    evidence = {"leaves": rows, "trained": sum(trained.get(r.path, True) for r in report.rows),
                "statuses": {r.path: r.status for r in report.rows},
                "grad_norms": {r.path: r.grad_norm for r in report.rows},
                "relus": [{"where": s.where, "units": s.units, "dead": s.dead}
                          for s in report.relus]}
    if not bad:
        return Finding(NAME, "pass", f"all {evidence['trained']} trained leaves get a "
                       "non-zero gradient", evidence)
    hard = [r for r in bad if r.status != "numerically_zero" or "dead" in r.detail]
    verdict = "fail" if hard else "warn"  # a zero last layer also zeroes the ones before it
    bad = hard or bad
    first = bad[0]
    place = ctx.place(first.path)
    line = _line(first.detail)
    if line:
        place["line"] = line
    names = ", ".join(f"{r.path} ({r.status})" for r in bad[:6])
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    detail = f": {first.detail}" if first.detail else ""
    return Finding(NAME, verdict, f"{len(bad)} trained leaf/leaves get no gradient: "
                   f"{names}{more}", evidence | {"first_detail": first.detail}, place,
                   FIXES.get(first.status, "") + (f" ({first.path}{detail})"))


def _line(detail: str) -> str:
    """``file.py:LINE`` from an explain_grads detail (``... at model.py:12:4 (loss)``)."""
    import re

    found = re.search(r"([\w.\-]+\.py):(\d+)", detail)
    return f"{found.group(1)}:{found.group(2)}" if found else ""
