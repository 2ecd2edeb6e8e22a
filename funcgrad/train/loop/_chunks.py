"""Many train steps per dispatch: `fit`'s device-speed path (issue 15).

A train step from `funcgrad.make_train_step` is a pure function ``(state, batch) -> (state,
metrics)``. Dispatching it once per batch from Python costs more than the step itself on a
small model (about 80% of `fit`'s time on the digits MLP at batch 32). Here one jitted call
runs a whole chunk of steps in a ``lax.while_loop`` and returns every step's metrics stacked,
so the host reads them once per chunk:

* `ChunkRunner.gathered`: the data lives on the device; step i of the chunk takes the rows
  ``order[(start + i) * size : (start + i + 1) * size]`` of every leaf (``size`` = batch size,
  times K with accumulation: K micro-batches of one update); the order is a permutation drawn
  on the device in the same call (`funcgrad.train.batching.device_order`; ``range(n)`` for
  a `funcgrad.Batches` without shuffle), and the epoch's last, smaller batch (or partial
  group) is one more step of the last chunk: one dispatch per epoch.
* `ChunkRunner.epochs`: several whole epochs in one call (an outer ``lax.scan`` over
  `gathered`'s epoch), when nothing on the host needs an epoch's numbers before the next.
* `ChunkRunner.stacked`: the batches come from a loader, stacked on the host into
  ``(T, batch, ...)`` and sent in one transfer.

Nothing non-finite is applied, and the first bad step is found exactly: a step that the train
step's own guard skipped for a non-finite loss, gradient or update (not a routine loss-scale
overflow, which backs the scale off and goes on) *halts* the chunk: the loop ends after it,
with the state from before it (the guard left params, optimizer and model state untouched;
the step counter, loss scale and monitor state are put back), and the host reads which step
it was from the count of steps run. With ``skip_bad`` the chunk goes on instead. A
``while_loop`` rather than a ``scan``: a halted or short chunk computes nothing more, and no
select over the whole state is needed per step (on a 1.1M-parameter MLP that select cost 20%).

The state is donated to each call (its buffers are reused for the new state); `fit` copies the
caller's state once on entry, so no array the caller holds is invalidated.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from funcgrad.train.batching import device_order, split_for_accumulation
from funcgrad.train.transforms import recorded

PyTree = Any


class ChunkRunner:
    """Runs chunks of a train step under ``lax.scan`` (see the module docstring).

    Args:
      step: the un-jitted train step (``make_train_step(...).unjitted``, or ``.unguarded``).
      accumulate: K of an accumulating step (its batches are ``(K, batch, ...)``), or None.
      skip_bad: go on past a non-finite step instead of halting.
      unguarded: `step` is ``make_train_step(...).unguarded``: it applies even a non-finite
        update, so the chunk keeps (does not donate) its starting state, and a chunk with a
        bad step must be re-run from it with the guarded step.
    A call returns ``(state, count, rows)``: the state after the chunk (before its bad step,
    if one halted it), how many steps ran (the bad one included), and per step, one row of
    each: "bad" (its guard skipped it for a non-finite value), "routine" (a loss-scale
    overflow that backed the scale off), "loss", "grad_norm", and when the step reports them
    "learning_rate", "loss_scale" (the scale used) and "scale_after"; with a monitor,
    "monitor_values" and "monitor_dead" (`funcgrad.train.monitor.MonitorMetrics` fields).
    Rows from `count` on are zeros.
    """

    def __init__(self, step: Callable, *, accumulate: int | None, skip_bad: bool,
                 unguarded: bool = False, mesh: Any = None, data_axis: str = "data",
                 state_shardings: Callable | None = None):
        self.step, self.accumulate, self.skip_bad = step, accumulate, skip_bad
        self.unguarded = unguarded
        # A data-parallel step's mesh: each batch's rows are split over `data_axis` (each
        # device gathers its own rows from the replicated dataset), the state and the rows
        # read back stay replicated (`funcgrad.train.loop.placement`).
        self.mesh, self.data_axis = mesh, data_axis
        # ZeRO-1 (shard_opt_state=True): where the step keeps its state (the optimizer state
        # split over the data axis); None: replicated.
        self.state_shardings = state_shardings
        self.monitor_layout = None  # set while tracing a monitored step
        # A guarded chunk donates the state it starts from; an unguarded one keeps it (fit
        # re-runs the chunk from it, guarded, when a step was bad).
        self._donate = () if unguarded else 0
        self._programs: dict[tuple, Callable] = {}
        self.stacked = jax.jit(self._stacked, donate_argnums=self._donate)

    def gathered(self, state, data, key, epoch, start, count, *, length, size, tail,
                 batch_size):
        """The chunk of `count` steps from step `start` of `epoch` (see the module
        docstring). One jitted program per static shape, called with positional arguments
        only (static keyword arguments take jit's slow path: 0.4 ms a call, not 0.1)."""
        shape = (length, size, tail, batch_size)
        program = self._programs.get(shape)
        if program is None:
            program = self._programs[shape] = jax.jit(
                functools.partial(self._gathered, length=length, size=size, tail=tail,
                                  batch_size=batch_size), donate_argnums=self._donate)
        return program(state, data, key, epoch, start, count)

    def epochs(self, state, data, key, first, count, *, most, length, size, tail,
               batch_size):
        """`count` whole epochs (at most `most`) from epoch `first` (0-based) in one call:
        each as `gathered` runs it from its step 0 (its order, its `length` full steps, its
        `tail`), in an outer loop. One program for every `count` (`most` is static): it
        returns ``(state, counts, rows)``, counts ``(most,)`` int32 and each row ``(most,
        length + (tail > 0), ...)``, of which the first `count` epochs are filled (zeros
        after). Unguarded runners only: nothing halts, and a bad step anywhere makes the
        caller run these epochs again one by one."""
        assert self.unguarded, "several epochs per call: unguarded chunks only"
        shape = ("epochs", most, length, size, tail, batch_size)
        program = self._programs.get(shape)
        if program is None:
            program = self._programs[shape] = jax.jit(
                functools.partial(self._epochs, most=most, length=length, size=size,
                                  tail=tail, batch_size=batch_size))
        return program(state, data, key, first, count)

    # --- placement over a mesh (a data-parallel step) ------------------------------------
    def _replicated(self, tree):
        """`tree` constrained to be replicated over the mesh (no-op without one)."""
        if self.mesh is None:
            return tree
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, P()))

    def _placed(self, state, *rest):
        """The state where the step keeps it (replicated, or its optimizer state split under
        ZeRO-1) and `rest` (counts, rows) replicated: ``(state, *rest)``."""
        if self.state_shardings is None:
            return self._replicated((state, *rest))
        state = jax.lax.with_sharding_constraint(state, self.state_shardings(state))
        return (state, *self._replicated(rest))

    def _split_rows(self, batch):
        """A batch with its rows (axis 0; axis 1 of stacked micro-batches and their mask)
        split over the mesh's data axis. Rows that do not divide among the devices (an
        epoch's last, smaller batch) stay replicated: the same numbers, computed on every
        device."""
        if self.mesh is None:
            return batch
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        size = int(self.mesh.shape[self.data_axis])
        row_axis = 0 if self.accumulate is None else 1

        def split(leaf):
            if leaf.ndim <= row_axis or leaf.shape[row_axis] % size:
                return leaf
            spec = P(*([None] * row_axis), self.data_axis)
            return jax.lax.with_sharding_constraint(leaf, NamedSharding(self.mesh, spec))
        return jax.tree.map(split, batch)

    # --- one step inside the loop --------------------------------------------------------
    def _compute(self, state, batch):
        """One step and its metrics in the chunks' layout (see the class docstring)."""
        new_state, metrics = self.step(state, self._split_rows(batch))
        (new_state,) = self._placed(new_state)
        if self.accumulate is not None:  # one update: its metrics without the update axis
            metrics = {k: jax.tree.map(lambda a: a[0], v) for k, v in metrics.items()
                       if k not in ("aux", "examples", "dropped_examples")}
        loss, norm = metrics["loss"], metrics["grad_norm"]
        skipped = metrics.get("skipped", ~(jnp.isfinite(loss) & jnp.isfinite(norm)))
        skipped = jnp.asarray(skipped).astype(bool)
        out = {"loss": loss, "grad_norm": norm}
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
            out["monitor_values"] = (recorded(new_state.opt_state)["monitor_state"].values
                                     if m.values is None else m.values)
            out["monitor_dead"] = tuple(m.dead)
            # The flags the host would derive (global and per layer), and each ReLU site's dead
            # fraction, computed here: the host reads them instead of a dozen NumPy calls a
            # chunk (about 5% of a batch-32 epoch).
            watched = m.__class__(out["monitor_values"], m.dead, m.layout)
            out["monitor_flag"] = alert_flag(watched)
            out["monitor_dead_fraction"] = watched.dead_fraction
        out.update(bad=skipped & ~routine, routine=routine)
        return new_state, out

    def _loop(self, state, batch_at, count, length, tail=None):
        """Steps i = 0 .. count - 1 on ``batch_at(i)``, stopping after a bad one (unless
        skip_bad): a ``lax.while_loop`` that writes each step's metrics into its row of
        preallocated arrays (`length` rows, one more with a `tail`), so a halted or short
        chunk computes nothing more. `tail`, a batch of another shape (an epoch's last, smaller
        one), is one more step after the loop unless it halted, its row the next one."""
        if self.unguarded:
            # No halting: the state after a bad step is garbage anyway (fit re-runs the chunk
            # guarded), so a plain scan, which traces the step once and needs no row buffers.
            rows = None
            if batch_at is not None:
                state, rows = jax.lax.scan(lambda st, i: self._compute(st, batch_at(i)),
                                           state, jnp.arange(length, dtype=jnp.int32))
            if tail is not None:
                state, last = self._compute(state, tail)
                last = jax.tree.map(lambda v: v[None], last)
                rows = last if rows is None else jax.tree.map(
                    lambda r, v: jnp.concatenate([r, v]), rows, last)
            return state, jnp.int32(jax.tree.leaves(rows)[0].shape[0]), rows
        first = tail if batch_at is None else batch_at(jnp.int32(0))
        shapes = jax.eval_shape(self._compute, state, first)[1]
        rows = jax.tree.map(lambda s: jnp.zeros((length + (tail is not None), *s.shape),
                                                s.dtype), shapes)

        def step(i, state, halted, rows, batch):
            new_state, out = self._compute(state, batch)
            if not self.skip_bad:
                # A bad step was skipped by the step's own guard (params, optimizer and model
                # state untouched); the counters it moved go back too: the state from before.
                halted = out["bad"]
                keep = lambda old, new: jax.tree.map(
                    lambda o, n: jnp.where(halted, o, n), old, new)
                new_state = new_state._replace(
                    step=keep(state.step, new_state.step),
                    loss_scale=keep(state.loss_scale, new_state.loss_scale),
                    # the chain's records (the monitor) that the step's guard kept
                    opt_state=keep(state.opt_state, new_state.opt_state))
            rows = jax.tree.map(lambda r, v: r.at[i].set(v), rows, out)
            return i + 1, new_state, halted, rows

        carry = (jnp.int32(0), state, jnp.zeros((), bool), rows)
        if batch_at is not None:  # None: fewer examples than one step takes, the tail alone
            carry = jax.lax.while_loop(lambda c: (c[0] < count) & ~c[2],
                                       lambda c: step(*c, batch_at(c[0])), carry)
        i, state, halted, rows = carry
        if tail is not None:
            def tail_step(c):
                i, state, halted, rows = c
                return step(i, state, halted, rows, tail)

            i, state, halted, rows = jax.lax.cond(
                halted, lambda c: c, tail_step, (i, state, halted, rows))
        return state, i, rows

    def _batch_of(self, data, idx):
        batch = jax.tree.map(lambda leaf: jnp.take(leaf, idx, axis=0), data)
        return batch if self.accumulate is None else split_for_accumulation(batch,
                                                                            self.accumulate)

    def _tail_of(self, data, idx, batch_size):
        """The epoch's last rows as one batch, or (accumulating) as the padded micro-batches
        of a partial group with the mask of their real rows."""
        batch = jax.tree.map(lambda leaf: jnp.take(leaf, idx, axis=0), data)
        if self.accumulate is None:
            return batch
        from funcgrad.train.microbatches import Microbatches
        r = idx.shape[0]
        m = -(-r // batch_size)
        pad = m * batch_size - r
        stacked = jax.tree.map(
            lambda leaf: jnp.concatenate([leaf, jnp.zeros((pad, *leaf.shape[1:]), leaf.dtype)])
            .reshape(m, batch_size, *leaf.shape[1:]), batch)
        mask = (jnp.arange(m * batch_size) < r).reshape(m, batch_size)
        return Microbatches(stacked, mask)

    def _gathered(self, state, data, key, epoch, start, count, *, length, size, tail,
                  batch_size):
        n = jax.tree.leaves(data)[0].shape[0]
        # No key: the examples in order (fg.Batches(..., shuffle=False)).
        order = jnp.arange(n, dtype=jnp.int32) if key is None else device_order(key, epoch, n)

        def batch_at(i):
            return self._batch_of(data, jax.lax.dynamic_slice(order, ((start + i) * size,),
                                                              (size,)))
        # The tail follows the chunk's full steps (rows after it, fg.Batches(...,
        # drop_last=True)'s last partial batch, are not visited).
        last = (self._tail_of(data, jax.lax.dynamic_slice(order, ((start + count) * size,),
                                                          (tail,)), batch_size)
                if tail else None)
        return self._placed(*self._loop(state, batch_at if size <= n else None, count,
                                        length, last))

    def _epochs(self, state, data, key, first, count, *, most, length, size, tail,
                batch_size):
        def one(state, e):
            return self._gathered(state, data, key, first + e, jnp.int32(0), jnp.int32(length),
                                  length=length, size=size, tail=tail, batch_size=batch_size)
        _, ran, rows = jax.eval_shape(one, state, jnp.int32(0))
        buffers = jax.tree.map(lambda s: jnp.zeros((most, *s.shape), s.dtype), (ran, rows))

        def body(e, carry):
            state, buffers = carry
            state, ran, rows = one(state, e)
            return state, jax.tree.map(lambda b, v: b.at[e].set(v), buffers, (ran, rows))
        state, (counts, rows) = jax.lax.fori_loop(0, count, body, (state, buffers))
        return self._placed(state, counts, rows)

    def _stacked(self, state, batches):
        length = jax.tree.leaves(batches)[0].shape[0]
        return self._placed(*self._loop(
            state, lambda i: jax.tree.map(lambda leaf: leaf[i], batches), jnp.int32(length),
            length))


def alert_flag(m) -> Any:
    """Whether a step's `MonitorMetrics` raises a global or per-layer alert (nonfinite,
    explosion, vanishing); NumPy or jax.numpy as its values are. Dead-ReLU alerts depend on the
    step before and are found by `fit` from the dead fractions."""
    flag = m.nonfinite | m.explosion
    return flag | m.vanishing.any(-1) if len(m.layout.layer_names) else flag
