"""`fit`: the training loop around a train step, with a progress bar, a history and a guard.

`fit` drives a step from `funcgrad.train.step.make_train_step` over a dataset for some epochs. It
records per-step losses and gradient norms, per-epoch rows and the gradient monitor's alerts in
a `History`. When a step's loss or gradient norm is NaN/inf it stops with a `NonFiniteReport`
and returns the last state whose params are finite: nothing is silently corrupted.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._library_objects import check_params
from funcgrad.train._chunks import ChunkRunner, alert_flag, epoch_order, owned_copy, to_device
from funcgrad.train.data import rows
from funcgrad.train.microbatches import Microbatches, group_microbatches, stack_microbatches
from funcgrad.train.monitor import UNKNOWN_AXIS_NOTE, MonitorMetrics, monitor_alerts
from funcgrad.train.sources import as_source, split_for_accumulation, take_rows
from funcgrad.train.step import TrainState

PyTree = Any


class NonFiniteReport(NamedTuple):
    """Where a training run met a non-finite loss or global gradient norm.

    Attributes:
      step: index of the offending step (0-based, counted over the whole run, like
        ``TrainState.step``: the number of steps applied before it).
      epoch: epoch of that step, numbered from 1 as in `fit`'s log lines, rows and progress
        bar (its batch order is ``funcgrad.train.data.batches(..., epoch=epoch - 1)``).
      batch: index of the (first) batch of that step within its epoch (0-based); a step made
        with ``accumulate=K`` takes batches ``batch .. batch + batches - 1``.
      loss: the loss of that step (a Python float; may be nan or inf).
      grad_norm: the pre-clip global gradient norm of that step (may be nan or inf).
      anomaly: with a step made with ``detect_anomaly=True``, the `funcgrad.debug.anomaly.
        AnomalyReport` of that step's params and batch (primitive, pass and source line of
        the first non-finite value; with accumulation its context names the micro-batch);
        None otherwise.
      batches: how many batches the step took (1, or up to K with accumulation).
      update: when the loss and the norm are finite but the optimizer's update or the new
        params were not (the step's guard skipped it), which leaves and how to fix it (from
        the step's ``explain_skipped_update``); "" otherwise.
      examples: with array data, the indices (rows of the dataset) of that step's examples,
        in batch order; None for a loader's batch.
    """
    step: int
    epoch: int
    batch: int
    loss: float
    grad_norm: float
    anomaly: Any = None
    batches: int = 1
    update: str = ""
    examples: tuple[int, ...] | None = None

    def __str__(self) -> str:
        where = (f"batch {self.batch}" if self.batches == 1 else
                 f"batches {self.batch}-{self.batch + self.batches - 1}, accumulated")
        these = 'that batch' if self.batches == 1 else 'those batches'
        if self.update:
            hint = self.update
        elif not math.isfinite(self.loss) and math.isfinite(self.grad_norm):
            # The gradient is fine, so no update blew up: the loss itself made the NaN/inf.
            hint = (f"The gradient norm is finite, so the loss itself is not: check the "
                    f"targets and inputs of {these} (e.g. a label outside [0, classes) in "
                    "softmax_cross_entropy) rather than the learning rate.")
        else:
            hint = f"Try a lower learning rate, clip_norm, or check the inputs of {these}."
        rows = ""
        if self.examples is not None:
            rows = (f"; its examples (rows of the data): "
                    f"{', '.join(map(str, self.examples[:8]))}"
                    + (f", ... ({len(self.examples)} in all)" if len(self.examples) > 8 else ""))
        text = (f"non-finite value at step {self.step} (epoch {self.epoch}, {where}): "
                f"loss={self.loss}, grad_norm={self.grad_norm}{rows}. Training stopped; the "
                "returned state is the last one with finite loss and gradients (this step was not "
                f"applied). {hint}")
        return text if self.anomaly is None else f"{text}\n{self.anomaly}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for metrics.json): the fields, with the anomaly report as a dict."""
        return self._asdict() | {"anomaly": None if self.anomaly is None
                                 else self.anomaly.to_dict(),
                                 "examples": None if self.examples is None
                                 else [int(i) for i in self.examples]}


@dataclasses.dataclass
class History:
    """What `fit` recorded: one row per epoch and the loss and gradient norm of every step.

    Attributes:
      epochs: list of dicts ``{"epoch", "steps", "loss", "grad_norm", "eval/<name>", ...}``:
        "epoch" numbers the epoch from 1, "steps" counts the steps applied so far, "loss" and
        "grad_norm" are means over the epoch's applied steps, and each number ``name`` that
        ``evaluate(params)`` returned is stored as ``"eval/<name>"`` (`EVAL_PREFIX`), so an
        evaluation "loss" is ``"eval/loss"`` and never replaces the training loss.
      step_loss, step_grad_norm: per-step values (Python floats) of the applied steps.
      step_learning_rate: per applied step, the learning rate its update used, when the step
        reports one (``metrics["learning_rate"]``: an optimizer from `make_optimizer` with a
        schedule, or built with ``optax.inject_hyperparams``); empty otherwise. Each epoch's
        row then has "learning_rate", the rate of its last update. A schedule counts optimizer
        updates: with ``accumulate=K`` one per K batches, and a skipped step does not count.
      skipped_steps: run-wide indices (0-based, every batch counted) of the steps a loss scale
        skipped; each epoch's row then also has "skipped" and "loss_scale".
      dropped_examples: examples left out by an accumulating step's ``tail="drop"`` policy.
      layer_names, step_layer_norm: with a monitored step (``make_train_step(monitor=)``),
        the layers (``params[0]``, ...) and, per applied step, each layer's gradient norm.
      alerts: the monitor's `funcgrad.train.monitor.Alert`s, in step order.
      skipped_batches: with ``fit(..., on_nonfinite="skip")``, one dict per non-finite step
        that was skipped and trained past: "step", "epoch", "batch", "loss", "grad_norm",
        "examples" (the rows of array data, else None).
    """
    epochs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    step_loss: list[float] = dataclasses.field(default_factory=list)
    step_grad_norm: list[float] = dataclasses.field(default_factory=list)
    step_learning_rate: list[float] = dataclasses.field(default_factory=list)
    skipped_steps: list[int] = dataclasses.field(default_factory=list)
    dropped_examples: int = 0
    layer_names: tuple[str, ...] = ()
    step_layer_norm: list[list[float]] = dataclasses.field(default_factory=list)
    alerts: list = dataclasses.field(default_factory=list)
    skipped_batches: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        steps = {"step": list(range(len(self.step_loss))), "loss": self.step_loss,
                 "grad_norm": self.step_grad_norm}
        if self.step_learning_rate:
            steps["learning_rate"] = self.step_learning_rate
        if self.layer_names:
            steps["layer_norm"] = {name: [row[j] for row in self.step_layer_norm]
                                   for j, name in enumerate(self.layer_names)}
        return {"epochs": self.epochs, "steps": steps,
                "skipped_steps": self.skipped_steps, "dropped_examples": self.dropped_examples,
                "skipped_batches": self.skipped_batches,
                "alerts": [dataclasses.asdict(a) | {"text": str(a)} for a in self.alerts]}

    def _state(self) -> dict[str, Any]:
        """Everything, as JSON-able data, for a checkpoint (`_from_state` reads it back)."""
        return {f.name: ([dataclasses.asdict(a) for a in self.alerts] if f.name == "alerts"
                         else list(self.layer_names) if f.name == "layer_names"
                         else getattr(self, f.name))
                for f in dataclasses.fields(self)}

    @classmethod
    def _from_state(cls, data: Mapping[str, Any]) -> History:
        from funcgrad.train.monitor import Alert
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["alerts"] = [Alert(**a) for a in kwargs.get("alerts", [])]
        kwargs["layer_names"] = tuple(kwargs.get("layer_names", ()))
        return cls(**kwargs)


class FitResult(NamedTuple):
    """What `fit` returns: the final (last finite) state, the history, and why it stopped early.

    Attributes:
      state: the `TrainState` after the last applied step.
      history: the `History` of the run.
      nonfinite: a `NonFiniteReport` if training stopped on a non-finite value, else None.
      interrupted: True when Ctrl-C (SIGINT) stopped the run: `state` and `history` are
        those of the last completed chunk of steps (and were checkpointed with
        ``checkpoint_dir``).
    """
    state: TrainState
    history: History
    nonfinite: NonFiniteReport | None
    interrupted: bool = False


#: How many monitor alerts `fit` passes to its `log`; all are kept in `History.alerts`.
MAX_LOGGED_ALERTS = 20


def fit(step: Callable, state: TrainState, data: Any, y: PyTree = None, *, epochs: int,
        batch_size: int | None = None, seed: int = 0, evaluate: Any = None,
        progress: bool = True, log: Callable[[str], None] | None = None,
        chunk: int | None = None, on_nonfinite: str = "stop",
        checkpoint_dir: str | os.PathLike | None = None, every: int = 1,
        resume: bool = False, optimistic: bool = True) -> FitResult:
    """Trains for `epochs` passes over `data`, at device speed where it can, keeping every
    result: a non-finite step is never applied, Ctrl-C returns what was done.

    **Data.** Either arrays with a leading example axis, in any pytree: ``fit(step, state,
    {"image": (n, 8, 8), "label": (n,)}, epochs=, batch_size=)`` calls ``step(state, batch)``
    with batches of the same structure; ``fit(step, state, x, y, ...)`` is the same with
    ``data = {"x": x, "y": y}``. Or a *loader*: any iterable of batch pytrees (a list of
    batches, a generator, a grain or torch ``DataLoader`` yielding NumPy arrays), or a function
    ``epoch -> iterable`` (epoch 0-based); each batch is passed to the step as it comes.
    A dict, tuple or array is a dataset; a list is a sequence of batches.

    **Speed.** With array data and a step from `funcgrad.make_train_step` (jitted), the data
    is put on the device once, each epoch's order is drawn there (`funcgrad.train._chunks.
    epoch_order`; `funcgrad.train.data.batches` yields the same order on the host), and one
    jitted call runs `chunk` steps inside ``lax.scan`` (default: all the full batches of an
    epoch, at most 1,024), reading the per-step loss, norm and monitor values back once per
    chunk. A loader's batches are stacked `chunk` at a time (default 64) and sent in one
    transfer when their shapes agree. The epoch's last, smaller batch (or partial group with
    accumulation) runs as one more call. Everything the step does runs inside the chunk:
    clipping, the guard, accumulation, loss scaling, the monitor, masks, model state, keys.
    A hand-written step, or one made with ``jit=False``, is called once per batch.

    **Non-finite steps.** A step whose loss, gradient norm or update is NaN/inf (the step's
    guard skipped it) stops the chunk at that step: later steps of the chunk are not applied,
    and fit returns the state from before it with a `NonFiniteReport` naming the step, the
    epoch, the batch and (array data) its example indices, and a ``RuntimeWarning`` with the
    same text. A routine loss-scale overflow (the scale backs off) is counted in
    ``History.skipped_steps`` and training goes on. ``on_nonfinite="skip"`` goes on past
    non-finite batches too, recording each in ``History.skipped_batches`` (the step's guard
    left params and optimizer state untouched). A step made with ``nonfinite="raise"``
    raises ``FloatingPointError`` instead.

    **Numbering.** Epochs count from 1 in everything fit shows or records (log lines, the
    progress bar, ``History.epochs[i]["epoch"]``, `NonFiniteReport`, metrics.json); steps and
    batches are 0-based indices (step k is the one applied when ``TrainState.step == k``).

    **Checkpoints.** With `checkpoint_dir`, the whole state (params, optimizer state, model
    state, key, loss scale, monitor state, step) and the run's position and history are saved
    with orbax-checkpoint (`funcgrad.train.checkpoint`) every `every` epochs, when the run
    stops on a non-finite step (the last finite state), on Ctrl-C and at the end. ``resume=
    True`` continues from the newest checkpoint there (its epoch and batch), so training 10
    epochs equals training 5, stopping and resuming for 5 more, bit for bit.

    **Ctrl-C.** The first SIGINT stops the run after the current chunk and returns a
    `FitResult` with ``interrupted=True`` (a second one interrupts at once).

    Args:
      step: a step from `make_train_step` (or any ``(state, batch) -> (TrainState,
        metrics)`` whose metrics hold "loss" and "grad_norm").
      state: the starting `TrainState` (not modified: fit works on a copy).
      data: see Data.
      y: see Data.
      epochs: number of passes, a positive int (the total, counting resumed epochs).
      batch_size: examples per step for array data (the last batch of an epoch may be
        smaller); not used with a loader.
      seed: seed of the example order (array data).
      evaluate: ``evaluate(params) -> {name: number}`` (``evaluate(params, model_state)``
        for a state with a model state), called once per epoch and stored as ``"eval/<name>"``;
        or an evaluation split, a pytree of arrays like the training data: its mean loss under
        the step's loss function is stored as ``"eval/loss"``.
      progress: a tqdm progress bar on stderr.
      log: called with each epoch's summary line (e.g. `print`) and each monitor alert (the
        first `MAX_LOGGED_ALERTS`; all are kept in the history); None for silence.
      chunk: steps per dispatch (see Speed); 1 calls the step once per batch.
      on_nonfinite: "stop" (default) or "skip" (see Non-finite steps).
      checkpoint_dir: see Checkpoints.
      every: see Checkpoints.
      resume: see Checkpoints.
      optimistic: run each chunk first with the step's ``unguarded`` form (the guard's test
        without its per-leaf selects, which wait for the global reductions: 1.2x on a
        1.1M-parameter MLP), keeping the chunk's starting state; a chunk in which a step was
        skipped is run again from that state with the guarded step, so no non-finite update
        is ever applied. Not with a loss scale or ``on_nonfinite="skip"``. False: the guarded
        step only, which donates the state (half the state's memory during a chunk).
    Returns:
      a `FitResult`.
    Raises:
      ValueError: a non-positive `epochs`, `batch_size` or `chunk`; array data without
        `batch_size`; leaves with different numbers of rows (named by their paths); empty
        data; a loader batch whose structure or row counts differ from the first (named); an
        iterator (used up after one pass) with more than one epoch; an accumulating step with
        ``tail="drop"`` that would drop every group; ``resume`` without `checkpoint_dir`.
      FloatingPointError: at a non-finite step, when `step` was made with ``nonfinite="raise"``.
      TypeError: if `step`, `evaluate` or `log` is of the wrong kind, or the first call of
        `step` returns something other than ``(TrainState, metrics)`` with "loss" and
        "grad_norm".
      Exception: any exception of the step, the loader or `evaluate` propagates with the run
        so far as its ``fit_result`` attribute (a `FitResult`), after a checkpoint of the last
        state when `checkpoint_dir` is given.
    Warns:
      UserWarning: when an accumulating step's group is larger than the data.
    """
    from tqdm.auto import tqdm

    if not isinstance(epochs, (int, np.integer)) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"fit: epochs must be a positive int, got {epochs!r}.")
    if on_nonfinite not in ("stop", "skip"):
        raise ValueError(f"fit: on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}.")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer))
                              or chunk < 1):
        raise ValueError(f"fit: chunk must be a positive int (steps per dispatch), got {chunk!r}.")
    if not isinstance(every, (int, np.integer)) or isinstance(every, bool) or every < 1:
        raise ValueError(f"fit: every must be a positive int (epochs between checkpoints), "
                         f"got {every!r}.")
    if resume and checkpoint_dir is None:
        raise ValueError("fit: resume=True needs checkpoint_dir=, the folder to resume from.")
    _check_callables(step, evaluate if callable(evaluate) or evaluate is None
                     or isinstance(evaluate, str) else None, log)
    if not isinstance(state, TrainState):
        check_params("fit", state)  # an equinox / nnx object given as the state: the fix
        raise TypeError(f"fit: state must be a TrainState, from funcgrad.init_train_state("
                        f"params, optimizer), got {type(state).__name__}.")
    check_params("fit", state.params)  # an equinox / nnx object: the fix to train it
    source = as_source(data, y, batch_size=batch_size, epochs=epochs)
    accumulate = getattr(step, "accumulate", None) or 1
    tail_policy = getattr(step, "tail", None)
    if source.n is not None and batch_size is not None:  # array data (batch_size checked)
        _check_accumulation(source.n, batch_size, accumulate, tail_policy)
    evaluator = _evaluator(evaluate, step, batch_size)
    raw = getattr(step, "unjitted", None)
    chunked = raw is not None and chunk != 1
    history = History()
    start_epoch, start_in_epoch, run_step, epoch_first = 1, 0, 0, 0
    # What decides which examples the rest of an epoch visits: a resumed run must match them.
    settings = {"seed": seed, "batch_size": source.batch_size, "examples": source.n,
                "accumulate": accumulate}
    if resume:
        restored = _restore(checkpoint_dir, state)
        if restored is not None:
            state, history, position = restored
            _check_resumed(position, settings, checkpoint_dir)
            start_epoch = position["epoch"] + 1
            start_in_epoch, run_step = position["step_in_epoch"], position["run_step"]
            epoch_first = position.get("epoch_first", len(history.step_loss))
            if start_in_epoch == 0:
                epoch_first = len(history.step_loss)
    run = _Run(step=step, raw=raw, source=source, history=history, log=log,
               accumulate=accumulate, chunk=chunk, skip_bad=on_nonfinite == "skip",
               seed=seed, chunked=chunked, optimistic=optimistic, epochs=epochs)
    total = epochs * source.steps_per_epoch(accumulate) if source.n is not None else None
    bar = tqdm(total=total, disable=not progress, unit="step", leave=False)
    run.bar = bar
    run.say = lambda line: _say(log, tqdm, line)
    run.state, run.run_step = state, run_step
    position = {"epoch": start_epoch - 1, "step_in_epoch": start_in_epoch, "run_step": run_step,
                "epoch_first": epoch_first, **settings}
    bar.update(run_step if total is not None else 0)
    stopper = _InterruptFlag()
    report, interrupted = None, False
    try:
        with stopper:
            for epoch in range(start_epoch, epochs + 1):  # numbered from 1 wherever shown
                if stopper.raised:  # Ctrl-C during the evaluation or the checkpoint
                    interrupted = True
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
                row = _epoch_row(history, epoch, run.run_step, epoch_first, first_skip,
                                 run.state)
                if evaluator is not None:
                    row.update(_evaluated(evaluator(run.state)))
                history.epochs.append(row)
                run.verify()
                run.say(format_epoch(row))
                position.update(epoch=epoch, step_in_epoch=0, run_step=run.run_step,
                                epoch_first=len(history.step_loss))
                if checkpoint_dir is not None and (epoch % every == 0 or epoch == epochs):
                    _save(checkpoint_dir, run.state, position, history)
    except (Exception, KeyboardInterrupt) as error:
        # A crash (or a second Ctrl-C) (an exception in the step, the loader or evaluate, XLA out of
        # memory) keeps what was done: the result so far rides on the exception, and the last state
        # is checkpointed when it is still alive (a chunk that failed may have consumed it).
        cast(Any, error).fit_result = FitResult(run.state, history, None, False)
        alive = not any(getattr(leaf, "is_deleted", lambda: False)()
                        for leaf in jax.tree.leaves(run.state))
        if checkpoint_dir is not None and alive:
            try:
                _save(checkpoint_dir, run.state, position, history)
                error.add_note(f"funcgrad.fit: the last state (step {int(run.state.step)}) "
                               f"is checkpointed in {checkpoint_dir}.")
            except Exception:  # pragma: no cover - the original error matters more
                pass
        raise
    finally:
        bar.close()
    if (report is not None or interrupted) and checkpoint_dir is not None:
        _save(checkpoint_dir, run.state, position, history)
    if report is not None:
        if getattr(step, "nonfinite", None) == "raise":
            raise FloatingPointError(str(report))
        warnings.warn(str(report), RuntimeWarning, stacklevel=2)
    if interrupted and log is not None:
        log(f"interrupted: stopped after step {run.run_step}; the state and history so far are "
            "kept" + (f" (checkpointed in {checkpoint_dir})" if checkpoint_dir else ""))
    return FitResult(run.state, history, report, interrupted)


#: Most steps one chunk runs by default: array data (all the full batches of an epoch, up to
#: this), and a loader's batches stacked per transfer.
MAX_CHUNK, LOADER_CHUNK = 1024, 64


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


class _Run:
    """One `fit` run's loop state: the current train state, step count, history, and how to
    run an epoch (chunks of steps on the device, or one call per batch)."""

    def __init__(self, *, step, raw, source, history, log, accumulate, chunk, skip_bad, seed,
                 chunked, optimistic, epochs):
        self.step, self.source, self.history, self.log = step, source, history, log
        self.accumulate, self.chunk, self.skip_bad, self.seed = accumulate, chunk, skip_bad, seed
        self.runner = _runner(step, raw, skip_bad) if chunked else None
        # Unguarded chunks first (no per-step selects), re-run guarded when one had a bad step.
        unguarded = getattr(step, "unguarded", None)
        self.fast = (_runner(step, unguarded, skip_bad, unguarded=True)
                     if chunked and optimistic and not skip_bad and unguarded is not None
                     else None)
        self.data = (to_device(source.tree) if chunked and source.tree is not None else None)
        self.key = jax.random.key(seed)  # the order's base key, on the device once
        self.first_call, self.previous_report = True, None
        self.owned = False  # whether self.state's buffers are fit's own (may be donated)
        self.ahead = None  # (epoch, step, launched chunk, the state it started from)
        self.epochs = epochs
        # Set by fit before the first epoch: the TrainState, its tqdm bar and its log writer.
        self.state: Any = None
        self.verified: Any = None
        self.run_step = 0
        self.bar: Any = None
        self.say: Any = None

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
        n, k, b = self.source.n, self.accumulate, self.source.batch_size
        size = b * k
        full, tail = n // size, n % size
        host_order = None

        def order():  # the host's copy of the epoch's order: for reports and calls
            nonlocal host_order
            if host_order is None:
                host_order = np.asarray(epoch_order(self.seed, epoch - 1, n))
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
            if k > 1 and tail and getattr(self.step, "tail", None) == "drop":
                tail, dropped = 0, tail  # a partial group is dropped, not run
            length = self.chunk or max(1, min(full, MAX_CHUNK))
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
                ahead, self.ahead = self.ahead, None
                launched = (ahead[2] if ahead is not None and ahead[:2] == (epoch, done)
                            and ahead[3] is self.state else None)
                self.state, got = _chunk(self.fast, self.runner, call, self.state, self.owned,
                                         launched)
                self.owned = True  # a chunk's output: fit's own buffers
                start = done
                if (self.fast is not None and epoch < self.epochs and done + active == full
                        and not stopper.raised and not np.asarray(got[1]["bad"]).any()):
                    # The next epoch's first chunk goes to the device now, from this state
                    # (an unguarded chunk does not consume it): the host's work on this one
                    # (its rows, the evaluation, a checkpoint) overlaps it. Used only if the
                    # next epoch starts from this very state.
                    following = min(length, full)

                    def next_call(runner, state, following=following):
                        return runner.gathered(
                            state, self.data, self.key, np.int32(epoch), np.int32(0),
                            np.int32(following), length=following, size=size,
                            tail=tail if following == full else 0, batch_size=b)
                    self.ahead = (epoch + 1, 0, next_call(self.fast, self.state), self.state)

                def locate(i, start=start, active=active):
                    if i < active:
                        rows_ = order()[(start + i) * size:(start + i + 1) * size]
                        return (start + i) * k, k, tuple(int(r) for r in rows_), call_of(rows_)
                    rows_ = order()[n - tail:]
                    return full * k, -(-len(rows_) // b), tuple(int(r) for r in rows_), \
                        call_of(rows_)

                report, steps = self._record(_with_ran(got), active + (1 if last_tail else 0),
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
            rows_ = order()[done * size:(done + 1) * size]
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
            for group in group_microbatches(batches, k):
                report = self._call((group,), epoch, done * k, len(group.mask), None)
                done += 1
                position.update(step_in_epoch=done, run_step=self.run_step)
                if report is not None or stopper.raised:
                    return report
            return finished()
        length = self.chunk or LOADER_CHUNK
        pending: list = []

        def flush():
            nonlocal done
            if not pending:
                return None
            if self.runner is None or len(pending) == 1:
                report = self._call((pending[0],), epoch, done, 1, None)
                steps = 0 if report is not None else 1
            else:
                stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *pending)
                call = lambda runner, state: runner.stacked(state, stacked)
                self.state, got = _chunk(self.fast, self.runner, call, self.state, self.owned)
                self.owned = True
                start, calls = done, list(pending)
                report, steps = self._record(
                    _with_ran(got), len(pending), epoch,
                    lambda i: (start + i, 1, None, (calls[i],)))
            done += steps if report is None else steps
            pending.clear()
            position.update(step_in_epoch=done, run_step=self.run_step)
            return report

        shape_of = lambda b: jax.tree.map(np.shape, b)
        for batch in batches:
            if pending and (shape_of(batch) != shape_of(pending[0]) or len(pending) >= length):
                report = flush()
                if report is not None or stopper.raised:
                    return report
            pending.append(batch)
        report = flush()
        return report if report is not None else finished()

    # --- one call of the step (tails, loaders with accumulation, hand-written steps) ------
    def _call(self, call, epoch, batch_index, batches, examples):
        old = self.state
        new_state, metrics = _called(self.step, old, call, first=self.first_call)
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
        ys = _host_row(metrics, new_state)
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

    # --- what the host does with the steps' metrics --------------------------------------
    def _record(self, ys, count, epoch, locate, anomaly=None):
        """Adds `count` steps' metrics (NumPy, leading axis >= count) to the history; returns
        (the `NonFiniteReport` of the step that stopped the run or None, steps taken)."""
        h = self.history
        ran = np.asarray(ys["ran"][:count], bool)
        bad = np.asarray(ys["bad"][:count], bool) & ran
        routine = np.asarray(ys["routine"][:count], bool) & ran
        rows_ = np.flatnonzero(ran)
        stop = None
        if not self.skip_bad and bad.any():
            stop = int(np.flatnonzero(bad)[0])
            rows_ = rows_[rows_ <= stop]
        if "monitor_values" in ys and len(rows_):
            self._alerts(ys, rows_[~routine[rows_]])
        taken = rows_[rows_ != stop] if stop is not None else rows_
        steps = self.run_step + np.arange(len(taken))
        h.skipped_steps.extend(steps[routine[taken]].tolist())
        applied = taken[~routine[taken] & ~bad[taken]]
        h.step_loss.extend(np.asarray(ys["loss"])[applied].astype(float).tolist())
        h.step_grad_norm.extend(np.asarray(ys["grad_norm"])[applied].astype(float).tolist())
        if "learning_rate" in ys:
            h.step_learning_rate.extend(
                np.asarray(ys["learning_rate"])[applied].astype(float).tolist())
        if "monitor_values" in ys and len(applied):
            m = MonitorMetrics(np.asarray(ys["monitor_values"])[applied], (), self._layout(ys))
            h.layer_names = m.layout.layer_names
            h.step_layer_norm.extend(np.asarray(m.layer_norm).tolist())
        if self.skip_bad:
            for i, run_step in zip(taken, steps):
                if bad[i]:
                    batch_index, _, examples, _ = locate(int(i))
                    h.skipped_batches.append({
                        "step": int(run_step), "epoch": epoch, "batch": batch_index,
                        "loss": float(ys["loss"][i]), "grad_norm": float(ys["grad_norm"][i]),
                        "examples": None if examples is None else list(examples)})
                    if self.say is not None:
                        self.say(f"skipped a non-finite step {int(run_step)} (epoch {epoch}, "
                                 f"batch {batch_index}): loss={float(ys['loss'][i])}")
        self.run_step += len(taken)
        self.bar.update(len(taken))
        if len(h.step_loss):
            self.bar.set_postfix(epoch=epoch, loss=f"{h.step_loss[-1]:.4f}", refresh=False)
        if stop is None:
            return None, len(taken)
        loss, norm = float(ys["loss"][stop]), float(ys["grad_norm"][stop])
        batch_index, batches, examples, call = locate(stop)
        update = ""
        if (math.isfinite(loss) and math.isfinite(norm)
                and hasattr(self.step, "explain_skipped_update")):
            update = self.step.explain_skipped_update(self.state, *call)  # which leaf, why
        if anomaly is None and getattr(self.step, "detect_anomaly", False):
            # The chunk ran the plain step: the located run is the step with its anomaly
            # detection, once, on this step's state and batch.
            anomaly = _called(self.step, self.state, call, first=False)[1].get("anomaly")
        return NonFiniteReport(self.run_step, epoch, batch_index, loss, norm, anomaly,
                               batches, update, examples), len(taken)

    def _layout(self, ys):
        for runner in (self.fast, self.runner):
            if runner is not None and runner.monitor_layout is not None:
                return runner.monitor_layout
        return ys["monitor_layout"]

    def _alerts(self, ys, rows_) -> None:
        """The monitor's alerts of the steps `rows_`, in order: the steps that raise one are
        found from the flags and dead fractions of all of them at once (computed in the chunk),
        then `monitor_alerts` runs on those few."""
        if not len(rows_):
            return
        layout = self._layout(ys)
        flagged = np.asarray(ys["monitor_flag"])[rows_]
        frac = np.asarray(ys["monitor_dead_fraction"])[rows_]
        if frac.shape[-1]:  # a dead-ReLU alert is raised on the step a site crosses its limit
            limit = np.array([1.0 if UNKNOWN_AXIS_NOTE in name else layout.dead_threshold
                              for name in layout.relu_names])
            before = (self.previous_report[1][None] if self.previous_report is not None
                      else np.full((1, len(limit)), -1.0))
            prev = np.concatenate([before, frac[:-1]])
            flagged = flagged | ((frac >= limit) & ~(prev >= limit)).any(-1)
        values = np.asarray(ys["monitor_values"])
        dead = ys["monitor_dead"]  # device arrays (see _fetched): read only where needed
        row = lambda i: MonitorMetrics(values[i], tuple(np.asarray(d[i]) for d in dead), layout)
        for j in np.flatnonzero(flagged):
            previous = (row(rows_[j - 1]) if j > 0 else None if self.previous_report is None
                        else self.previous_report[0]())
            for alert in monitor_alerts(row(rows_[j]), previous=previous):
                self.history.alerts.append(alert)
                if len(self.history.alerts) <= MAX_LOGGED_ALERTS:
                    self.say(f"monitor: {alert}")
                elif len(self.history.alerts) == MAX_LOGGED_ALERTS + 1:
                    self.say(f"monitor: more than {MAX_LOGGED_ALERTS} alerts; the rest are "
                             "in the history, not printed")
        last = rows_[-1]  # the previous step of the next chunk: (its metrics, its fractions)
        self.previous_report = (lambda: row(last), frac[-1])


def _runner(step: Callable, raw: Callable, skip_bad: bool,
            unguarded: bool = False) -> ChunkRunner:
    """The step's `ChunkRunner`, kept on the step so that later fits reuse its compiled
    chunks."""
    runners = step.__dict__.setdefault("_fit_runners", {})
    if (skip_bad, unguarded) not in runners:
        runners[skip_bad, unguarded] = ChunkRunner(
            raw, accumulate=getattr(step, "accumulate", None), skip_bad=skip_bad,
            unguarded=unguarded)
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
        got = _fetched(ran, rows_)
        if not np.asarray(got[1]["bad"])[:int(got[0])].any():
            return new_state, got
        del fast_call, new_state  # garbage: a non-finite update was applied
    if not owned:  # the guarded chunk donates its state: never the caller's arrays
        state = owned_copy(state)
    new_state, ran, rows_ = run(guarded, state)
    return new_state, _fetched(ran, rows_)


def _fetched(ran, rows_) -> tuple:
    """A chunk's count and rows on the host, but the monitor's dead-unit masks, which stay on
    the device until a step's alert needs them (one transfer fewer per ReLU site a chunk)."""
    lazy = {"monitor_dead": rows_["monitor_dead"]} if "monitor_dead" in rows_ else {}
    got = jax.device_get((ran, {k: v for k, v in rows_.items() if k not in lazy}))
    return got[0], dict(got[1], **lazy)


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


def _with_ran(got) -> dict[str, Any]:
    """A chunk's ``(count, rows)`` as rows with "ran" (the first `count` steps ran)."""
    count, rows_ = got
    length = len(rows_["loss"])
    return dict(rows_, ran=np.arange(length) < int(count))


def _host_row(metrics: Mapping[str, Any], new_state: Any) -> dict[str, Any]:
    """One call's metrics in the chunks' layout (NumPy, leading axis 1)."""
    scaled = getattr(new_state, "loss_scale", None) is not None and "loss_scale" in metrics
    got = jax.device_get({
        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
        "skipped": metrics.get("skipped"), "learning_rate": metrics.get("learning_rate"),
        "loss_scale": metrics["loss_scale"] if scaled else None,
        "scale_after": new_state.loss_scale.scale if scaled else None})
    loss, norm = float(got["loss"]), float(got["grad_norm"])
    skipped = (bool(got["skipped"]) if got["skipped"] is not None
               else not (math.isfinite(loss) and math.isfinite(norm)))
    routine = bool(scaled and skipped and math.isfinite(loss)
                   and got["scale_after"] < got["loss_scale"])
    ys: dict[str, Any] = {
        "loss": np.array([loss]), "grad_norm": np.array([norm]), "ran": np.array([True]),
        "bad": np.array([skipped and not routine]), "routine": np.array([routine])}
    if got["learning_rate"] is not None:
        ys["learning_rate"] = np.array([float(got["learning_rate"])])
    monitored = metrics.get("monitor")
    if monitored is not None and monitored.values is not None:
        ys["monitor_values"] = np.asarray(monitored.values)[None]
        ys["monitor_dead"] = tuple(np.asarray(d)[None] for d in monitored.dead)
        ys["monitor_layout"] = monitored.layout
        m = MonitorMetrics(ys["monitor_values"][0], tuple(d[0] for d in ys["monitor_dead"]),
                           monitored.layout)
        ys["monitor_flag"] = np.asarray(alert_flag(m))[None]
        ys["monitor_dead_fraction"] = np.asarray(m.dead_fraction)[None]
    return ys


def _say(log, tqdm, line: str) -> None:
    if log is not None:
        with tqdm.external_write_mode():  # keeps the bar intact around the log line
            log(line)


def _check_accumulation(n: int, batch_size: int, accumulate: int, tail: str | None) -> None:
    n_batches = math.ceil(n / batch_size)
    if accumulate > 1 and tail == "drop" and n_batches < accumulate:
        raise ValueError(
            f"fit: {n} examples in batches of {batch_size} make {n_batches} micro-batch"
            f"{'es' if n_batches > 1 else ''} per epoch, fewer than one group of "
            f"accumulate={accumulate}, and the step drops a partial group (tail='drop'): no "
            "update would ever be applied. Use a smaller batch_size or accumulate, or "
            "tail='apply'.")
    if accumulate > 1 and accumulate * batch_size > n:
        warnings.warn(
            f"fit: accumulate={accumulate} micro-batches of {batch_size} "
            f"({accumulate * batch_size} examples) exceed the {n} examples of x: each epoch is "
            f"one group of {n_batches} micro-batch{'es' if n_batches > 1 else ''}, so training "
            f"makes one update per epoch over all {n} examples (a full-batch step). For more "
            f"updates use accumulate <= {max(1, n_batches // 2)} or a smaller batch_size.",
            UserWarning, stacklevel=3)


def _epoch_row(history: History, epoch: int, run_step: int, first: int, first_skip: int,
               state: Any) -> dict[str, float]:
    applied = len(history.step_loss) > first
    row = {"epoch": epoch, "steps": run_step,
           "loss": float(np.mean(history.step_loss[first:])) if applied else math.nan,
           "grad_norm": (float(np.mean(history.step_grad_norm[first:])) if applied
                         else math.nan)}
    if applied and len(history.step_learning_rate) == len(history.step_loss):
        row["learning_rate"] = history.step_learning_rate[-1]  # the epoch's last update
    if getattr(state, "loss_scale", None) is not None:
        row["skipped"] = len(history.skipped_steps) - first_skip
        row["loss_scale"] = float(state.loss_scale.scale)
    return row


def _evaluator(evaluate: Any, step: Callable, batch_size: int | None):
    """``evaluator(state) -> {name: number}`` for `evaluate` (a function, or an evaluation
    split whose mean loss under the step's loss is "loss"), or None."""
    if evaluate is None:
        return None
    if callable(evaluate):
        return lambda state: (evaluate(state.params) if getattr(state, "model_state", None)
                              is None else evaluate(state.params, state.model_state))
    loss = getattr(step, "loss", None)
    if loss is None or loss.has_state or loss.takes_key:
        raise TypeError(
            "fit: evaluate is an evaluation split, whose loss fit computes with the step's loss "
            "function; that needs a step from make_train_step whose loss takes no model state "
            "and no key (dropout and BatchNorm must run in evaluation mode: pass a function "
            "evaluate(params, model_state) -> {'loss': ..., 'accuracy': ...} instead).")
    tree = evaluate
    try:
        n = rows(tree, "evaluate")
    except ValueError as error:
        raise ValueError(f"fit: {error}") from None
    size = batch_size or n

    @jax.jit
    def batch_loss(params, batch):
        value = loss.fn(params, batch)
        value = value[0] if loss.has_aux else value
        return jnp.sum(value) if jnp.ndim(value) else value * _rows_of(batch)

    def evaluator(state):
        total = 0.0
        for start in range(0, n, size):
            part = jax.tree.map(lambda a, start=start: a[start:start + size], tree)
            total += float(batch_loss(state.params, part))
        return {"loss": total / n}
    return evaluator


def _rows_of(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


def _check_resumed(position: Mapping[str, Any], settings: Mapping[str, Any], directory) -> None:
    """ValueError when a resumed run's seed, batch size, data size or accumulation differ
    from the checkpointed run's: the rest of its epoch would visit other examples."""
    changed = [f"{k} {v!r} (the run had {position[k]!r})" for k, v in settings.items()
               if k in position and position[k] != v]
    if changed:
        raise ValueError(
            f"fit: resume=True from {directory} with {', '.join(changed)}: the rest of the "
            "run would visit other examples than the run that was stopped (some twice, some "
            "never). Resume with the run's own data and settings, or pass a new "
            "checkpoint_dir to start over.")


def _save(directory, state, position, history) -> None:
    from funcgrad.train.checkpoint import latest_checkpoint_step, save_checkpoint
    if os.path.isdir(directory) and latest_checkpoint_step(directory) == int(state.step):
        return  # this state is saved already (an epoch's end, then a stop before any step)
    save_checkpoint(directory, state, position=dict(position), history=history._state())


def _restore(directory, like):
    """(state, history, position) of the newest checkpoint in `directory`, or None when the
    folder holds none (a first run with resume=True starts from `like`)."""
    from funcgrad.train.checkpoint import latest_checkpoint_step, restore_checkpoint
    if not os.path.isdir(directory) or latest_checkpoint_step(directory) is None:
        return None
    restored = restore_checkpoint(directory, like)
    return restored.state, History._from_state(restored.history or {}), restored.position


@jax.jit
def _all_finite_device(params):
    return jnp.all(jnp.array([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))


def _all_finite(params) -> bool:
    return bool(_all_finite_device(params)) if jax.tree.leaves(params) else True


def format_epoch(row: Mapping[str, float]) -> str:
    """One line for an epoch's row of the history: ``epoch   3  loss 0.1234  grad_norm ...``."""
    extra = "  ".join(f"{k} {v}" if isinstance(v, (int, np.integer)) else
                      f"{k} {v:.6g}" if k in ("loss_scale", "learning_rate")
                      else f"{k} {v:.4f}"
                      for k, v in row.items() if k not in ("epoch", "steps", "loss", "grad_norm"))
    return (f"epoch {int(row['epoch']):3d}  loss {row['loss']:.4f}  "
            f"grad_norm {row['grad_norm']:.4f}  {extra}").rstrip()


def _called(step: Callable, state: TrainState, args: tuple, *, first: bool):
    """``step(state, *args)``; on the first call of a fit, a wrong kind of `step` is named."""
    if not first:
        return step(state, *args)
    ours = hasattr(step, "nonfinite")  # set by make_train_step
    fix = ("fit calls step(state, batch) with the TrainState and expects (TrainState, metrics) "
           "back; build it with step = funcgrad.make_train_step(loss_fn, optimizer) (a loss "
           "function is not a step).")
    try:
        out = step(state, *args)
    except Exception as error:
        if not ours:
            error.add_note(f"funcgrad.train.fit: `step` was not made by make_train_step. {fix}")
        raise
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], TrainState)):
        raise TypeError(f"funcgrad.train.fit: step returned {_kind(out)}, not "
                        f"(TrainState, metrics). {fix}")
    metrics = out[1]
    if not isinstance(metrics, Mapping):
        problem = f"its metrics are a {type(metrics).__name__}, not a dict"
    else:
        missing = [k for k in ("loss", "grad_norm") if k not in metrics]
        problem = (f"its metrics have no {' and no '.join(map(repr, missing))} "
                   f"(keys: {', '.join(map(repr, metrics)) or 'none'})") if missing else ""
    if problem:
        raise TypeError(
            f"funcgrad.train.fit: step returned (TrainState, metrics), but {problem}. fit records "
            "the loss and the pre-clip global gradient norm of every step and stops on a "
            "non-finite one, so a hand-written step returns metrics={'loss': loss, "
            "'grad_norm': optax.global_norm(grads)}; funcgrad.make_train_step(loss_fn, "
            "optimizer) builds such a step for you.")
    return out


def _check_callables(step, evaluate, log) -> None:
    """A TypeError naming the argument when `step`, `evaluate` or `log` cannot be called (a
    string such as "adam" or "print" failed later as "'str' object is not callable")."""
    expected = {"step": "a function (state, batch) -> (TrainState, metrics), e.g. "
                        "funcgrad.make_train_step(loss_fn, optimizer)",
                "evaluate": "a function of the params returning {name: number}, e.g. "
                            "lambda params: {'accuracy': accuracy(params)}",
                "log": "a function of one line of text, e.g. print (not the string 'print')"}
    for name, value in (("step", step), ("evaluate", evaluate), ("log", log)):
        if value is not None and not callable(value) or name == "step" and value is None:
            shown = f" ({value!r})" if isinstance(value, str) else ""
            raise TypeError(f"fit: {name} must be {expected[name]}; got a "
                            f"{type(value).__name__}{shown}.")


#: What `fit` puts before each name `evaluate` returns, in the epoch rows, the log and
#: metrics.json: evaluation numbers never share a key with the training numbers.
EVAL_PREFIX = "eval/"


def _evaluated(scores: Any) -> dict[str, float]:
    """`evaluate`'s ``{name: number}`` as ``{"eval/name": float}``, checked."""
    if not isinstance(scores, Mapping):
        raise TypeError("fit: evaluate(params) must return a mapping such as "
                        f"{{'test_accuracy': 0.97}}, got {type(scores).__name__}.")
    out = {}
    for name, value in scores.items():
        if not isinstance(name, str):
            raise TypeError(f"fit: evaluate(params) returned the key {name!r}; use strings "
                            "such as 'test_accuracy'.")
        if np.size(value) != 1:
            raise TypeError(f"fit: evaluate(params)[{name!r}] has shape {np.shape(value)}; "
                            "each value must be one number (reduce it, e.g. with .mean()).")
        out[EVAL_PREFIX + name] = float(np.asarray(value).reshape(()))
    return out


def _kind(value: Any) -> str:
    """A short description of `value` for an error: an array's shape and dtype, else its type."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a {type(value).__name__}"
