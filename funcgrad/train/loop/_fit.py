"""`fit`: the training loop around a train step, with a progress bar, a history and a guard.

`fit` drives a step from `funcgrad.train.step.make_train_step` over a dataset for some epochs. It
records per-step losses and gradient norms, per-epoch rows and the gradient monitor's alerts in
a `History`. When a step's loss or gradient norm is NaN/inf it stops with a `NonFiniteReport`
and returns the last state whose params are finite: nothing is silently corrupted.

This module holds the run's outline (its arguments, the epochs, evaluation, checkpoints,
Ctrl-C and crashes); the epochs themselves run in `funcgrad.train.loop._epochs`.
"""
from __future__ import annotations

import functools
import os
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np

from funcgrad._library_objects import check_params
from funcgrad.train.batching import as_source
from funcgrad.train.loop import resume as _resume
from funcgrad.train.loop._checks import as_step, check_accumulation, check_callables
from funcgrad.train.loop._epochs import _Run
from funcgrad.train.loop.evaluate import evaluated, evaluator_of
from funcgrad.train.loop.history import FitResult, History, epoch_row, format_epoch
from funcgrad.train.loop.options import (
    MOVED_KEYWORDS,
    Checkpointing,
    FitOptions,
    Progress,
    as_progress,
)
from funcgrad.train.loop.placement import mesh_of, place_state
from funcgrad.train.state import TrainState

PyTree = Any

#: The former keyword whose entry in MOVED_KEYWORDS shows each value's use.
_EXAMPLE = {"checkpoint": "checkpoint_dir", "options": "chunk"}


def _refusing_moved_keywords(fit_fn: Callable) -> Callable:
    """`fit_fn` (with its signature, as `inspect.signature` shows it), refusing fit's former
    arguments by name, each with the value that holds it now (`MOVED_KEYWORDS`)."""

    @functools.wraps(fit_fn)
    def fit(*args: Any, **kwargs: Any) -> FitResult:
        if len(args) > 3:
            raise TypeError("fit: takes step, state and data positionally; y is no longer an "
                            f"argument: {MOVED_KEYWORDS['y']}.")
        moved = [name for name in kwargs if name in MOVED_KEYWORDS]
        if moved:
            raise TypeError(f"fit: {moved[0]}= is no longer a keyword; "
                            f"{MOVED_KEYWORDS[moved[0]]}.")
        return fit_fn(*args, **kwargs)
    return fit


@_refusing_moved_keywords
def fit(step: Callable, state: TrainState, data: Any, *, epochs: int, evaluate: Any = None,
        checkpoint: Checkpointing | None = None,
        progress: bool | Callable[[str], None] | Progress | None = True,
        options: FitOptions | None = None) -> FitResult:
    """Trains for `epochs` passes over `data`, at device speed where it can, keeping every
    result: a non-finite step is never applied, Ctrl-C returns what was done.

    **Data.** A `funcgrad.Batches`: arrays with a leading example axis, in any pytree, and how
    to batch them (``fg.Batches({"image": (n, 8, 8), "label": (n,)}, batch_size=32, seed=0)``
    calls ``step(state, batch)`` with batches of the same structure; ``fg.Batches(x, y,
    batch_size=32)`` gives batches ``{"x": ..., "y": ...}``). Or a *loader*: any iterable of
    batch pytrees (a list of batches, a generator, a grain or torch ``DataLoader`` yielding
    NumPy arrays), or a function ``epoch -> iterable`` (epoch 0-based); each batch is passed
    to the step as it comes. A pytree of arrays alone is refused (how to batch it is the
    user's choice: the error shows `Batches`); a list is a sequence of batches.

    **Several processes.** With a data-parallel step (``funcgrad.data_parallel(step, mesh)``) in
    a run of P processes (``jax.distributed``), a `Batches` holds the whole dataset on every
    process (replicated; each batch's rows are split over the mesh's data axis inside the
    chunk), and a loader yields each process's **own rows**: process p's t-th batch holds the
    rows of the global batch t that its devices hold, ``(B / P, ...)`` per leaf
    (`funcgrad.process_rows`), and the global batch of step t is every process's t-th batch
    in process order, ``(B, ...)`` (with accumulation, the same for each micro-batch).
    Before each chunk the processes compare how many batches they hold, their structure,
    shapes and dtypes and whether their epoch ends there (one small all-gather), and raise
    the same ValueError on every process when they differ, before any collective of the step
    could wait for a batch that never comes; the chunk's global arrays are then built with
    ``jax.make_array_from_process_local_data``, one transfer per leaf. In one process a
    loader's batches are the global batches.

    **Speed.** With a `Batches` and a step from `funcgrad.make_train_step` (jitted), the data
    is put on the device once, each epoch's order is drawn there (`Batches.order` gives the
    same order on the host), and one jitted call runs ``FitOptions.chunk`` steps inside
    ``lax.scan`` (default: all the full batches of an epoch, at most 1,024), reading the
    per-step loss, norm and monitor values back once per chunk. The epoch's last, smaller
    batch (or partial group with accumulation) is one more step of the same call: one
    dispatch per epoch. When nothing on the host needs an epoch's numbers before the next
    (no `evaluate`, no progress bar, no checkpoint due, the default `FitOptions`, no loss
    scale), several epochs run in one call (up to 1,024 steps), with the same history, log
    lines, alerts and state (bit for bit on the digits MLP; the several-epoch program is
    compiled apart, and XLA may fuse a model differently there: a linen CNN with BatchNorm
    differed by 7e-8, float32 rounding); their lines come out together once the last of
    them is recorded. A loader's batches are stacked ``chunk`` at a time (default 64) and
    sent in one transfer when their shapes agree. Everything the step does runs inside the
    chunk: clipping, the guard, accumulation, loss scaling, the monitor, masks, model state,
    keys. A hand-written step, or one made with ``jit=False``, is called once per batch.

    **Non-finite steps.** A step whose loss, gradient norm or update is NaN/inf (the step's
    guard skipped it) stops the chunk at that step: later steps of the chunk are not applied,
    and fit returns the state from before it with a `NonFiniteReport` naming the step, the
    epoch, the batch and (a `Batches`) its example indices, and a ``RuntimeWarning`` with the
    same text. A routine loss-scale overflow (the scale backs off) is counted in
    ``History.skipped_steps`` and training goes on. ``FitOptions(on_nonfinite="skip")`` goes
    on past non-finite batches too. A step made with ``nonfinite="raise"`` raises
    ``FloatingPointError`` instead.

    **Numbering.** Epochs count from 1 in everything fit shows or records (log lines, the
    progress bar, ``History.epochs[i]["epoch"]``, `NonFiniteReport`, metrics.json); steps and
    batches are 0-based indices (step k is the one applied when ``TrainState.step == k``).

    **Ctrl-C.** The first SIGINT stops the run after the current chunk (all the epochs of a
    call that ran several) and returns a `FitResult` with ``interrupted=True`` (a second one
    interrupts at once).

    Args:
      step: a step from `make_train_step` (or any ``(state, batch) -> (TrainState,
        metrics)`` whose metrics hold "loss" and "grad_norm").
      state: the starting `TrainState` (not modified: fit works on a copy).
      data: a `funcgrad.Batches` or a loader (see Data).
      epochs: number of passes, a positive int (the total, counting resumed epochs).
      evaluate: ``evaluate(params) -> {name: number}`` (``evaluate(params, model_state)``
        for a state with a model state), called once per epoch and stored as ``"eval/<name>"``;
        or an evaluation split, a pytree of arrays like the training data (or a `Batches`,
        for its batch size): its mean loss under the step's loss function is stored as
        ``"eval/loss"``.
      checkpoint: a `funcgrad.Checkpointing` (where, how often, resume), or None.
      progress: what the run shows (`funcgrad.Progress`): True, a progress bar; False or
        None, nothing; a function of one string (e.g. `print`), each epoch's line and the
        first monitor alerts; ``fg.Progress(print, bar=True)``, both.
      options: a `funcgrad.FitOptions` (what to do at a non-finite step, steps per dispatch,
        optimistic chunks), or None for the defaults.
    Returns:
      a `FitResult`.
    Raises:
      TypeError: a former argument (``y``, ``batch_size``, ``seed``, ``checkpoint_dir``,
        ``every``, ``resume``, ``log``, ``on_nonfinite``, ``chunk``, ``optimistic``): the
        message names the value that holds it now; `step`, `evaluate`, `progress`,
        `checkpoint` or `options` of the wrong kind; the first call of `step` returning
        something other than ``(TrainState, metrics)`` with "loss" and "grad_norm".
      ValueError: a non-positive `epochs`; a pytree of arrays without a `Batches`; empty
        data; a loader batch whose structure or row counts differ from the first (named); an
        iterator (used up after one pass) with more than one epoch; an accumulating step with
        ``tail="drop"`` that would drop every group; a resumed run whose batching differs
        from the checkpointed one's; with a data-parallel step on several processes, loaders
        that disagree across the processes (batches per epoch, structure, shapes, dtypes: on
        every process, naming each process's batches and the fix), or a global batch (P times
        a loader's rows) that does not divide among the mesh's devices.
      FloatingPointError: at a non-finite step, when `step` was made with ``nonfinite="raise"``.
      Exception: any exception of the step, the loader or `evaluate` propagates with the run
        so far as its ``fit_result`` attribute (a `FitResult`), after a checkpoint of the last
        state when `checkpoint` is given.
    Warns:
      UserWarning: when an accumulating step's group is larger than the data.
    Example:
      >>> step = fg.make_train_step(loss_fn, optax.adam(1e-3))
      >>> result = fg.fit(step, step.init(params), fg.Batches(x, y, batch_size=32),
      ...                 epochs=10, progress=print)
      >>> len(result.history.epochs)
      10
    """
    from tqdm.auto import tqdm

    if not isinstance(epochs, (int, np.integer)) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"fit: epochs must be a positive int, got {epochs!r}.")
    for name, value, kind in (("checkpoint", checkpoint, Checkpointing),
                              ("options", options, FitOptions)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"fit: {name} must be a funcgrad.{kind.__name__} (or None), got "
                            f"{type(value).__name__}; e.g. {MOVED_KEYWORDS[_EXAMPLE[name]]}.")
    shown = as_progress(progress)
    log, bar_on = shown.lines, shown.bar
    options = options or FitOptions()
    on_nonfinite, chunk = options.on_nonfinite, options.chunk
    directory = None if checkpoint is None else os.fspath(checkpoint.directory)
    check_callables(step, evaluate if callable(evaluate) or evaluate is None
                    or isinstance(evaluate, str) else None)
    if not isinstance(state, TrainState):
        check_params("fit", state)  # an equinox / nnx object given as the state: the fix
        raise TypeError(f"fit: state must be a TrainState, from step.init(params), got "
                        f"{type(state).__name__}.")
    check_params("fit", state.params)  # an equinox / nnx object: the fix to train it
    source = as_source(data, where="fit", epochs=epochs)
    batches = source.batches
    step = as_step(step)  # a TrainStep's fields, or a hand-written step's defaults
    accumulate = step.accumulate or 1
    if batches is not None:
        check_accumulation(batches.used, batches.batch_size, accumulate, step.tail)
    evaluator = evaluator_of(evaluate, step, source.batch_size)
    raw = step.unjitted
    chunked = raw is not None and chunk != 1
    history = History()
    start_epoch, start_in_epoch, run_step, epoch_first = 1, 0, 0, 0
    # What decides which examples the rest of an epoch visits: a resumed run must match them.
    settings: dict[str, Any] = (
        {"batch_size": None, "examples": None, "accumulate": accumulate} if batches is None else
        {"seed": batches.seed, "batch_size": batches.batch_size, "examples": batches.n,
         "accumulate": accumulate, "shuffle": batches.shuffle, "drop_last": batches.drop_last})
    if checkpoint is not None and checkpoint.resume:
        restored = _resume.restore(directory, state)
        if restored is not None:
            state, history, position = restored
            _resume.check_resumed(position, settings, directory)
            start_epoch = position["epoch"] + 1
            start_in_epoch, run_step = position["step_in_epoch"], position["run_step"]
            epoch_first = position.get("epoch_first", len(history.step_loss))
            if start_in_epoch == 0:
                epoch_first = len(history.step_loss)

    def epochs_per_dispatch(epoch: int) -> int:
        # Epochs from `epoch` on whose numbers nothing on the host needs before the last of
        # them: no evaluation, no progress bar to move, no checkpoint due.
        if bar_on or evaluator is not None:
            return 1
        if checkpoint is not None:
            return checkpoint.every - (epoch - 1) % checkpoint.every
        return epochs - epoch + 1

    run = _Run(step=step, raw=raw, source=source, history=history, log=log,
               accumulate=accumulate, chunk=chunk, skip_bad=on_nonfinite == "skip",
               chunked=chunked, optimistic=options.optimistic, epochs=epochs,
               epochs_per_dispatch=epochs_per_dispatch)
    total = epochs * source.steps_per_epoch(accumulate) if batches is not None else None
    bar = tqdm(total=total, disable=not bar_on, unit="step", leave=False)
    run.bar = bar
    run.write = lambda line: _say(log, tqdm, line)
    # A data-parallel step's state is replicated over its mesh (checked equal across
    # processes), its optimizer state split under ZeRO-1 (the step's own place_state).
    run.state, run.run_step = place_state(state, mesh_of(step), step=step), run_step
    position = {"epoch": start_epoch - 1, "step_in_epoch": start_in_epoch, "run_step": run_step,
                "epoch_first": epoch_first, **settings}
    bar.update(run_step if total is not None else 0)
    stopper = _InterruptFlag()
    report, interrupted = None, False
    try:
        with stopper:
            for epoch in range(start_epoch, epochs + 1):  # numbered from 1 wherever shown
                if stopper.raised and not run.holds(epoch):  # Ctrl-C during the evaluation
                    interrupted = True                             # or the checkpoint
                    break
                first_skip = len(history.skipped_steps)
                skip_in_epoch = start_in_epoch if epoch == start_epoch else 0
                if skip_in_epoch == 0:
                    epoch_first = len(history.step_loss)
                position.update(epoch=epoch - 1, step_in_epoch=skip_in_epoch,
                                epoch_first=epoch_first)
                report = run.epoch(epoch, skip_in_epoch, stopper, position)
                if report is not None or (stopper.raised and not run.epoch_done):
                    interrupted = stopper.raised and report is None
                    break
                row = epoch_row(history, epoch, run.run_step, epoch_first, first_skip,
                                 run.state)
                if evaluator is not None:
                    row.update(evaluated(evaluator(run.state)))
                history.epochs.append(row)
                run.verify()
                run.say(format_epoch(row))
                run.epoch_ended(epoch)
                position.update(epoch=epoch, step_in_epoch=0, run_step=run.run_step,
                                epoch_first=len(history.step_loss))
                if directory is not None and (epoch % cast(Checkpointing, checkpoint).every == 0
                                              or epoch == epochs):
                    _resume.save(directory, run.state, position, history)
    except (Exception, KeyboardInterrupt) as error:
        # A crash (or a second Ctrl-C) (an exception in the step, the loader or evaluate, XLA out of
        # memory) keeps what was done: the result so far rides on the exception, and the last state
        # is checkpointed when it is still alive (a chunk that failed may have consumed it).
        cast(Any, error).fit_result = FitResult(run.state, history, None, False)
        alive = not any(getattr(leaf, "is_deleted", lambda: False)()
                        for leaf in jax.tree.leaves(run.state))
        if directory is not None and alive and jax.process_count() > 1:
            # Orbax's save waits for every process, and the others may not have failed (an
            # error in one process's loader or evaluation): it would hang them all. The
            # last periodic checkpoint is what is kept; the process exits and its launcher
            # stops the others (funcgrad.distributed_init's exit_on_error).
            error.add_note(f"funcgrad.fit: in a run of {jax.process_count()} processes the "
                           "state at the error is not checkpointed (the save waits for every "
                           "process, and the others may still be training); the last "
                           f"checkpoint in {directory} is kept.")
        elif directory is not None and alive:
            try:
                _resume.save(directory, run.state, position, history)
                error.add_note(f"funcgrad.fit: the last state (step {int(run.state.step)}) "
                               f"is checkpointed in {directory}.")
            except Exception:  # pragma: no cover - the original error matters more
                pass
        raise
    finally:
        bar.close()
    if (report is not None or interrupted) and directory is not None:
        _resume.save(directory, run.state, position, history)
    if report is not None:
        if step.nonfinite == "raise":
            raise FloatingPointError(str(report))
        warnings.warn(str(report), RuntimeWarning, stacklevel=3)  # fit's caller: past the
                                                                  # moved-keyword wrapper
    if interrupted and log is not None:
        log(f"interrupted: stopped after step {run.run_step}; the state and history so far are "
            "kept" + (f" (checkpointed in {directory})" if directory else ""))
    return FitResult(run.state, history, report, interrupted)




class _InterruptFlag:
    """A SIGINT handler for the run: the first Ctrl-C sets `raised` (the run stops after the
    current chunk, keeping its results); the second raises KeyboardInterrupt at once. Only in
    the main thread (elsewhere signals cannot be caught: Ctrl-C behaves as usual)."""

    def __init__(self):
        self.raised, self._previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            try:
                self._previous = signal.signal(signal.SIGINT, self._handle)
            except ValueError:  # pragma: no cover - e.g. an embedded interpreter
                self._previous = None
        return self

    def _handle(self, signum, frame):
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _say(log, tqdm, line: str) -> None:
    if log is not None:
        with tqdm.external_write_mode():  # keeps the bar intact around the log line
            log(line)
