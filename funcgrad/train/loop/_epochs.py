"""The epochs of a `fit` run: array data in chunks of steps on the device (one dispatch per
epoch, or several epochs per dispatch when the host needs nothing in between; one call per
batch for a step fit cannot run in chunks), a loader's batches stacked per transfer, and the
optimistic scheme that runs a chunk without the guard's selects first and again, guarded,
only when one of its steps was bad.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.train.batching import split_for_accumulation, take_rows
from funcgrad.train.loop._checks import called
from funcgrad.train.loop._chunks import ChunkRunner
from funcgrad.train.loop._dispatches import LOADER_CHUNK, MAX_CHUNK, Dispatches, base_key
from funcgrad.train.loop._record import Recorder, fetched, host_row, with_ran
from funcgrad.train.loop.history import NonFiniteReport
from funcgrad.train.loop.placement import (
    global_batches,
    local_batches_agree,
    mesh_of,
    owned_copy,
    per_process_loader,
    place_data,
    place_state,
    stack_batches,
)
from funcgrad.train.microbatches import Microbatches, group_microbatches, stack_microbatches
from funcgrad.train.state import TrainState

#: What an accumulating step's loader batches become in an error's words.
GROUPS = ("group of micro-batches", "groups of micro-batches")


class _Run(Recorder, Dispatches):
    """One `fit` run's loop state: the current train state, step count, history, and how to
    run an epoch (chunks of steps on the device, or one call per batch)."""

    def __init__(self, *, step, raw, source, history, log, accumulate, chunk, skip_bad,
                 chunked, optimistic, epochs, epochs_per_dispatch=None):
        self.step, self.source, self.history, self.log = step, source, history, log
        self.accumulate, self.chunk, self.skip_bad = accumulate, chunk, skip_bad
        self.runner = _runner(step, raw, skip_bad) if chunked else None
        # Unguarded chunks first (no per-step selects), re-run guarded when one had a bad step.
        unguarded = step.unguarded
        self.fast = (_runner(step, unguarded, skip_bad, unguarded=True)
                     if chunked and optimistic and not skip_bad and unguarded is not None
                     else None)
        mesh = mesh_of(step) if chunked else None
        self.data = (place_data(source.tree, mesh) if chunked and source.tree is not None
                     else None)
        # The order's base key, on the device once (replicated over a data-parallel mesh);
        # None: the examples in order (a Batches without shuffle), or a loader.
        batches = source.batches
        self.key = (place_state(base_key(batches.seed), mesh, check=False)
                    if batches is not None and batches.shuffle else None)
        # A loader on several processes: each yields its own rows of every global batch.
        self.step_mesh = mesh_of(step)
        self.per_process = per_process_loader(source, self.step_mesh)
        self.data_axis = step.data_axis or "data"
        self.first_call, self.previous_report = True, None
        self.owned = False  # whether self.state's buffers are fit's own (may be donated)
        self.epochs = epochs
        # Several epochs per dispatch: fit says how many it can leave unobserved from an
        # epoch on (no evaluation, no checkpoint due, no progress bar before their last).
        self._init_dispatches(epochs_per_dispatch)
        # Set by fit before the first epoch: the TrainState, its tqdm bar and its log writer.
        self.state: Any = None
        self.verified: Any = None
        self.run_step = 0
        self.bar: Any = None
        self.write: Any = None

    # --- epochs -------------------------------------------------------------------------
    def epoch(self, epoch: int, skip: int, stopper, position) -> NonFiniteReport | None:
        """Runs the rest of `epoch` from step `skip`; returns the report of a non-finite stop
        (else None). ``self.epoch_done`` says whether the epoch ran to its end (a Ctrl-C can
        stop it earlier)."""
        self.epoch_done = False
        if self.verified is None:
            self.verified = self.state
        if self.source.tree is not None:
            return self._array_epoch(epoch, skip, stopper, position)
        return self._loader_epoch(epoch, skip, stopper, position)

    def _array_epoch(self, epoch, skip, stopper, position):
        batches, k = self.source.batches, self.accumulate
        n, b = batches.used, batches.batch_size  # the examples an epoch visits (drop_last)
        size = b * k
        full, tail = n // size, n % size
        host_order = None

        def order():  # the host's copy of the epoch's order: for reports and calls
            nonlocal host_order
            if host_order is None:
                host_order = batches.order(epoch - 1)
            return host_order

        def call_of(rows_):
            batch = take_rows(self.source.tree, rows_)
            if k == 1:
                return (batch,)
            if len(rows_) == size:
                return (split_for_accumulation(batch, k),)
            micro = [take_rows(batch, np.arange(j, min(j + b, len(rows_))))
                     for j in range(0, len(rows_), b)]
            return (stack_microbatches(micro, size=b),)

        done = skip
        if self.runner is not None:
            dropped = 0
            if k > 1 and tail and self.step.tail == "drop":
                tail, dropped = 0, tail  # a partial group is dropped, not run
            length = self.chunk or max(1, min(full, MAX_CHUNK))
            shape = (full, size, tail, b)
            got = self._from_group(epoch, shape, stopper) if done == 0 else None
            if got is not None:  # this epoch ran in a dispatch of several
                def whole(i):
                    return self._locate(order, call_of, i, 0, full, shape, k)
                report, done = self._record(with_ran(got), full + (1 if tail else 0), epoch,
                                            whole)
                position.update(step_in_epoch=done, run_step=self.run_step)
                self.history.dropped_examples += dropped
                self.epoch_done = True
                return report
            while done < full or (done == full and tail):
                active = min(length, full - done)
                last_tail = tail if done + active == full else 0
                def call(runner, state, done=done, active=active, last_tail=last_tail):
                    # An unguarded chunk is a scan of exactly `active` steps; a guarded one a
                    # loop of up to `length` (one program for every chunk of the run).
                    return runner.gathered(
                        state, self.data, self.key, np.int32(epoch - 1), np.int32(done),
                        np.int32(active), length=active if runner.unguarded else length,
                        size=size, tail=last_tail, batch_size=b)
                launched = self._ahead_for(epoch, done, ("chunk", active, last_tail))
                self.state, got = _chunk(self.fast, self.runner, call, self.state, self.owned,
                                         launched)
                self.owned = True  # a chunk's output: fit's own buffers
                start = done
                if (self.fast is not None and done + active == full and not stopper.raised
                        and not np.asarray(got[1]["bad"]).any()):
                    self._launch_ahead(epoch + 1, shape, length)

                def locate(i, start=start, active=active):
                    return self._locate(order, call_of, i, start, active, shape, k)

                report, steps = self._record(with_ran(got), active + (1 if last_tail else 0),
                                             epoch, locate)
                done += steps
                position.update(step_in_epoch=done, run_step=self.run_step)
                if done == full and report is None:
                    self.history.dropped_examples += dropped
                if report is not None or stopper.raised or last_tail:
                    self.epoch_done = report is None and bool(last_tail or done >= full)
                    return report
            self.epoch_done = True
            return None
        # One call per step (a step that is not jitted or not made by make_train_step).
        while done * size < n:
            rows_ = order()[done * size:min((done + 1) * size, n)]
            args = call_of(rows_)
            taken = (len(args[0].mask) if isinstance(args[0], Microbatches) else k) if k > 1 else 1
            report = self._call(args, epoch, done * k, taken, tuple(int(r) for r in rows_))
            done += 1
            position.update(step_in_epoch=done, run_step=self.run_step)
            if report is not None or stopper.raised:
                self.epoch_done = report is None and done * size >= n
                return report
        self.epoch_done = True
        return None

    def _locate(self, order, call_of, i, start, active, shape, k):
        """Step `i` of a chunk of `active` full steps from step `start` (the tail after
        them): its first batch index, how many batches it took, its example rows and the
        call that ran it."""
        full, size, tail, b = shape
        if i < active:
            rows_ = order()[(start + i) * size:(start + i + 1) * size]
            return (start + i) * k, k, tuple(int(r) for r in rows_), call_of(rows_)
        rows_ = order()[full * size:full * size + tail]
        return full * k, -(-len(rows_) // b), tuple(int(r) for r in rows_), call_of(rows_)

    def _loader_epoch(self, epoch, skip, stopper, position):
        k = self.accumulate
        batches = _counted(self.source.iterate(epoch - 1))
        for _ in range(skip * k):  # resumed mid-epoch: the batches already trained on
            next(batches, None)
        done = skip

        def finished():
            if batches.count == 0:
                raise ValueError(
                    f"fit: the loader yielded no batches in epoch {epoch}; fit needs at least "
                    "one batch per epoch (a generator made for one epoch is used up after it: "
                    "pass a function epoch -> iterable of batches).")
            self.epoch_done = True
            return None

        if k > 1:
            groups = group_microbatches(batches, k)
            if self.per_process:  # every process's groups, checked to agree one by one
                groups = self._global_groups(groups, epoch, lambda: done)
            for group in groups:
                report = self._call((group,), epoch, done * k, len(group.mask), None)
                done += 1
                position.update(step_in_epoch=done, run_step=self.run_step)
                if report is not None or stopper.raised:
                    return report
            return finished()
        length = self.chunk or LOADER_CHUNK
        pending: list = []

        def flush(last=False, following=None):
            nonlocal done
            if self.per_process:  # before any collective: do the processes agree?
                local_batches_agree(pending, last, epoch=epoch, step=done, following=following)
            if not pending:
                return None
            if self.runner is None or len(pending) == 1:
                batch = (global_batches(pending[0], self.step_mesh, self.data_axis, row_axis=0)
                         if self.per_process else pending[0])
                report = self._call((batch,), epoch, done, 1, None)
                steps = 0 if report is not None else 1
            else:
                stacked = stack_batches(pending)
                if self.per_process:  # (T, b, ...) of every process: (T, P * b, ...)
                    stacked = global_batches(stacked, self.step_mesh, self.data_axis,
                                             row_axis=1)
                    calls = None
                else:
                    calls = list(pending)
                call = lambda runner, state: runner.stacked(state, stacked)
                self.state, got = _chunk(self.fast, self.runner, call, self.state, self.owned)
                self.owned = True
                start = done

                def locate(i, start=start, calls=calls, stacked=stacked):
                    batch = (calls[i] if calls is not None  # a global batch: indexed here
                             else jax.tree.map(lambda a: a[i], stacked))
                    return start + i, 1, None, (batch,)
                report, steps = self._record(with_ran(got), len(pending), epoch, locate)
            done += steps if report is None else steps
            pending.clear()
            position.update(step_in_epoch=done, run_step=self.run_step)
            return report

        shape_of = ((lambda b: jax.tree.map(lambda a: (np.shape(a), np.result_type(a)), b))
                    if self.per_process else lambda b: jax.tree.map(np.shape, b))
        for batch in batches:
            changed = bool(pending) and shape_of(batch) != shape_of(pending[0])
            if changed or len(pending) >= length:
                report = flush(following=batch if changed else None)
                if report is not None or stopper.raised:
                    return report
            pending.append(batch)
        report = flush(last=True)
        return report if report is not None else finished()

    def _global_groups(self, groups, epoch, done):
        """A loader's groups of micro-batches on several processes: before each, the
        processes check that they agree (as many groups, of one layout, the epoch ending at
        the same one: `local_batches_agree`); each as the global group of every process's
        micro-batches, their rows (axis 1) in process order."""
        it = iter(groups)
        following = next(it, None)
        while True:
            group = following
            following = None if group is None else next(it, None)
            local_batches_agree([] if group is None else [group], following is None,
                                epoch=epoch, step=done(), what=GROUPS)
            if group is None:
                return
            yield global_batches(group, self.step_mesh, self.data_axis, row_axis=1)

    # --- one call of the step (tails, loaders with accumulation, hand-written steps) ------
    def _call(self, call, epoch, batch_index, batches, examples):
        old = self.state
        new_state, metrics = called(self.step, old, call, first=self.first_call)
        self.first_call = False
        if self.accumulate > 1:  # one group per call: metrics of 1 update, or 0 if dropped
            self.history.dropped_examples += int(metrics.pop("dropped_examples"))
            metrics.pop("examples")
            if metrics["loss"].shape[0] == 0:
                self.state = new_state
                self.bar.update(1)
                return None
            metrics = {k: v if k == "anomaly" else jax.tree.map(lambda a: a[0], v)
                       for k, v in metrics.items()}
        ys = host_row(metrics, new_state)
        bad = bool(ys["bad"][0])
        if not bad or self.skip_bad:
            self.state = new_state
        locate = lambda i: (batch_index, batches, examples, call)
        report, _ = self._record(ys, 1, epoch, locate, anomaly=metrics.get("anomaly"))
        if report is not None and not _all_finite(self.state.params):
            # The step before applied an update that overflowed the params although its own
            # loss and gradient were finite (a step without the guard): back to the last
            # epoch end whose params were finite.
            self.state = self.verified
        return report

    def verify(self) -> None:
        """At an epoch's end: remember the state if its params are finite (a step without
        `make_train_step`'s guard may have applied an overflowing update)."""
        if self.runner is None and _all_finite(self.state.params):
            self.verified = self.state


def _runner(step: Any, raw: Callable, skip_bad: bool,
            unguarded: bool = False) -> ChunkRunner:
    """The step's `ChunkRunner`, kept on the step so that later fits reuse its compiled
    chunks."""
    runners = step.__dict__.setdefault("_fit_runners", {})
    if (skip_bad, unguarded) not in runners:
        runners[skip_bad, unguarded] = ChunkRunner(
            raw, accumulate=step.accumulate, skip_bad=skip_bad,
            unguarded=unguarded, mesh=mesh_of(step),
            data_axis=step.data_axis or "data",
            state_shardings=step.state_shardings if step.shard_opt_state else None)
    return runners[skip_bad, unguarded]


def _chunk(fast: ChunkRunner | None, guarded: ChunkRunner, run: Callable, state: TrainState,
           owned: bool, launched=None):
    """``run(runner, state) -> (state, count, rows)`` unguarded first when `fast` is given
    (or the result of that call, `launched` ahead of time); when a step of it was bad, again
    from the same starting state with the guarded runner (which stops there, with the state
    from before it). `owned`: whether `state`'s buffers are fit's own (see `_Run.owned`).
    Returns the host's (count, rows) too."""
    if fast is not None:
        new_state, ran, rows_ = fast_call = launched if launched is not None else run(fast,
                                                                                      state)
        got = fetched(ran, rows_)
        if not np.asarray(got[1]["bad"])[:int(got[0])].any():
            return new_state, got
        del fast_call, new_state  # garbage: a non-finite update was applied
    if not owned:  # the guarded chunk donates its state: never the caller's arrays
        state = owned_copy(state)
    new_state, ran, rows_ = run(guarded, state)
    return new_state, fetched(ran, rows_)


class _counted:
    """An iterator that counts what it yields (`count`)."""

    def __init__(self, iterable):
        self._it, self.count = iter(iterable), 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self.count += 1
        return item


@jax.jit
def _all_finite_device(params):
    return jnp.all(jnp.array([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))


def _all_finite(params) -> bool:
    return bool(_all_finite_device(params)) if jax.tree.leaves(params) else True
