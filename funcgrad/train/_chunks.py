"""Many train steps per dispatch: `fit`'s device-speed path (issue 15).

A train step from `funcgrad.make_train_step` is a pure function ``(state, batch) -> (state,
metrics)``. Dispatching it once per batch from Python costs more than the step itself on a
small model (about 80% of `fit`'s time on the digits MLP at batch 32). Here one jitted call
runs a whole chunk of steps inside ``lax.scan`` and returns every step's metrics stacked, so
the host reads them once per chunk:

* `run_gathered`: the data lives on the device; step i of the chunk takes the rows
  ``order[(start + i) * size : (start + i + 1) * size]`` of every leaf (``size`` = batch size,
  times K with accumulation: K micro-batches of one update); the order is a permutation drawn
  on the device (`epoch_order`).
* `run_stacked`: the batches come from a loader, stacked on the host into ``(T, batch, ...)``
  and sent in one transfer.

Nothing non-finite is applied, and the first bad step is found exactly: a step that the train
step's own guard skipped for a non-finite loss, gradient or update (not a routine loss-scale
overflow, which backs the scale off and goes on) *halts* the chunk. The carry then keeps the
state from before that step and every later step of the chunk leaves it as it is; the host
reads which step it was from the stacked ``bad`` flags. With ``skip_bad`` the chunk goes on
instead: the step's guard already left params and optimizer state untouched.

The state is donated to each call (its buffers are reused for the new state); `fit` copies the
caller's state once on entry, so no array the caller holds is invalidated.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def epoch_order(seed: int, epoch: int, n: int) -> jax.Array:
    """The example order of one epoch: a permutation of ``range(n)``, int32, drawn on the
    default device from ``fold_in(key(seed), epoch)`` (threefry: the same on every backend).
    `funcgrad.train.data.batches` yields the same order from the host."""
    return _order(jax.random.fold_in(jax.random.key(seed), epoch), n)


@functools.partial(jax.jit, static_argnums=1)
def _order(key: jax.Array, n: int) -> jax.Array:
    return jax.random.permutation(key, n).astype(jnp.int32)


class ChunkRunner:
    """Runs chunks of a train step under ``lax.scan`` (see the module docstring).

    Args:
      step: the un-jitted train step (``make_train_step(...).unjitted``).
      accumulate: K of an accumulating step (its batches are ``(K, batch, ...)``), or None.
      skip_bad: go on past a non-finite step instead of halting.
    The stacked metrics of a call (NumPy after `jax.device_get`) have, per step of the chunk:
    "ran" (the step was computed from a live state: before any halt and inside the chunk),
    "bad" (its guard skipped it for a non-finite value), "routine" (a loss-scale overflow that
    backed the scale off), "loss", "grad_norm", "skipped", and when the step reports them
    "learning_rate", "loss_scale" (the scale used) and "scale_after"; with a monitor,
    "monitor_values" and "monitor_dead" (`funcgrad.train.monitor.MonitorMetrics` fields).
    """

    def __init__(self, step: Callable, *, accumulate: int | None, skip_bad: bool):
        self.step, self.accumulate, self.skip_bad = step, accumulate, skip_bad
        self.monitor_layout = None  # set while tracing a monitored step
        self.gathered = jax.jit(self._gathered, static_argnames=("length", "size"),
                                donate_argnums=0)
        self.stacked = jax.jit(self._stacked, donate_argnums=0)

    # --- one step inside the scan -----------------------------------------------------
    def _one(self, state, batch, active, halted):
        if self.accumulate is not None:
            new_state, metrics = self.step(state, batch)
            metrics = {k: v for k, v in metrics.items()
                       if k not in ("examples", "dropped_examples")}
            metrics = {k: jax.tree.map(lambda a: a[0], v) for k, v in metrics.items()
                       if k != "aux"}
        else:
            new_state, metrics = self.step(state, batch)
        loss, norm = metrics["loss"], metrics["grad_norm"]
        skipped = metrics.get("skipped", ~(jnp.isfinite(loss) & jnp.isfinite(norm)))
        skipped = jnp.asarray(skipped).astype(bool)
        out = {"loss": loss, "grad_norm": norm, "skipped": skipped.astype(jnp.int32)}
        routine = jnp.zeros((), bool)
        if getattr(new_state, "loss_scale", None) is not None and "loss_scale" in metrics:
            used, after = metrics["loss_scale"], new_state.loss_scale.scale
            routine = skipped & jnp.isfinite(loss) & (after < used)
            out["loss_scale"], out["scale_after"] = used, after
        if "learning_rate" in metrics:
            out["learning_rate"] = metrics["learning_rate"]
        if "monitor" in metrics:
            m = metrics["monitor"]
            self.monitor_layout = m.layout
            out["monitor_values"] = (new_state.monitor.values if m.values is None
                                     else m.values)
            out["monitor_dead"] = tuple(m.dead)
        ran = active & ~halted
        bad = ran & skipped & ~routine
        if self.skip_bad:
            keep_old = ~ran
            halted_after = halted
        else:
            keep_old = ~ran | bad
            halted_after = halted | bad
        state = jax.tree.map(lambda old, new: jnp.where(keep_old, old, new), state, new_state)
        out.update(ran=ran, bad=bad, routine=ran & routine)
        return state, halted_after, out

    def _batch_of(self, data, idx):
        batch = jax.tree.map(lambda leaf: jnp.take(leaf, idx, axis=0), data)
        if self.accumulate is None:
            return batch
        k = self.accumulate
        return jax.tree.map(lambda leaf: leaf.reshape(k, leaf.shape[0] // k, *leaf.shape[1:]),
                            batch)

    def _gathered(self, state, data, order, start, active_steps, halted, *, length, size):
        def body(carry, i):
            state, halted = carry
            idx = jax.lax.dynamic_slice(order, ((start + i) * size,), (size,))
            state, halted, out = self._one(state, self._batch_of(data, idx),
                                           i < active_steps, halted)
            return (state, halted), out

        (state, halted), ys = jax.lax.scan(body, (state, halted),
                                           jnp.arange(length, dtype=jnp.int32))
        return state, halted, ys

    def _stacked(self, state, batches, halted):
        def body(carry, batch):
            state, halted = carry
            state, halted, out = self._one(state, batch, jnp.ones((), bool), halted)
            return (state, halted), out

        (state, halted), ys = jax.lax.scan(body, (state, halted), batches)
        return state, halted, ys


def owned_copy(tree: PyTree) -> PyTree:
    """A copy of every array leaf (on its own device), so that donating it leaves the
    caller's arrays valid."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a,
                        tree)


def to_device(data: PyTree) -> PyTree:
    """The dataset's leaves as device arrays (one transfer each)."""
    return jax.tree.map(lambda a: jax.device_put(np.asarray(a) if not isinstance(a, jax.Array)
                                                 else a), data)
