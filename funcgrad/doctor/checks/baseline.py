"""The gap to an input-independent baseline, after the training run: the trained model's loss
on held-out rows against (a) the same model fed the batch's mean input (every example the
same: what it predicts without looking) and (b) for a classifier, the entropy of the class
frequencies (the cross-entropy of always predicting them)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._report import Finding
from funcgrad.doctor.checks import training
from funcgrad.doctor.checks.data import label_leaf
from funcgrad.doctor.checks.init_loss import classes_of

NAME = "baseline"

#: The model must beat the baseline by this fraction of the baseline's loss.
MARGIN = 0.05


def check(ctx: Context) -> Finding:
    subject = ctx.subject
    record = training.run(ctx)
    if "nonfinite_step" in ctx.shared:
        return Finding(NAME, "skipped", "the training run went non-finite: nothing to compare")
    state = record["state"]
    n = getattr(subject.data, "n", None)
    held = subject.data.rows(ctx.options["check_rows"], start=(n or 10**9))  # the last rows
    bound = subject.loss.bind(state.model_state, subject.key)

    def loss(params, batch):
        out = bound(params, batch)
        return jnp.mean(out) if jnp.ndim(out) else out
    model = float(jax.jit(loss)(state.params, held))
    evidence: dict = {"loss_trained": model, "steps": len(record["loss"])}
    baselines: dict[str, float] = {}
    flat, tree = jax.tree.flatten(held)
    label = label_leaf(held)
    label_path = label[0] if label else None
    from funcgrad._paths import leaf_names

    names = leaf_names(held, "data")
    inputs = [i for i, (name, x) in enumerate(zip(names, flat))
              if name != label_path and jnp.issubdtype(np.asarray(x).dtype, jnp.floating)]
    if inputs:
        blank = list(flat)
        for i in inputs:
            x = np.asarray(flat[i])
            blank[i] = np.broadcast_to(x.mean(axis=0, keepdims=True), x.shape).astype(x.dtype)
        baselines["mean_input"] = float(jax.jit(loss)(state.params,
                                                      jax.tree.unflatten(tree, blank)))
    k, _ = classes_of(ctx)
    if label is not None and k is not None and label[1].ndim == 1:
        y = label[1]
        freq = np.bincount(np.clip(y, 0, k - 1), minlength=k) / len(y)
        baselines["class_frequencies"] = float(-(freq[freq > 0] * np.log(freq[freq > 0])).sum())
    evidence["baselines"] = baselines
    if not baselines:
        return Finding(NAME, "skipped", "no input-independent baseline: no floating input to "
                       "blank and no class labels", evidence)
    if not math.isfinite(model):
        return Finding(NAME, "fail", f"the trained model's loss is {model}", evidence)
    name = min(baselines, key=lambda key: baselines[key])
    best = baselines[name]
    gap = (best - model) / max(abs(best), 1e-12)
    evidence |= {"best_baseline": name, "gap": gap}
    what = {"mean_input": "the model fed the mean input",
            "class_frequencies": "predicting the class frequencies"}[name]
    if gap < MARGIN:
        return Finding(NAME, "warn", f"after {len(record['loss'])} steps the model's loss "
                       f"{model:.4g} does not beat {what} ({best:.4g})", evidence, {},
                       "The model is not using its inputs: check that inputs and labels "
                       "match (no shuffle of one without the other), that the input reaches "
                       "the model (grad_flow), and train longer (steps=) if it is slow.")
    return Finding(NAME, "pass", f"loss {model:.4g} on held-out rows beats {what} "
                   f"({best:.4g}) by {100 * gap:.0f}%", evidence)
