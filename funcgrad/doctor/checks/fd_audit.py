"""The finite-difference audit of every leaf (`funcgrad.audit`: full when small, directional in
blocks when large; a failed check names the custom_vjp / custom_jvp rule at fault)."""
from __future__ import annotations

import re

from funcgrad.doctor._context import Context
from funcgrad.doctor._report import Finding

NAME = "fd_audit"


def check(ctx: Context) -> Finding:
    from funcgrad.check.grads import audit

    report = audit(ctx.subject.scalar_loss(), ctx.subject.params, ctx.tiny,
                   max_full_elements=ctx.options["max_full_elements"],
                   max_evaluations=ctx.options["max_evaluations"], progress=False)
    trained = dict(zip(ctx.paths, ctx.trained))
    failed = [r for r in report.failures if trained.get(r.path, True)]
    evidence = {"mode": report.mode, "dtype": report.dtype_used, "leaves": len(report.rows),
                "rows": {r.path: {"status": r.status, "max_abs_error": r.max_abs_error,
                                  "max_rel_error": r.max_rel_error,
                                  "resolution": r.resolution} for r in report.rows},
                "notes": list(report.notes)}
    if not failed:
        return Finding(NAME, "pass", f"all {len(report.rows)} leaves agree with finite "
                       f"differences ({report.mode}, {report.dtype_used})", evidence)
    rules = [n for n in report.notes if " is wrong " in n]
    first = failed[0]
    place = ctx.place(first.path)
    if rules:  # the custom rule at fault: its function and line come first
        found = re.findall(r"([\w.\-]+\.py):(\d+)", rules[0])
        if found:
            place["line"] = f"{found[-1][0]}:{found[-1][1]}"
        return Finding(NAME, "fail", rules[0].split(". ")[0], evidence, place,
                       "Fix the custom rule's backward (or forward-mode) formula so that it "
                       "matches the derivative of its primal; fg.check_grads on the rule alone "
                       "shows the elements that differ. " + " ".join(rules[1:]))
    worst = f" (worst element {first.worst_index}: analytic {first.analytic:.6g}, numeric " \
            f"{first.numeric:.6g})" if first.worst_index is not None and \
        first.analytic is not None and first.numeric is not None else ""
    names = ", ".join(f"{r.path} ({r.status})" for r in failed[:5])
    fix = ("A stop_gradient makes the gradient differ from the function's derivative: remove "
           "it, or freeze the leaf with trainable=." if first.status == "stop_gradient" else
           "The gradient JAX computes is not the derivative of the loss: look for a "
           "hand-written derivative, a custom_vjp/custom_jvp rule or a non-differentiable "
           "trick (straight-through, a where with a non-finite branch) on this leaf's path.")
    return Finding(NAME, "fail", f"{len(failed)} leaf/leaves disagree with finite "
                   f"differences: {names}{worst}", evidence, place, fix)
