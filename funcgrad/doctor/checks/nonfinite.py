"""The first non-finite value, located: `funcgrad.find_nonfinite` (primitive, forward or
backward pass, source line) on the examination batch, on any rows of the data that hold
NaN/inf, and on the step where the training run went non-finite."""
from __future__ import annotations

import jax
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding

NAME = "nonfinite"


def check(ctx: Context) -> Finding:
    from funcgrad.debug.anomaly import find_nonfinite

    loss = ctx.subject.scalar_loss()
    places = [("the examination batch", ctx.subject.params, ctx.batch)]
    bad_rows = _nonfinite_rows(ctx)
    if bad_rows is not None:
        places.insert(0, ("the data rows holding NaN/inf", ctx.subject.params, bad_rows))
    if "nonfinite_step" in ctx.shared:
        step, params, batch = ctx.shared["nonfinite_step"]
        places.append((f"training step {step}", params, batch))
    for where, params, batch in places:
        report = find_nonfinite(loss, params, batch)
        if report.ok:
            continue
        evidence = {"on": where, "phase": report.phase, "primitive": report.primitive,
                    "where": report.where, "context": list(report.context),
                    "report": str(report)}
        place = {"line": _short(report.where)} if report.where else {}
        if report.phase == "input":
            place = {"leaf": report.where}
        if report.primitive:
            place["primitive"] = report.primitive
        summary = (f"{where}: the input {report.where} is non-finite" if report.phase == "input"
                   else f"{where}: first non-finite value in the {report.phase} pass, "
                        f"{report.primitive} at {report.where or '?'}")
        return Finding(NAME, "fail", summary, evidence, place,
                       report.hint or "Guard the operation's domain (jnp.where on the input, "
                       "not the output; log of softmax as log_softmax) or clean the data.")
    checked = ", ".join(w for w, _, _ in places)
    return Finding(NAME, "pass", f"loss and gradient finite on {checked}",
                   {"checked": [w for w, _, _ in places]})


def _nonfinite_rows(ctx: Context):
    """Up to 8 rows of the data that hold NaN/inf in a floating leaf, as a batch, or None."""
    sample = ctx.subject.data.sample()
    leaves = jax.tree.leaves(sample)
    bad = np.zeros(np.shape(leaves[0])[0], bool)
    for x in leaves:
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
            bad |= ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    if not bad.any():
        return None
    rows = np.argwhere(bad)[:, 0][:8]
    return jax.tree.map(lambda x: np.asarray(x)[rows], sample)


def _short(where: str) -> str:
    """``model.py:12`` from ``model.py:12:4 (loss)``."""
    head = where.split(" ", 1)[0]
    parts = head.split(":")
    return ":".join(parts[:2]) if len(parts) >= 2 else head
