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
from funcgrad.doctor._finding import Finding
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
    held = subject.data.rows(ctx.options.check_rows, start=(n or 10**9))  # the last rows
    held_loss = subject.eval_loss if subject.eval_loss is not None else subject.loss
    bound = held_loss.bind(state.model_state, subject.key if held_loss.takes_key else None)

    def loss(params, batch):
        out = bound(params, batch)
        return jnp.mean(out) if jnp.ndim(out) else out
    model = float(jax.jit(loss)(state.params, held))
    evidence: dict = {"loss_trained": model, "steps": len(record["loss"]),
                      "mode": "inference" if subject.eval_loss is not None else "training"}
    baselines: dict[str, float] = {}
    flat, tree = jax.tree.flatten(held)
    label = label_leaf(held)
    label_path = label[0] if label else None
    from funcgrad._paths import leaf_names

    names = leaf_names(held, "data")
    targets = [i for i, name in enumerate(names) if name == label_path or _is_target(name)]
    inputs = [i for i, x in enumerate(flat)
              if i not in targets and jnp.issubdtype(np.asarray(x).dtype, jnp.floating)]
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
    for i in targets:
        if label is None and jnp.issubdtype(np.asarray(flat[i]).dtype, jnp.floating):
            mean_target = _mean_target_loss(loss, state.params, flat, tree, i)
            if mean_target is not None:
                baselines["mean_target"] = mean_target
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
            "class_frequencies": "predicting the class frequencies",
            "mean_target": "predicting the mean target"}[name]
    if gap < MARGIN:
        return Finding(NAME, "warn", f"after {len(record['loss'])} steps the model's loss "
                       f"{model:.4g} does not beat {what} ({best:.4g})", evidence, {},
                       "The model is not using its inputs: check that inputs and labels "
                       "match (no shuffle of one without the other), that the input reaches "
                       "the model (grad_flow), and train longer (steps=) if it is slow.")
    return Finding(NAME, "pass", f"loss {model:.4g} on held-out rows beats {what} "
                   f"({best:.4g}) by {100 * gap:.0f}%", evidence)


def _is_target(name: str) -> bool:
    """A leaf named like labels or targets (`LABEL_KEYS`), whatever its dtype: a regression
    target is floating, and blanking it with the inputs would compare against a baseline that
    is told the answer."""
    from funcgrad.doctor.checks.data import LABEL_KEYS

    last = name.rsplit("[", 1)[-1].strip("]'\"").rsplit(".", 1)[-1]
    return last.lower() in LABEL_KEYS


def _mean_target_loss(loss, params, flat, tree, i) -> float | None:
    """The loss of predicting the mean target for every example, when the loss is a squared
    error c * mean((prediction - target)**2): then shifting the target by d changes the loss
    by the exact second difference 2 c d**2 (checked at d and 2d), and the mean-target loss is
    c * the target's variance. None for any other loss."""
    y = np.asarray(flat[i], np.float64)
    if y.size < 2:
        return None
    d = float(np.std(y)) or 1.0

    def at(shift):
        leaves = list(flat)
        leaves[i] = (y + shift).astype(np.asarray(flat[i]).dtype)
        return float(jax.jit(loss)(params, jax.tree.unflatten(tree, leaves)))
    try:
        base = at(0.0)
        second = [at(h) + at(-h) - 2 * base for h in (d, 2 * d)]
    except Exception:  # noqa: BLE001 - a loss that does not take shifted targets: no baseline
        return None
    c = second[0] / (2 * d * d)
    if not (c > 0 and math.isfinite(c)) or abs(second[1] / (8 * d * d) - c) > 1e-2 * c:
        return None
    return float(c * np.mean((y - y.mean()) ** 2))
