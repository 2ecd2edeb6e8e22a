"""`doctor`: the whole gradient-debugging checklist on one model, each check timed, a crash in
one check reported as that check's "error" while the others still run."""
from __future__ import annotations

import dataclasses
import importlib
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import CHECKS, Finding
from funcgrad.doctor._model_file import ModelFileError, load_model_file
from funcgrad.doctor._options import DoctorOptions
from funcgrad.doctor._report import DoctorReport
from funcgrad.doctor._subject import Subject

if TYPE_CHECKING:
    from funcgrad.train.state import TrainState
    from funcgrad.train.step import TrainStep

#: The order they run in: nonfinite after training, so that it can locate a step that went
#: non-finite there.
_RUN_ORDER = ("data", "init_loss", "grad_flow", "fd_audit", "grad_stats", "training",
              "nonfinite", "overfit", "baseline", "semantics", "memory")


def doctor(step: TrainStep, state: TrainState, data: Any, *, checks: Iterable[str] | None = None,
           options: DoctorOptions | None = None,
           progress: Callable[[Finding], None] | None = None, **moved: Any) -> DoctorReport:
    """Runs the gradient-debugging checklist on the train step you train with and says what is
    wrong, where, and what to do: one `Finding` per check (`CHECKS`).

    The step is examined as it is: its loss and the loss's pieces (`funcgrad.Loss`'s model
    state, key and aux; `funcgrad.mixed_precision`; `funcgrad.accumulate`, whose loss is one
    loss per example), its optimizer, trainable mask, clipping and non-finite policy. The
    checks take the params, model state and key from `state` and start each of their runs
    from ``step.init`` of them (a fresh optimizer state); they run the step jitted on one
    device (a `funcgrad.data_parallel` step as its one-device step), with the gradient monitor
    added for the training check and, for the overfit check, without accumulation.

    Args:
      step: a `funcgrad.TrainStep` (``funcgrad.make_train_step(loss, optimizer, ...)``).
      state: its `funcgrad.TrainState` from ``step.init(params)`` (with ``model_state=`` for a
        loss with model state, ``seed=`` or ``key=`` for one that takes a key).
      data: a pytree of arrays with a leading example axis (``{"x": (n, 64), "y": (n,)}``), a
        list of batches, or a function ``epoch -> iterable of batches``.
      checks: the names of the checks to run (from `CHECKS`; default all). To leave some out:
        ``[c for c in fg.doctor.CHECKS if c != "memory"]``.
      options: a `DoctorOptions`: the hints (classes, eval_loss, evaluate), budgets and
        thresholds of the checks (default ``DoctorOptions()``).
      progress: called with each `Finding` as its check ends (the CLI prints a line).
    Returns:
      a `DoctorReport`: ``.findings`` in `CHECKS` order, ``.exit_code`` (1 when a check
      failed), ``.table()``, ``.to_json(path)``, ``.to_html(path)``.
    Raises:
      TypeError: for a `step` that is not a TrainStep (a loss function: the message shows
        ``make_train_step``), a `state` that is not a TrainState (params: ``step.init``),
        `options` that are not DoctorOptions, a former keyword (the message names its new
        place: ``optimizer`` and ``step_kwargs`` are the step's, ``model_state`` and ``key``
        the state's, ``classes``, ``steps``, ``seed``... the options').
      ValueError: a state whose model state or key does not match the step's loss; an
        unknown check name.
      ModelFileError (a ValueError): data of the wrong kind or shape, or a loss that does not
        run on a batch of it (the message names the piece, the error and its line).
    Example:
      >>> step = fg.make_train_step(loss_fn, optax.chain(fg.clip_by_global_norm(1.0),
      ...                                                  optax.adam(1e-3)))
      >>> report = fg.doctor(step, step.init(params), {"x": x, "y": y},
      ...                    options=fg.DoctorOptions(classes=10))
      >>> print(report.table())
    """
    if moved:
        _refuse_moved(moved)
    _check_step_and_state(step, state)
    if options is None:
        options = DoctorOptions()
    elif not isinstance(options, DoctorOptions):
        raise TypeError(f"doctor: options must be a funcgrad.DoctorOptions (options=fg."
                        f"DoctorOptions(steps=50, classes=10)), got {type(options).__name__}.")
    return _run(step, state, data, _selected(checks), options, progress)


def doctor_file(path: str | os.PathLike, *, checks: Iterable[str] | None = None,
                options: DoctorOptions | None = None,
                progress: Callable[[Finding], None] | None = None) -> DoctorReport:
    """`load_model_file` then `doctor` on its step, state and data; `checks`, `options` and
    `progress` as `doctor`'s. The file's `classes`, `evaluate` and (for `model` + `objective`)
    inference-mode loss fill the options that `options` leaves None; ``options.seed`` seeds
    the state's key.

    Raises:
      ModelFileError: as `load_model_file` and `doctor`, and for a `classes` or `evaluate`
        of the wrong kind.
      TypeError, ValueError: as `doctor`, for `checks` and `options`.
    """
    options = DoctorOptions() if options is None else options
    if not isinstance(options, DoctorOptions):
        raise TypeError(f"doctor_file: options must be a funcgrad.DoctorOptions, got "
                        f"{type(options).__name__}.")
    names = _selected(checks)
    pieces = load_model_file(path, seed=options.seed)
    hints = {name: pieces[name] for name in ("classes", "evaluate", "eval_loss")
             if pieces[name] is not None and getattr(options, name) is None}
    try:
        options = dataclasses.replace(options, **hints)
    except (TypeError, ValueError) as error:
        raise ModelFileError(f"{pieces['source']}: {error}") from None
    return _run(pieces["step"], pieces["state"], pieces["data"], names, options, progress,
                source=pieces["source"])


def _run(step: Any, state: Any, data: Any, names: set[str], options: DoctorOptions,
         progress: Callable[[Finding], None] | None, source: str | None = None
         ) -> DoctorReport:
    started = time.perf_counter()
    subject = Subject(step, state, data, options, source=source)
    ctx = Context(subject, options)
    subject.preflight(ctx.tiny)
    found: dict[str, Finding] = {}
    for name in _RUN_ORDER:
        if name not in names:
            continue
        found[name] = _run_one(name, ctx)
        if progress is not None:
            progress(found[name])
    if "training" in found and subject.evaluate is not None and "run" in ctx.shared:
        _evaluate(ctx, found["training"])
    return DoctorReport([found[name] for name in CHECKS if name in found],
                        subject=subject.describe(), seconds=time.perf_counter() - started,
                        curves=ctx.curves, source=source)


def _run_one(name: str, ctx: Context) -> Finding:
    module = importlib.import_module(f"funcgrad.doctor.checks.{name}")
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():  # the findings say it; warnings would repeat it
            warnings.simplefilter("ignore")
            finding = module.check(ctx)
    except Exception as error:  # noqa: BLE001 - one check's crash is its finding
        text = str(error).strip().splitlines()
        reason = next((line for line in text if line.strip()), "")
        finding = Finding(name, "error", f"the check crashed: {type(error).__name__}: "
                          f"{reason}"[:400], {"exception": type(error).__name__,
                                              "message": str(error)[:4000]}, {},
                          "The other checks still ran. This model is unusual for this check; "
                          "please report it with the model file.")
    finding.seconds = time.perf_counter() - start
    return finding


def _evaluate(ctx: Context, finding: Finding) -> None:
    state = ctx.shared["run"]["state"]
    args = (state.params,) if state.model_state is None else (state.params, state.model_state)
    try:
        evaluate = ctx.subject.evaluate
        assert evaluate is not None  # the caller checked
        values = evaluate(*args)
        finding.evidence["evaluate"] = {k: float(v) for k, v in dict(values).items()}
    except Exception as error:  # noqa: BLE001 - the user's evaluate
        finding.evidence["evaluate_error"] = f"{type(error).__name__}: {error}"[:400]


def _selected(checks: Iterable[str] | None) -> set[str]:
    chosen = list(CHECKS) if checks is None else [checks] if isinstance(checks, str) \
        else list(checks)
    wrong = [c for c in chosen if c not in CHECKS]
    if wrong:
        raise ValueError(f"doctor: unknown check(s) {', '.join(map(repr, wrong))}; the checks "
                         f"are {', '.join(CHECKS)}.")
    return set(chosen)


#: doctor's former keywords and where each went (a DoctorOptions field: `_refuse_moved`).
_MOVED_KEYWORDS = {
    "model_state": "give it to the step's init: fg.doctor(step, step.init(params, "
                   "model_state=model_state), data)",
    "key": "give it to the step's init: fg.doctor(step, step.init(params, key=key), data)",
    "optimizer": "build the step with it: step = fg.make_train_step(loss_fn, optimizer)",
    "step_kwargs": "build the step you train with: fg.make_train_step(loss, optax.chain("
                   "fg.clip_by_global_norm(1.0), optimizer), trainable=...) over the loss's "
                   "pieces "
                   "(fg.Loss, fg.mixed_precision, fg.accumulate), and fg.detect_anomaly(step)",
    "skip": "select the checks to run: checks=[c for c in fg.doctor.CHECKS if c not in skip]",
    "source": "funcgrad.doctor.doctor_file(path) reads a model file and its lines",
}


def _refuse_moved(moved: dict[str, Any]) -> None:
    name = next(iter(moved))
    if name in _MOVED_KEYWORDS:
        where = _MOVED_KEYWORDS[name]
    elif name in {f.name for f in dataclasses.fields(DoctorOptions)}:
        where = f"pass it in the options: options=fg.DoctorOptions({name}=...)"
    else:
        raise TypeError(f"doctor() got an unexpected keyword argument {name!r}.")
    raise TypeError(f"doctor: {name}= is no longer a keyword; {where}.")


def _check_step_and_state(step: Any, state: Any) -> None:
    """TypeError or ValueError, before any check runs, for a step or state of the wrong kind
    or a state that does not fit the step's loss."""
    from funcgrad.train.state import TrainState
    from funcgrad.train.step import TrainStep

    if not isinstance(step, TrainStep):
        if callable(step):
            name = getattr(step, "__name__", type(step).__name__)
            raise TypeError(
                f"doctor: the first argument is the train step (a funcgrad.TrainStep), got the "
                f"function {name}. Build the step you train with from it and pass its state:\n"
                f"    step = fg.make_train_step({name}, optax.adam(1e-3))\n"
                f"    fg.doctor(step, step.init(params), data)")
        raise TypeError(f"doctor: the first argument is the train step, a funcgrad.TrainStep "
                        f"(fg.make_train_step(loss_fn, optimizer)), got "
                        f"{type(step).__name__}.")
    if not isinstance(state, TrainState):
        raise TypeError(f"doctor: the second argument is the step's TrainState (its params, "
                        f"model state and key), got {type(state).__name__}: pass "
                        f"step.init(params) (model_state=... for a loss with model state).")
    loss = step.loss
    if loss.has_state != (state.model_state is not None):
        raise ValueError(f"doctor: the step's loss {loss!r} "
                         + ("declares model state but the state has none" if loss.has_state
                            else "has no model state but the state holds one")
                         + ": make the state with this step's step.init(params"
                         + (", model_state=...)." if loss.has_state else ")."))
    if loss.takes_key and state.key is None:
        raise ValueError(f"doctor: the step's loss {loss!r} takes a key but the state has "
                         "none: make the state with this step's step.init(params, seed=0).")


__all__ = ["CHECKS", "DoctorOptions", "ModelFileError", "doctor", "doctor_file",
           "load_model_file"]
