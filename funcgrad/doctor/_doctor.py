"""`doctor`: the whole gradient-debugging checklist on one model, each check timed, a crash in
one check reported as that check's "error" while the others still run."""
from __future__ import annotations

import importlib
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax

from funcgrad.doctor._context import DEFAULTS, Context
from funcgrad.doctor._finding import CHECKS, Finding
from funcgrad.doctor._model_file import ModelFileError, load_model_file
from funcgrad.doctor._report import DoctorReport
from funcgrad.doctor._subject import Subject

PyTree = Any


#: The order they run in: nonfinite after training, so that it can locate a step that went
#: non-finite there.
_RUN_ORDER = ("data", "init_loss", "grad_flow", "fd_audit", "grad_stats", "training",
              "nonfinite", "overfit", "baseline", "semantics", "memory")


def doctor(loss: Callable | Any, params: PyTree, data: Any, *, model_state: PyTree = None,
           optimizer: Any = None, step_kwargs: dict | None = None, classes: int | None = None,
           evaluate: Callable | None = None, key: jax.Array | None = None,
           eval_loss: Any = None, checks: Iterable[str] | None = None,
           skip: Iterable[str] | None = None,
           steps: int | None = None, overfit_steps: int | None = None, seed: int = 0,
           batch_size: int = 32, source: str | None = None,
           progress: Callable[[Finding], None] | None = None,
           **thresholds: Any) -> DoctorReport:
    """Runs the gradient-debugging checklist on a model and says what is wrong, where, and what
    to do: one `Finding` per check (`CHECKS`).

    Args:
      loss: ``loss(params, batch) -> scalar`` or a `funcgrad.Loss` under the train step's
        contract (model state, key, aux); with ``step_kwargs={"accumulate": K}``, one loss per
        example, shape ``(m,)``.
      params: the pytree the loss differentiates (arrays; an equinox module's floating part).
      data: a pytree of arrays with a leading example axis (``{"x": (n, 64), "y": (n,)}``), a
        list of batches, or a function ``epoch -> iterable of batches``.
      model_state: the initial model state of a loss with ``has_state`` (BatchNorm's
        statistics).
      optimizer: an optax optimizer or a name for `funcgrad.make_optimizer` (default: Adam,
        learning rate 1e-3).
      step_kwargs: `funcgrad.make_train_step` keywords as the user trains with them
        (accumulate, clip_norm, loss_scale, compute_dtype, trainable, nonfinite, tail; and
        has_aux, has_state, takes_key for a plain loss function).
      classes: K, for the loss at init against log(K) (else inferred from integer labels
        0..K-1, one per example).
      evaluate: ``evaluate(params[, model_state]) -> {name: number}``, run after the training
        check (its numbers are that check's evidence).
      key: the PRNG key of a loss that takes one (default ``jax.random.key(seed)``).
      eval_loss: the loss in the inference mode (BatchNorm's running statistics, no dropout),
        under the same contract, for the held-out loss of the baseline check (default: `loss`);
        a model file's `model` + `objective` gives ``model.loss(objective, train=False)``.
      checks: the checks to run (names from `CHECKS`; default all); skip: checks to leave out.
      steps: the training check's optimizer steps (default 100); overfit_steps: the overfit
        check's budget (default 300).
      seed: seeds the key, the batch order and the probes.
      batch_size: examples per training batch for array data (a loader's batches are used as
        they come).
      source: the model file, for source lines (`doctor_file` sets it).
      progress: called with each `Finding` as its check ends (the CLI prints a line).
      **thresholds: the other budgets and thresholds of `funcgrad.doctor._context.DEFAULTS`
        (tiny_rows, check_rows, overfit_rows, max_full_elements, max_evaluations,
        init_loss_ratio, overfit_ratio, clip_quantile).
    Returns:
      a `DoctorReport`: ``.findings`` in `CHECKS` order, ``.exit_code`` (1 when a check
      failed), ``.table()``, ``.to_json(path)``, ``.to_html(path)``.
    Raises:
      ModelFileError (a ValueError): data of the wrong kind or shape, or a loss that does not
        run on a batch of it (the message names the piece, the error and its line).
      ValueError: an unknown check name or threshold.
    """
    started = time.perf_counter()
    names = _selected(checks, skip)
    unknown = sorted(set(thresholds) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"doctor: unknown option(s) {', '.join(unknown)}; the options are "
                         f"steps, overfit_steps, seed, batch_size and {', '.join(DEFAULTS)}.")
    options = dict(DEFAULTS) | thresholds
    if steps is not None:
        options["steps"] = _count("steps", steps)
    if overfit_steps is not None:
        options["overfit_steps"] = _count("overfit_steps", overfit_steps)
    subject = Subject(loss, params, data, model_state=model_state, optimizer=optimizer,
                      step_kwargs=step_kwargs, classes=classes, evaluate=evaluate, key=key,
                      eval_loss=eval_loss, batch_size=batch_size, seed=seed, source=source)
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


def doctor_file(path: str | os.PathLike, **options: Any) -> DoctorReport:
    """`load_model_file` then `doctor` on its pieces; `options` as `doctor`'s keywords (a
    keyword given here overrides the file's optimizer, step_kwargs, classes or evaluate).

    Raises:
      ModelFileError: as `load_model_file` and `doctor`.
    """
    pieces = load_model_file(path)
    source = pieces.pop("source")
    return doctor(pieces.pop("loss"), pieces.pop("params"), pieces.pop("data"),
                  **{k: v for k, v in pieces.items() if v is not None},
                  **{"source": source} | options)


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


def _selected(checks: Iterable[str] | None, skip: Iterable[str] | None) -> set[str]:
    chosen = list(CHECKS) if checks is None else [checks] if isinstance(checks, str) \
        else list(checks)
    left_out = [] if skip is None else [skip] if isinstance(skip, str) else list(skip)
    wrong = [c for c in [*chosen, *left_out] if c not in CHECKS]
    if wrong:
        raise ValueError(f"doctor: unknown check(s) {', '.join(map(repr, wrong))}; the checks "
                         f"are {', '.join(CHECKS)}.")
    return set(chosen) - set(left_out)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"doctor: {name} must be a positive int, got {value!r}.")
    return value


__all__ = ["CHECKS", "ModelFileError", "doctor", "doctor_file", "load_model_file"]
