"""The doctor's variants of the user's train step, each built from the step's own fields: the
step as the checks run it, with a gradient monitor, and taking one batch without accumulation.

What the step clips and monitors is read here and nowhere else in the doctor (`clip_norm`,
`monitored`: from the records of its optimizer chain, `funcgrad.recorded`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from funcgrad.train.step import TrainStep

PyTree = Any


def working(step: TrainStep) -> TrainStep:
    """`step` as the checks run it: jitted, on one device (the checks examine the host's batch
    eagerly; a data-parallel step computes the same numbers on one device, same global batch).
    """
    changes: dict[str, Any] = {}
    if step.parallel is not None:
        changes["parallel"] = None
    if not step.jit:
        changes["jit"] = True
    return dataclasses.replace(step, **changes) if changes else step


def records(subject: Any) -> dict[str, Any]:
    """What the transformations of the subject's optimizer chain record
    (`funcgrad.recorded`), read from the state its step makes."""
    from funcgrad.train.transforms import recorded

    return recorded(subject.init(subject.step).opt_state)


def clip_norm(subject: Any) -> float | None:
    """The maximum global norm the subject's step clips the gradient to (a
    `funcgrad.clip_by_global_norm` in its chain), or None."""
    got = records(subject)
    return None if "max_norm" not in got else float(got["max_norm"])


def monitored(subject: Any) -> TrainStep:
    """The subject's step reporting the gradient monitor's statistics (``metrics["monitor"]``):
    as it is when its chain has a `funcgrad.grad_monitor` (its thresholds), else with one of
    default settings chained first (frozen layers are not watched: `TrainStep.init`)."""
    step = subject.step
    if "monitor_state" in records(subject):
        return step
    import optax

    from funcgrad.train.transforms import grad_monitor

    return dataclasses.replace(step, optimizer=optax.chain(grad_monitor(), step.optimizer))


def unaccumulated(step: TrainStep) -> TrainStep:
    """`step` taking one batch: for a loss made with `funcgrad.accumulate`, its per-example
    loss reduced to the mean (the loss's contract and precision kept); else `step` itself."""
    loss = step.loss
    if loss.accumulation is None:
        return step
    from funcgrad.train.loss import Loss
    from funcgrad.train.precision import mixed_precision

    def mean_loss(params, batch, **kwargs):
        out = loss.fn(params, batch, **kwargs)
        if loss.has_aux or loss.has_state:
            return jnp.mean(out[0]), out[1]
        return jnp.mean(out)
    mean_loss.__name__ = mean_loss.__qualname__ = getattr(loss.fn, "__name__", "loss")
    mean = Loss(mean_loss, has_aux=loss.has_aux, has_state=loss.has_state,
                takes_key=loss.takes_key)
    if loss.precision is not None:
        mean = mixed_precision(mean, loss.precision.compute_dtype,
                               loss_scale=loss.precision.loss_scale)
    return dataclasses.replace(step, loss=mean)


def trained_flags(step: TrainStep, params: PyTree) -> list[bool]:
    """For each leaf of `params` (``jax.tree.leaves`` order): does `step` train it? From the
    masks of `funcgrad.freeze` around its optimizer (``step.trainable`` is them together); a
    mask may be a prefix of params (one bool for a subtree)."""
    from funcgrad.train.masks import frozen_masks

    flags = [True] * len(jax.tree.leaves(params))
    if step.trainable is None:
        return flags
    for mask in frozen_masks(step.optimizer):
        subtrees = jax.tree.structure(mask).flatten_up_to(params)
        per_leaf = [bool(flag) for flag, subtree in zip(jax.tree.leaves(mask), subtrees)
                    for _ in jax.tree.leaves(subtree)]
        flags = [a and b for a, b in zip(flags, per_leaf)]
    return flags

