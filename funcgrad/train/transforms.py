"""Gradient transformations that record what they did, for the user's ``optax.chain``.

optax's own transformations keep no record: ``optax.clip_by_global_norm`` does not say the
norm it clipped, and nothing zeroes a NaN leaf. These three are ordinary optax
``GradientTransformation``s (``init``, ``update``) whose *state* is the record, so they compose
with any optimizer and survive ``jit``, ``scan`` and checkpoints like Adam's moments do:

  `clip_by_global_norm`  clipping by global norm; its `ClipState` holds the pre-clip norm and
                         the coefficient applied;
  `zero_nonfinite`       zeroes the gradient leaves that hold a NaN or inf; its
                         `ZeroNonfiniteState` counts them;
  `grad_monitor`         per-leaf and per-layer gradient statistics and their alerts
                         (`funcgrad.train.monitor`); updates pass through unchanged.

A `funcgrad.TrainStep` reads these states back from the new optimizer state and reports
them as metrics ("grad_norm" and "clip_coef", "nonfinite_leaves", "monitor"): no option of the
step repeats them. In a hand-written loop read them with `recorded`.

Order matters as in any chain: put `zero_nonfinite` before `clip_by_global_norm` (a NaN leaf
would make the norm NaN and every clipped leaf NaN), and the monitor first, so that it sees
the gradient the loss gave::

    optax.chain(fg.grad_monitor(), fg.zero_nonfinite(), fg.clip_by_global_norm(1.0),
                optax.adam(1e-3))
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from funcgrad.train.clipping import clip_grads, zero_nonfinite_leaves
from funcgrad.train.monitor import GradMonitor, MonitorState

PyTree = Any


class ClipState(NamedTuple):
    """The record of `clip_by_global_norm`'s last update.

    Attributes:
      grad_norm: shape (), float32 (float64 for float64 gradients): the global norm of the
        gradient it received, before clipping (nan before the first update).
      clip_coef: shape (), the same dtype: the factor every leaf was multiplied by,
        ``min(1, max_norm / grad_norm)`` (1 when not clipped; nan before the first update).
      max_norm: shape (), the same dtype: the transformation's `max_norm` (a constant).
    """
    grad_norm: jax.Array
    clip_coef: jax.Array
    max_norm: jax.Array


class ZeroNonfiniteState(NamedTuple):
    """The record of `zero_nonfinite`'s last update.

    Attributes:
      nonfinite_leaves: shape (), int32: how many gradient leaves held a NaN or inf and were
        replaced by zeros (0 before the first update).
    """
    nonfinite_leaves: jax.Array


def _norm_dtype(params: PyTree) -> Any:
    """The dtype `funcgrad.global_norm` gives for gradients like `params` (at least float32)."""
    dtypes = [jnp.result_type(x) for x in jax.tree.leaves(params)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.result_type(jnp.float32, *dtypes) if dtypes else jnp.float32


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Clips the gradient to global norm `max_norm` and records the pre-clip norm.

    The scaling of ``optax.clip_by_global_norm`` and PyTorch's ``clip_grad_norm_`` (article A
    §3.4, B §4.3; Pascanu et al. 2013, arXiv:1211.5063): a gradient of global norm
    ``n > max_norm`` is multiplied by ``max_norm / n``, which keeps its direction; otherwise it
    is unchanged. One scalar times every leaf (PyTorch's form; optax divides each element by
    n: equal up to rounding), which XLA fuses into the optimizer that follows.

    Args:
      max_norm: the largest global norm allowed, a finite number > 0, in the units of the
        gradient.
    Returns:
      an optax ``GradientTransformation`` whose state is a `ClipState` (the norm it received
      and the coefficient it applied, from the last update).
    Raises:
      ValueError: if `max_norm` is not a finite number > 0.
    Example:
      >>> tx = optax.chain(fg.clip_by_global_norm(1.0), optax.adam(1e-3))
      >>> step = fg.make_train_step(loss_fn, tx)   # metrics["grad_norm"], ["clip_coef"]
    """
    if not (isinstance(max_norm, (int, float, np.number)) and not isinstance(max_norm, bool)
            and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"clip_by_global_norm: max_norm must be a finite number > 0 (units "
                         f"of the gradient), got {max_norm!r}.")

    def init(params: PyTree) -> ClipState:
        dtype = _norm_dtype(params)
        nan = jnp.full((), jnp.nan, dtype)
        return ClipState(nan, nan, jnp.asarray(max_norm, dtype))

    def update(updates: PyTree, state: ClipState, params: PyTree = None
               ) -> tuple[PyTree, ClipState]:
        del params
        clipped, info = clip_grads(updates, max_norm)
        dtype = state.grad_norm.dtype
        return clipped, ClipState(info.grad_norm.astype(dtype), info.clip_coef.astype(dtype),
                                  state.max_norm)

    return optax.GradientTransformation(init, update)


def zero_nonfinite() -> optax.GradientTransformation:
    """Replaces every gradient leaf that holds a NaN or inf by zeros, and counts them.

    For a model where a rare leaf's gradient overflows and the rest should still train
    (PyTorch users write ``torch.nan_to_num_`` on each ``.grad``). A `funcgrad.TrainStep`
    whose optimizer has it no longer skips a step for its non-finite gradient (the leaves
    are zeroed), and still skips one whose loss or new params are not finite. Not with a
    dynamic loss scale (`funcgrad.mixed_precision`): an overflowed scaled gradient must be
    skipped whole, and the step refuses the pair.

    Returns:
      an optax ``GradientTransformation`` whose state is a `ZeroNonfiniteState` (the leaves
      zeroed at the last update).
    Example:
      >>> tx = optax.chain(fg.zero_nonfinite(), optax.sgd(0.1))
      >>> step = fg.make_train_step(loss_fn, tx)   # metrics["nonfinite_leaves"]
    """
    def init(params: PyTree) -> ZeroNonfiniteState:
        del params
        return ZeroNonfiniteState(jnp.zeros((), jnp.int32))

    def update(updates: PyTree, state: ZeroNonfiniteState, params: PyTree = None
               ) -> tuple[PyTree, ZeroNonfiniteState]:
        del state, params
        kept, count = zero_nonfinite_leaves(updates)
        return kept, ZeroNonfiniteState(count)

    return optax.GradientTransformation(init, update)


class MonitorTransformation(optax.GradientTransformationExtraArgs):
    """What `grad_monitor` returns: an optax transformation (``init``, ``update``) that passes
    the updates through unchanged and measures them into its `funcgrad.MonitorState`; its
    ``monitor`` attribute is the `funcgrad.GradMonitor` with the settings."""
    monitor: GradMonitor


def grad_monitor(*, warmup: int = 10, explode_factor: float = 10.0, vanish_floor: float = 1e-6,
                 vanish_steps: int = 10, dead_relu: bool = True,
                 dead_threshold: float = 0.9, vanish_ratio: float = 0.01
                 ) -> MonitorTransformation:
    """The gradient monitor as a transformation for the optimizer's ``optax.chain``.

    Each update measures the gradient it receives (global norm, per-leaf norm, mean and
    standard deviation, per-layer norm; the settings and flags are `funcgrad.GradMonitor`'s,
    where they are documented with their sources) into a `funcgrad.MonitorState` and passes
    the gradient on unchanged. A `funcgrad.TrainStep` gives the step's loss as optax's
    ``value`` extra argument, adds the dead ReLU units of its loss when `dead_relu` (not under
    `funcgrad.mixed_precision` or `funcgrad.accumulate`, which differentiate their own
    wrappers of the loss: there ``MonitorMetrics.dead_relu_note`` says so) and reports
    ``metrics["monitor"]``, a `funcgrad.MonitorMetrics`; `funcgrad.monitor_alerts` turns it into
    readable alerts and `funcgrad.fit` prints them. The state is kept on a skipped step
    (its non-finite norm is the alert).

    Args: as `funcgrad.GradMonitor`.
    Returns:
      a `MonitorTransformation`; put it first in the chain to see the gradient the loss gave.
    Raises:
      ValueError: a setting out of range (the message names it).
    Example:
      >>> tx = optax.chain(fg.grad_monitor(warmup=5), optax.adam(1e-3))
      >>> step = fg.make_train_step(loss_fn, tx)
      >>> state, metrics = step(step.init(params), batch)
      >>> for alert in fg.monitor_alerts(metrics["monitor"]): print(alert)
    """
    monitor = GradMonitor(warmup, explode_factor, vanish_floor, vanish_steps, dead_relu,
                          dead_threshold, vanish_ratio)

    def init(params: PyTree) -> MonitorState:
        return monitor.init(params)

    def update(updates: PyTree, state: MonitorState, params: PyTree = None, *,
               value: Any = None, **extra_args: Any) -> tuple[PyTree, MonitorState]:
        del params, extra_args
        floating = jax.tree.map(
            lambda g: g if jnp.issubdtype(jnp.result_type(g), jnp.inexact)
            else jnp.zeros(jnp.shape(g), jnp.float32), updates)
        new_state, _ = monitor.measure(state, floating, loss=value)
        return updates, new_state

    out = MonitorTransformation(init, update)
    out.monitor = monitor
    return out


#: The states that `recorded` reads.
RECORD_TYPES = (ClipState, ZeroNonfiniteState, MonitorState)


def records(opt_state: PyTree) -> list[Any]:
    """The `ClipState`, `ZeroNonfiniteState` and `funcgrad.MonitorState` nodes of an
    optimizer state, in ``jax.tree.leaves`` order (works on abstract states too)."""
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, RECORD_TYPES))
    return [n for n in nodes if isinstance(n, RECORD_TYPES)]


@functools.lru_cache(maxsize=64)
def _records_cached(optimizer: Any) -> tuple | None:
    try:
        state = jax.eval_shape(optimizer.init, {"w": jax.ShapeDtypeStruct((1,), jnp.float32)})
    except Exception:  # noqa: BLE001 - a chain that needs the real params (fg.train_only)
        return None
    return tuple(records(state))


def records_of_optimizer(optimizer: Any) -> tuple | None:
    """The records `optimizer`'s state would hold (`records` of its abstract state for a
    one-leaf params, cached per optimizer), or None where that state cannot be made (a
    `funcgrad.train_only` whose mask needs the real params) or the optimizer is unhashable.
    What a step knows of its chain before it sees params."""
    try:
        return _records_cached(optimizer)
    except TypeError:  # an optimizer that cannot be hashed
        return None


def recorded(opt_state: PyTree) -> dict[str, Any]:
    """The records of an optimizer state, as a train step's metrics.

    Args:
      opt_state: the state of an optimizer whose chain holds `clip_by_global_norm`,
        `zero_nonfinite` or `grad_monitor` (any depth of ``optax.chain``, ``optax.partition``).
    Returns:
      a dict with "grad_norm", "clip_coef" and "max_norm" (the first `ClipState`),
      "nonfinite_leaves"
      (the first `ZeroNonfiniteState`) and "monitor_state" (the first `funcgrad.MonitorState`)
      for those present; shapes () except the monitor state.
    Example:
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> fg.recorded(opt_state)["clip_coef"]
    """
    out: dict[str, Any] = {}
    for node in records(opt_state):
        if isinstance(node, ClipState) and "clip_coef" not in out:
            out.update(grad_norm=node.grad_norm, clip_coef=node.clip_coef,
                       max_norm=node.max_norm)
        elif isinstance(node, ZeroNonfiniteState) and "nonfinite_leaves" not in out:
            out["nonfinite_leaves"] = node.nonfinite_leaves
        elif isinstance(node, MonitorState) and "monitor_state" not in out:
            out["monitor_state"] = node
    return out


def check_records(found: Sequence[Any], loss_scale: Any) -> None:
    """ValueError for the pair of pieces that cannot work: `zero_nonfinite` in the chain of a
    step whose loss has a loss scale (`found`: `records` of the optimizer's state)."""
    if loss_scale is not None and any(isinstance(r, ZeroNonfiniteState) for r in found):
        raise ValueError(
            "make_train_step: the optimizer's chain has funcgrad.zero_nonfinite() and the loss "
            "has funcgrad.mixed_precision's loss scale: a step whose scaled gradient "
            "overflowed must be skipped whole (and the scale lowered), not applied with its "
            "non-finite leaves zeroed. Take zero_nonfinite() out of the chain: the step skips "
            "such updates by itself.")


def keep_records(new: PyTree, old: PyTree, ok: jax.Array) -> PyTree:
    """``where(ok, new, old)`` over an optimizer state, except its records (`records`), which
    keep their new value: a skipped step still counts in the monitor (its non-finite norm is
    the alert) and its clipping and zeroing are reported."""
    is_record = lambda x: isinstance(x, RECORD_TYPES)
    return jax.tree.map(lambda n, o: n if is_record(n) else jax.tree.map(
        lambda a, b: jnp.where(ok, a, b), n, o), new, old, is_leaf=is_record)
