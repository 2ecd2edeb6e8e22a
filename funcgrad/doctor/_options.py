"""`DoctorOptions`: what the checks are told besides the step, its state and the data: the
budgets, thresholds and hints each check declares, with their defaults."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class DoctorOptions:
    """The options of `funcgrad.doctor`'s checks as one value (as orbax's
    ``CheckpointManagerOptions``): hints about the model (`classes`, `eval_loss`, `evaluate`),
    budgets in steps or examples, the seed of the probes, and dimensionless thresholds. Each
    attribute names the checks that read it; every one has its default.

    Attributes:
      classes: K, the number of classes: init_loss compares the loss at init with log(K) and
        data fails labels outside 0..K-1 (default: inferred from integer labels holding
        exactly 0..K-1).
      eval_loss: the loss in the inference mode (BatchNorm's running statistics, no
        dropout) for baseline's held-out loss: a `funcgrad.Loss`, or a function taken under
        the step's loss's flags (has_aux, has_state, takes_key). Default: the step's loss; a
        model file's `model` + `objective` gives ``model.loss(objective, train=False)``.
      evaluate: ``evaluate(params[, model_state]) -> {name: number}``, run after training on
        its final state; its numbers are that check's evidence.
      steps: training's optimizer steps (100).
      overfit_steps: overfit's most steps (300).
      overfit_rows: overfit's examples (16).
      batch_size: examples per training batch for array data (32; a loader's batches are
        used as they come).
      tiny_rows: the tiny batch of grad_flow and fd_audit (8).
      check_rows: the examination batch of init_loss, grad_stats, nonfinite, baseline (64).
      max_full_elements: fd_audit checks every element up to this many (12,000), then
        directions.
      max_evaluations: fd_audit's directional budget, in function evaluations (4,000).
      seed: seeds the batch order and the probes (0); the loss's PRNG key is the state's
        (``step.init(params, seed=...)``).
      init_loss_ratio: init_loss warns when loss / log(K) is above this or below its
        inverse (2.0).
      overfit_ratio: overfit passes when the loss falls below this fraction of its first
        value (0.2).
      clip_quantile: training's clipping advice, this quantile of the observed gradient
        norms (0.9).
    Raises:
      TypeError: for an unknown option (the dataclass's own error), a count that is not an
        int, `evaluate` or `eval_loss` that is not callable.
      ValueError: for a count below 1 (below 0 for seed, 2 for classes), a ratio or quantile
        out of range.
    Example:
      >>> options = fg.DoctorOptions(classes=10, steps=50)
      >>> report = fg.doctor(step, state, data, options=options)
    """
    classes: int | None = None
    eval_loss: Any = None
    evaluate: Callable | None = None
    steps: int = 100
    overfit_steps: int = 300
    overfit_rows: int = 16
    batch_size: int = 32
    tiny_rows: int = 8
    check_rows: int = 64
    max_full_elements: int = 12_000
    max_evaluations: int = 4_000
    seed: int = 0
    init_loss_ratio: float = 2.0
    overfit_ratio: float = 0.2
    clip_quantile: float = 0.9

    def __post_init__(self) -> None:
        counts = ("steps", "overfit_steps", "overfit_rows", "batch_size", "tiny_rows",
                  "check_rows", "max_full_elements", "max_evaluations")
        for name in (*counts, "seed", *(("classes",) if self.classes is not None else ())):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DoctorOptions: {name} must be an int, got {value!r}.")
            least = 0 if name == "seed" else 2 if name == "classes" else 1
            if value < least:
                raise ValueError(f"DoctorOptions: {name} must be at least {least}, got "
                                 f"{value!r}.")
        for name, ok, want in (
                ("init_loss_ratio", lambda v: 1 < v < math.inf, "a number above 1"),
                ("overfit_ratio", lambda v: 0 < v < 1, "a number between 0 and 1"),
                ("clip_quantile", lambda v: 0 < v <= 1, "a number in (0, 1]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"DoctorOptions: {name} must be {want}, got {value!r}.")
        for name in ("eval_loss", "evaluate"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"DoctorOptions: {name} must be a function (or None), got "
                                f"{type(value).__name__}.")
