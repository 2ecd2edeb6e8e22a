"""The loss at initialisation against log(K): a classifier that starts with no preference
predicts 1/K for every class, and its cross-entropy is -log(1/K) = log(K) whatever the class
frequencies (Karpathy, "A Recipe for Training Neural Networks", 2019: "verify loss @ init")."""
from __future__ import annotations

import math

import jax
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._report import Finding
from funcgrad.doctor.checks.data import label_leaf

NAME = "init_loss"


def classes_of(ctx: Context) -> tuple[int | None, str]:
    """K and where it came from: the model file's `classes`, or the labels when they are one
    integer per example and hold exactly the values 0..K-1 (K <= 1000)."""
    if ctx.subject.classes is not None:
        return int(ctx.subject.classes), "classes"
    found = label_leaf(ctx.subject.data.sample())
    if found is None:
        return None, ""
    y = found[1]
    values = np.unique(y)
    if y.ndim == 1 and 2 <= values.size <= 1000 and values[0] == 0 and \
            values[-1] == values.size - 1:
        return int(values.size), f"the {values.size} distinct labels of {found[0]}"
    return None, ""


def check(ctx: Context) -> Finding:
    k, source = classes_of(ctx)
    loss = float(jax.jit(ctx.subject.scalar_loss())(ctx.subject.params, ctx.batch))
    evidence = {"loss": loss, "classes": k, "classes_from": source,
                "rows": int(np.shape(jax.tree.leaves(ctx.batch)[0])[0])}
    if not math.isfinite(loss):
        return Finding(NAME, "fail", f"the loss at init is {loss} on {evidence['rows']} "
                       "examples", evidence, {},
                       "See the nonfinite check for the operation and line that made it.")
    if k is None:
        return Finding(NAME, "skipped", f"loss at init {loss:.4g}; no class count to compare "
                       "with log(K) (define classes = K in the model file)", evidence)
    expected = math.log(k)
    ratio = loss / expected
    evidence |= {"expected": expected, "ratio": ratio}
    limit = ctx.options["init_loss_ratio"]
    if ratio > limit:
        return Finding(NAME, "warn", f"loss at init {loss:.4g} is {ratio:.1f}x log({k}) = "
                       f"{expected:.4g}: the initial logits are large and confident",
                       evidence, {},
                       "Scale the init down (fan-in variance 1/n_in, a zero or small last "
                       "layer), or check the loss is mean cross-entropy over logits "
                       "(not a sum, not over probabilities).")
    if ratio < 1 / limit:
        return Finding(NAME, "warn", f"loss at init {loss:.4g} is far below log({k}) = "
                       f"{expected:.4g}: an untrained model should not do this well",
                       evidence, {},
                       "Look for labels leaking into the inputs, a loss that is not "
                       "cross-entropy over K classes, or a wrong classes = K.")
    return Finding(NAME, "pass", f"loss at init {loss:.4g}, log({k}) = {expected:.4g} "
                   f"(ratio {ratio:.2f})", evidence)
