"""Overfitting one small batch within a step budget: a model that cannot drive the loss of a
few examples down cannot learn at all (Karpathy 2019, "overfit one batch")."""
from __future__ import annotations

import math

import jax
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding
from funcgrad.doctor._steps import unaccumulated

NAME = "overfit"

#: No progress: the last losses are above this fraction of the first.
NO_PROGRESS = 0.95


def check(ctx: Context) -> Finding:
    subject = ctx.subject
    rows = subject.data.rows(ctx.options.overfit_rows)
    # One batch, again and again; accumulation (a way to fit a batch in memory) is left out:
    # the per-example loss, reduced as the full batch would be.
    step = unaccumulated(subject.step)
    state = subject.init(step)
    budget = ctx.options.overfit_steps
    target = ctx.options.overfit_ratio
    losses: list[float] = []
    for _ in range(budget):
        state, metrics = step(state, rows)
        losses.append(float(metrics["loss"]))
        if not math.isfinite(losses[-1]):
            break
        if len(losses) >= 10 and np.mean(losses[-5:]) < target * losses[0]:
            break
    first, last = losses[0], float(np.mean(losses[-5:]))
    n_rows = int(np.shape(jax.tree.leaves(rows)[0])[0])
    evidence = {"rows": n_rows, "steps": len(losses), "budget": budget, "loss_first": first,
                "loss_last": last, "target_ratio": target, "losses": losses[::5]}
    ctx.curves["overfit_loss"] = losses
    if not math.isfinite(last):
        return Finding(NAME, "fail", f"overfitting {n_rows} examples went non-finite at step "
                       f"{len(losses) - 1}", evidence, {},
                       "Lower the learning rate; the nonfinite check locates the operation.")
    if last < target * first or first <= 1e-6:
        return Finding(NAME, "pass", f"the loss of {n_rows} examples fell from {first:.4g} to "
                       f"{last:.4g} in {len(losses)} steps", evidence)
    if last >= NO_PROGRESS * first:
        return Finding(NAME, "fail", f"the loss of {n_rows} examples did not fall in "
                       f"{len(losses)} steps ({first:.4g} -> {last:.4g}): the model cannot "
                       "fit even one batch", evidence, {},
                       "Something stops learning altogether: gradients that do not reach the "
                       "params (see grad_flow), labels unrelated to the inputs, a learning "
                       "rate of 0 or far too high.")
    return Finding(NAME, "warn", f"the loss of {n_rows} examples fell only from {first:.4g} to "
                   f"{last:.4g} in {budget} steps (target: below {target:g}x)", evidence, {},
                   "A model should overfit a handful of examples quickly: check the learning "
                   "rate, regularisation (dropout, weight decay) and the model's capacity; "
                   "or raise overfit_steps.")

