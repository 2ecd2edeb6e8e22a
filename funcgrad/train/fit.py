"""`fit`: the training loop around a train step, with a progress bar, a history and a guard.

`fit` drives a step from `funcgrad.train.step.make_train_step` over a dataset for some epochs. It
records per-step losses and gradient norms, per-epoch rows and the gradient monitor's alerts in
a `History`. When a step's loss or gradient norm is NaN/inf it stops with a `NonFiniteReport`
and returns the last state whose params are finite: nothing is silently corrupted.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._library_objects import check_params
from funcgrad.train.accumulate import group_microbatches
from funcgrad.train.data import batches, rows
from funcgrad.train.monitor import monitor_alerts
from funcgrad.train.step import TrainState, step_was_skipped

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
    """
    step: int
    epoch: int
    batch: int
    loss: float
    grad_norm: float
    anomaly: Any = None
    batches: int = 1
    update: str = ""

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
        text = (f"non-finite value at step {self.step} (epoch {self.epoch}, {where}): "
                f"loss={self.loss}, grad_norm={self.grad_norm}. Training stopped; the returned "
                "state is the last one with finite loss and gradients (this step was not "
                f"applied). {hint}")
        return text if self.anomaly is None else f"{text}\n{self.anomaly}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for metrics.json): the fields, with the anomaly report as a dict."""
        return self._asdict() | {"anomaly": None if self.anomaly is None
                                 else self.anomaly.to_dict()}


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
                "alerts": [dataclasses.asdict(a) | {"text": str(a)} for a in self.alerts]}


class FitResult(NamedTuple):
    """What `fit` returns: the final (last finite) state, the history, and why it stopped early.

    Attributes:
      state: the `TrainState` after the last applied step.
      history: the `History` of the run.
      nonfinite: a `NonFiniteReport` if training stopped on a non-finite value, else None.
    """
    state: TrainState
    history: History
    nonfinite: NonFiniteReport | None


#: How many monitor alerts `fit` passes to its `log`; all are kept in `History.alerts`.
MAX_LOGGED_ALERTS = 20


def fit(step: Callable, state: TrainState, x: PyTree, y: PyTree, *, epochs: int,
        batch_size: int, seed: int = 0, evaluate: Callable[[PyTree], Mapping[str, float]] | None = None,
        progress: bool = True, log: Callable[[str], None] | None = None) -> FitResult:
    """Trains for `epochs` passes over ``(x, y)`` with a progress bar, stopping on a non-finite.

    Each epoch visits the examples in a seeded order (`funcgrad.train.data.batches` with
    ``(seed, epoch)``), calls ``step(state, {"x": ..., "y": ...})`` and records the loss and
    the global gradient norm. A step made with ``accumulate=K`` gets each K consecutive batches
    of `batch_size` as one call (`funcgrad.train.accumulate.group_microbatches`; the epoch's last,
    shorter group too, handled by the step's `tail` policy). After the epoch,
    ``evaluate(state.params)`` (if given) adds its numbers (e.g. test accuracy) to the epoch's
    row under ``"eval/<name>"`` (so an evaluation "loss" is ``"eval/loss"``, beside the
    training "loss", never over it), and `log` gets a one-line summary.

    Numbering: epochs are counted from 1 in everything fit shows or records (log lines, the
    progress bar, ``History.epochs[i]["epoch"]``, `NonFiniteReport`, metrics.json), as PyTorch
    and Keras print them; steps and batches are 0-based indices (``step`` k is the one applied
    when ``TrainState.step == k``).

    Guard: if a step was skipped (`step_was_skipped`: its ``metrics["skipped"]``, or a
    non-finite loss or gradient norm), training stops at once and the state from *before*
    that step is returned (JAX arrays are immutable, so keeping it
    costs no copy); the result carries a `NonFiniteReport` and a ``RuntimeWarning`` with the
    same text is issued. If that earlier state's params are themselves non-finite (an update
    that overflowed while its loss and gradient were finite), the state from the end of the
    last epoch whose params were all finite is returned instead (params are checked once per
    epoch, not per step, to keep the loop free of extra reductions).

    Args:
      step: a step from `make_train_step`.
      state: the starting `TrainState`.
      x, y: training inputs ``(n, ...)`` and targets ``(n, ...)``, NumPy or JAX arrays, or
        pytrees of them for several inputs (``x = {"image": (n, 8, 8), "meta": (n, 3)}``:
        each batch's ``"x"`` has that structure); rows are counted on the leaves, which must
        all have the same n. Nested Python lists are converted with ``np.asarray``.
      epochs: number of passes, a positive int.
      batch_size: examples per step, a positive int (the last batch of an epoch may be smaller).
      seed: seed of the batch order.
      evaluate: ``evaluate(params) -> {name: number}``, called once per epoch; stored as
        ``"eval/<name>"``. When the state has a model state (a loss declared with
        ``has_state=True``, `funcgrad.train.loss`), ``evaluate(params, model_state)``: BatchNorm's
        running statistics are then used at evaluation time.
      progress: show a tqdm progress bar on stderr.
      log: called with each epoch's summary line (e.g. `print`), and with each alert of a
        monitored step (``make_train_step(monitor=)``; the first `MAX_LOGGED_ALERTS`, all are
        kept in the history); None for silence.
    Returns:
      a `FitResult`.
    Raises:
      ValueError: if `epochs` or `batch_size` is not a positive int, `x` is empty, the
        leaves of `x` and `y` have different numbers of rows (named by their paths), or an
        accumulating step with ``tail="drop"`` would drop every group (fewer batches per
        epoch than `accumulate`).
      FloatingPointError: at a skipped step, when `step` was made with ``nonfinite="raise"``;
        the message is the `NonFiniteReport`.
      TypeError: if `step`, `evaluate` or `log` is not callable (e.g. the string "print");
        if the first call of `step` returns something other than ``(TrainState, metrics)``
        (e.g. `step` is the loss function) or metrics without "loss" and "grad_norm" (a
        hand-written step); if `evaluate` returns no mapping of names to single numbers.
        An exception raised by that first call of a step not made by `make_train_step` gets
        a note saying what `fit` expects.
    Warns:
      UserWarning: when an accumulating step's group (``accumulate * batch_size`` examples)
        is larger than `x`: every update is then one full pass, one per epoch.
    """
    from tqdm.auto import tqdm

    if not isinstance(epochs, (int, np.integer)) or epochs < 1:
        raise ValueError(f"fit: epochs must be a positive int, got {epochs!r}.")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"fit: batch_size must be a positive int, got {batch_size!r}.")
    _check_callables(step, evaluate, log)
    if isinstance(state, TrainState):
        check_params("fit", state.params)  # an equinox / nnx object: the fix to train it
    # Python lists, as from a CSV reader, become arrays; a dict (several inputs) stays a pytree.
    x = np.asarray(x) if isinstance(x, (list, tuple)) else x
    y = np.asarray(y) if isinstance(y, (list, tuple)) else y
    try:
        n = rows(x, "x")
        if rows(y, "y") != n:
            raise ValueError(f"x has {n} rows but y has {rows(y, 'y')}; they must match (one "
                             "row per example).")
    except ValueError as error:
        raise ValueError(f"fit: {error}") from None
    if n == 0:
        raise ValueError("fit: x is empty; there is nothing to train on.")
    history = History()
    accumulate = getattr(step, "accumulate", None) or 1
    n_batches = math.ceil(n / batch_size)
    if accumulate > 1 and getattr(step, "tail", None) == "drop" and n_batches < accumulate:
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
            UserWarning, stacklevel=2)
    steps_per_epoch = math.ceil(n_batches / accumulate)
    bar = tqdm(total=epochs * steps_per_epoch, disable=not progress, unit="step", leave=False)

    def say(line):
        if log is not None:
            with tqdm.external_write_mode():  # keeps the bar intact around the log line
                log(line)

    verified = state  # last state whose params were checked finite (at each epoch's end)
    run_step = 0
    previous_report = None  # the last step's MonitorMetrics: dead-ReLU alerts on crossings
    try:
        for epoch in range(1, epochs + 1):  # numbered from 1 wherever a user sees them
            first, first_skip = len(history.step_loss), len(history.skipped_steps)
            micro = batches(x, y, batch_size=batch_size, seed=seed, epoch=epoch - 1)
            calls = (((b,) for b in micro) if accumulate == 1
                     else ((g,) for g in group_microbatches(micro, accumulate, size=batch_size)))
            for i, call in enumerate(calls):
                new_state, metrics = _called(step, state, call, first=run_step == 0)
                if accumulate > 1:  # one group per call: metrics of 1 update, or 0 if dropped
                    history.dropped_examples += int(metrics.pop("dropped_examples"))
                    metrics.pop("examples")
                    if metrics["loss"].shape[0] == 0:
                        state = new_state
                        bar.update(1)
                        continue
                    metrics = {k: v if k == "anomaly" else jax.tree.map(lambda a: a[0], v)
                               for k, v in metrics.items()}
                scaled = getattr(new_state, "loss_scale", None) is not None
                loss, grad_norm, skipped, used, backed_off, monitored, rate = jax.device_get(
                    (metrics["loss"], metrics["grad_norm"], metrics.get("skipped", 0),
                     metrics.get("loss_scale", 0.0), new_state.loss_scale.scale if scaled else 0.0,
                     metrics.get("monitor"), metrics.get("learning_rate")))
                loss, grad_norm = float(loss), float(grad_norm)
                if skipped and scaled and math.isfinite(loss) and backed_off < used:
                    # A loss-scale overflow: params and optimizer state kept, scale lowered;
                    # routine, counted. (A skip that cannot lower the scale, at its floor, or a
                    # non-finite loss, which the scale does not touch, is an anomaly below.)
                    state = new_state
                    history.skipped_steps.append(run_step)
                    run_step += 1
                    bar.update(1)
                    continue
                if monitored is not None:  # after routine loss-scale skips: no alert for those
                    for alert in monitor_alerts(monitored, previous=previous_report):
                        history.alerts.append(alert)
                        if len(history.alerts) <= MAX_LOGGED_ALERTS:
                            say(f"monitor: {alert}")
                        elif len(history.alerts) == MAX_LOGGED_ALERTS + 1:
                            say(f"monitor: more than {MAX_LOGGED_ALERTS} alerts; the rest are "
                                "in the history, not printed")
                    previous_report = monitored
                bad = (bool(skipped) if "skipped" in metrics
                       else step_was_skipped({"loss": loss, "grad_norm": grad_norm}))
                if bad:
                    taken = 1 if accumulate == 1 else int(jax.tree.leaves(call[0])[0].shape[0])
                    update = ""
                    if (math.isfinite(loss) and math.isfinite(grad_norm)
                            and hasattr(step, "explain_skipped_update")):
                        update = step.explain_skipped_update(state, *call)  # which leaf, why
                    report = NonFiniteReport(run_step, epoch, i * accumulate, loss, grad_norm,
                                             metrics.get("anomaly"), taken, update)
                    if getattr(step, "nonfinite", None) == "raise":
                        raise FloatingPointError(str(report))
                    if not _all_finite(state.params):
                        # The step before applied an update that overflowed the params although
                        # its own loss and gradient were finite: go back to the epoch's start.
                        state = verified
                    warnings.warn(str(report), RuntimeWarning, stacklevel=2)
                    return FitResult(state, history, report)
                state = new_state
                history.step_loss.append(loss)
                history.step_grad_norm.append(grad_norm)
                if rate is not None:  # a schedule's rate, as this update applied it
                    history.step_learning_rate.append(float(rate))
                if monitored is not None:
                    history.layer_names = monitored.layer_names
                    history.step_layer_norm.append(np.asarray(monitored.layer_norm).tolist())
                run_step += 1
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{history.step_loss[-1]:.4f}", refresh=False)
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
            if evaluate is not None:
                scores = (evaluate(state.params) if getattr(state, "model_state", None) is None
                          else evaluate(state.params, state.model_state))
                row.update(_evaluated(scores))
            history.epochs.append(row)
            if _all_finite(state.params):
                verified = state
            say(format_epoch(row))
    finally:
        bar.close()
    return FitResult(state, history, None)


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
        problem = missing and (f"its metrics have no {' and no '.join(map(repr, missing))} "
                               f"(keys: {', '.join(map(repr, metrics)) or 'none'})")
    if problem:
        raise TypeError(
            f"funcgrad.train.fit: step returned (TrainState, metrics), but {problem}. fit records the "
            "loss and the pre-clip global gradient norm of every step and stops on a "
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
