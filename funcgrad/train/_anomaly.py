"""The train step's ``detect_anomaly`` and its explanation of a skipped update.

Split from `funcgrad.train.step`: after a step whose loss or gradient norm is NaN/inf,
`funcgrad.debug.anomaly.find_nonfinite` runs on that step's params, batch, model state and key, as
the step evaluated them (in its compute dtype, at its loss scale, only the trained leaves
differentiated); after a step skipped for a non-finite *update*, `explain_skipped_update` names
the leaves.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._paths import key_paths, keystr
from funcgrad.train.loss import Loss

PyTree = Any
Batch = Any


def _locate_nonfinite(loss_fn: Callable, params: PyTree, batch: Batch, trainable: PyTree | None,
                      compute_dtype: Any = None, scale: float | None = None):
    """`find_nonfinite` of ``loss_fn(params, batch)`` (a plain scalar loss: a `Loss` bound to
    the step's model state and key), evaluated as the step does: only the trainable leaves
    differentiated, in `compute_dtype` and at loss `scale` when given."""
    from funcgrad.debug.anomaly import find_nonfinite
    from funcgrad.train.masks import _split
    from funcgrad.train.precision import cast_floating

    fn = loss_fn
    how: tuple[str, ...] = ()
    if compute_dtype is not None or scale is not None:
        dtype = jnp.float32 if compute_dtype is None else compute_dtype
        unscaled = fn

        def fn(params, batch):
            loss = unscaled(cast_floating(params, dtype), cast_floating(batch, dtype))
            loss = jnp.asarray(loss).astype(jnp.float32)
            return loss if scale is None else loss * scale

        how = (f"the loss as the step computes it: {jnp.dtype(dtype).name}"
               + ("" if scale is None else f", times the loss scale {scale:g}"),)
    if trainable is None:
        report = find_nonfinite(fn, params, batch)
    else:
        train, frozen, merge = _split(params, trainable, "detect_anomaly")
        report = find_nonfinite(lambda params, frozen, batch: fn(merge(params, frozen), batch),
                                train, frozen, batch)
    return dataclasses.replace(report, context=(*how, *report.context)) if how else report


def _scale_of(state: Any) -> float | None:
    return None if state.loss_scale is None else float(state.loss_scale.scale)


def _routine_overflow(loss: float, used: float | None, after: float | None) -> bool:
    """A loss-scale skip that `fit` counts as routine: finite loss, and the scale backed off
    (at its floor it cannot, and a NaN that persists there is an anomaly to locate)."""
    return (used is not None and math.isfinite(loss)
            and after is not None and after < used)  # after is None only when used is


def _locate_first(locate: Callable[[float | None], Any], scale: float | None):
    """``locate(None)`` (the step's pass at scale 1: a NaN/inf that does not come from the
    scale), and only if that is all finite, ``locate(scale)`` (an overflow the scale causes)."""
    report = locate(None)
    return report if (not report.ok or scale is None) else locate(scale)


def _step_key(state: Any) -> jax.Array | None:
    """The key the step drew for the update starting from `state` (None without a key)."""
    return None if state.key is None else jax.random.fold_in(state.key, state.step)


def _detecting_anomalies(step: Callable, loss: Loss, trainable: PyTree | None,
                         compute_dtype: Any = None) -> Callable:
    """`step`, then `find_nonfinite` on the same params and batch when its loss or norm is
    NaN/inf (not for a finite loss under a loss scale: that is a routine overflow, skipped and
    handled by backing the scale off)."""
    def checked(state: Any, batch: Batch) -> tuple[Any, dict[str, Any]]:
        new_state, metrics = step(state, batch)
        value, norm = (float(v) for v in jax.device_get((metrics["loss"], metrics["grad_norm"])))
        if not (math.isfinite(value) and math.isfinite(norm)) and not _routine_overflow(
                value, _scale_of(state), _scale_of(new_state)):
            metrics = {**metrics, "anomaly": _locate_first(
                lambda scale: _locate_nonfinite(
                    loss.bind(state.model_state, _step_key(state)), state.params, batch,
                    trainable, compute_dtype, scale), _scale_of(state))}
        return new_state, metrics

    return functools.wraps(step)(checked)


def _detecting_anomalies_per_micro_batch(step: Callable, loss: Loss,
                                         trainable: PyTree | None, k: int,
                                         compute_dtype: Any = None) -> Callable:
    """The accumulating `step`; after a call with a NaN/inf update, `find_nonfinite` on each
    micro-batch of the first such update, from the params it started from, until one is not
    finite. Its report (context: which micro-batch) is ``metrics["anomaly"]``."""
    from funcgrad.train.microbatches import checked_mask, leading_axes, unpack_microbatches

    def checked(state: Any, microbatches: PyTree, mask: jax.Array | None = None):
        new_state, metrics = step(state, microbatches, mask)
        microbatches, mask = unpack_microbatches(microbatches, mask)
        losses, norms, examples = jax.device_get(
            (metrics["loss"], metrics["grad_norm"], metrics["examples"]))
        bad = ~(np.isfinite(losses) & np.isfinite(norms)) & (examples > 0)
        if state.loss_scale is not None:  # leave routine overflows alone (see above)
            used = np.asarray(jax.device_get(metrics["loss_scale"]))
            after = np.append(used[1:], float(new_state.loss_scale.scale))  # _scale_of
            bad &= ~np.array([_routine_overflow(float(loss), float(a), float(b))
                              for loss, a, b in zip(losses, used, after)], bool)
        bad = np.flatnonzero(bad)
        if not bad.size:
            return new_state, metrics
        u = int(bad[0])
        num, size = leading_axes(microbatches)
        mask = checked_mask(mask, num, size)
        before = state
        if u:  # the params update u started from: the same step on the groups before it
            head = jax.tree.map(lambda a: a[:u * k], microbatches)
            before = step(state, head, None if mask is None else mask[:u * k])[0]
        group = [j for j in range(u * k, min((u + 1) * k, num))
                 if mask is None or np.asarray(mask[j]).any()]
        mean_pass = compute_dtype is not None or before.loss_scale is not None

        def micro_loss(params, microbatch, real, model_state, key):
            """What the step differentiates for one micro-batch (`accumulate._accumulate`):
            the summed loss of its real examples, over its padded size in the scaled pass."""
            losses = loss(params, microbatch, model_state=model_state, key=key).loss
            total = jnp.sum(losses if real is None else jnp.where(real, losses, 0))
            return total / losses.shape[0] if mean_pass else total

        update_key = _step_key(before)
        # The model state each micro-batch of the update saw: it threads through them in order
        # (padded micro-batches included, as in the step's scan).
        states, model_state = {}, before.model_state
        for j in range(u * k, min((u + 1) * k, num)):
            key = None if update_key is None else jax.random.fold_in(update_key, j - u * k)
            states[j] = (model_state, key)
            if loss.has_state:
                model_state = loss(before.params, jax.tree.map(lambda a, j=j: a[j], microbatches),
                                   model_state=model_state, key=key).model_state

        def locate(scale):  # the first micro-batch of the group that is not finite
            report = None
            for j in group:
                real = None if mask is None else np.asarray(mask[j])
                report = _locate_nonfinite(
                    functools.partial(micro_loss, real=real, model_state=states[j][0],
                                      key=states[j][1]), before.params,
                    jax.tree.map(lambda a, j=j: a[j], microbatches), trainable, compute_dtype,
                    scale)
                report = dataclasses.replace(report, context=(
                    f"micro-batch {j - u * k} (0-based) of the {min(k, num - u * k)} of "
                    f"update {u} (micro-batch {j} of the call)", *report.context))
                if not report.ok:
                    return report
            return report

        return new_state, {**metrics, "anomaly": locate(None) if _scale_of(before) is None
                           else _locate_first(locate, _scale_of(before))}

    return functools.wraps(step)(checked)


def _explain_skipped_update(state: Any, metrics: Mapping[str, Any]) -> str:
    """What `fit` says about a step skipped although its loss and gradient norm were finite:
    which leaves' updates or new values were NaN/inf, and how to fix it. `metrics` are those
    of the step built with ``apply_update(..., locate=True)`` on the same state and batch."""
    updates_ok, params_ok = jax.device_get((metrics["update_finite"], metrics["params_finite"]))
    updates_ok, params_ok = np.asarray(updates_ok, bool), np.asarray(params_ok, bool)
    if updates_ok.ndim == 2:  # accumulated: (leaves, updates); the first update with a fault
        bad = np.flatnonzero(~(updates_ok.all(0) & params_ok.all(0)))
        u = int(bad[0]) if bad.size else 0
        updates_ok, params_ok = updates_ok[:, u], params_ok[:, u]
    flat = zip(key_paths(state.params), jax.tree.leaves(state.params))
    rows, half = [], False
    for (kp, leaf), u_ok, p_ok in zip(flat, updates_ok, params_ok):
        if u_ok and p_ok:
            continue
        dtype = jnp.result_type(leaf)
        half |= jnp.finfo(dtype).bits < 32
        what = ("its update holds NaN/inf" if not u_ok else
                "it held NaN/inf before the step" if not np.isfinite(np.asarray(leaf)).all()
                else "its update is finite but the new value overflows")
        rows.append(f"params{keystr(kp)} ({dtype}): {what}")
    if not rows and "model_state_finite" in metrics:
        return _explain_model_state(state, metrics["model_state_finite"])
    if not rows:
        return ""
    text = ("The loss and the gradient norm are finite, but the update would leave "
            "non-finite params: "
            + "; ".join(rows) + ". The step was skipped (params and optimizer state unchanged).")
    if half:
        return text + (
            " In float16 the optimizer's small constants round away (Adam's eps=1e-8 is 0 in "
            "float16, so its update is 0/0 wherever a gradient is 0 or tiny). Keep float32 "
            "params and train funcgrad.mixed_precision(loss_fn, jnp.float16, loss_scale="
            "funcgrad.dynamic_loss_scale()), or give the optimizer an eps "
            "float16 can hold, e.g. optax.adam(1e-3, eps=1e-4).")
    return text + (" Check the optimizer's settings (learning rate, eps) and the scale of the "
                   "params: an update that overflows comes from the optimizer, not the "
                   "gradient.")




def _explain_model_state(state: Any, finite: Any) -> str:
    """The skip explanation when the loss's new model state held NaN/inf."""
    finite = np.asarray(jax.device_get(finite), bool)
    if finite.ndim == 2:  # accumulated: (leaves, updates)
        bad = np.flatnonzero(~finite.all(0))
        finite = finite[:, int(bad[0]) if bad.size else 0]
    names = [f"model_state{keystr(kp)}" for kp, ok in zip(key_paths(state.model_state), finite)
             if not ok]
    if not names:
        return ""
    return ("The loss, the gradient norm and the update are finite, but the new model state "
            "the loss returned holds NaN/inf at " + ", ".join(names) + ". The step was "
            "skipped (params, optimizer state and model state unchanged). Running statistics "
            "go non-finite when a batch's activations overflow or a variance is negative: "
            "check the statistics' update in the loss (e.g. the variance of a batch of one "
            "example, or a missing eps).")
