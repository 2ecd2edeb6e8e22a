"""The finite-difference audit of every leaf (`funcgrad.audit`: full when small, directional in
blocks when large; a failed check names the custom_vjp / custom_jvp rule at fault)."""
from __future__ import annotations

import math
import re

import jax
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding

NAME = "fd_audit"


def _quiet():
    """The check's options: no progress bar or time estimate (the doctor prints its own)."""
    from funcgrad.check.options import CheckOptions
    return CheckOptions(progress=False)


def check(ctx: Context) -> Finding:
    from funcgrad.check.audit import audit

    loss = ctx.subject.scalar_loss()
    at_start = float(jax.jit(loss)(ctx.subject.params, ctx.tiny))
    if not math.isfinite(at_start):
        return Finding(NAME, "skipped", f"the loss is not finite at the check point "
                       f"({at_start}): finite differences need a finite loss; see nonfinite "
                       "and data", {"loss": at_start})
    report = audit(loss, ctx.subject.params, ctx.tiny,
                   max_full_elements=ctx.options.max_full_elements,
                   max_evaluations=ctx.options.max_evaluations, options=_quiet())
    trained = dict(zip(ctx.paths, ctx.trained))
    failed = [r for r in report.failures if trained.get(r.path, True)]
    evidence = {"mode": report.mode, "dtype": report.dtype_used, "leaves": len(report.rows),
                "rows": {r.path: {"status": r.status, "max_abs_error": r.max_abs_error,
                                  "max_rel_error": r.max_rel_error,
                                  "resolution": r.resolution} for r in report.rows},
                "notes": list(report.notes)}
    if failed:
        failed = _persisting(ctx, loss, failed, evidence)
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


def _persisting(ctx: Context, loss, failed: list, evidence: dict) -> list:
    """The failed leaves that fail again on other rows of the data. A check point near a kink
    (a ReLU pre-activation within the step of 0) makes a correct gradient disagree with its
    finite differences at that point only; a wrong rule or a stop_gradient disagrees at every
    point. Only the failed leaves are re-checked (the others fixed), so it costs little."""
    from funcgrad.check.audit import audit

    rows = ctx.options.tiny_rows
    other = ctx.subject.data.rows(rows, start=rows)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(ctx.tiny)))
    if same:  # no other rows: nudge the point instead (the kink moves, a wrong rule stays)
        other = None
    leaves, tree = jax.tree.flatten(ctx.subject.params)
    index = {path: i for i, path in enumerate(ctx.paths)}
    chosen = [index[r.path] for r in failed if r.path in index]
    if len(chosen) != len(failed):
        return failed

    def part(sub, batch):
        full = list(leaves)
        for i, x in zip(chosen, sub):
            full[i] = x
        return loss(jax.tree.unflatten(tree, full), batch)

    sub = [leaves[i] for i in chosen]
    if other is None:
        rng = np.random.default_rng(1)
        sub = [x + (1e-3 * np.std(np.asarray(x)) + 1e-6) *
               rng.standard_normal(np.shape(x)).astype(np.asarray(x).dtype) for x in sub]
        other = ctx.tiny
    try:
        if not math.isfinite(float(jax.jit(part)(sub, other))):
            return failed
        again = audit(part, sub, other, max_full_elements=ctx.options.max_full_elements,
                      max_evaluations=ctx.options.max_evaluations, options=_quiet())
    except Exception:  # noqa: BLE001 - the second look is a refinement; keep the first verdict
        return failed
    position = {r.path: i for i, r in enumerate(again.rows)}  # rows in the order of `sub`
    still = {position[r.path] for r in again.failures if r.path in position}
    evidence["recheck"] = {"leaves": [r.path for r in failed],
                           "still_failing": [failed[i].path for i in sorted(still)]}
    return [r for i, r in enumerate(failed) if i in still]
