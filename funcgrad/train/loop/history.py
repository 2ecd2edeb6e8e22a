"""What a `fit` run records and returns: the `History`, the `FitResult` and, when a step was
not finite, the `NonFiniteReport` that names it; `epoch_row` and `format_epoch` make and show
an epoch's row.

Nothing here touches the device: these are plain records (Python floats and lists), written
by `funcgrad.train.loop._record` as each chunk's rows come back and stored in checkpoints
(`History._state`, `History._from_state`) and metrics.json (`History.to_dict`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from funcgrad.train.state import TrainState


class NonFiniteReport(NamedTuple):
    """Where a training run met a non-finite loss or global gradient norm.

    Attributes:
      step: index of the offending step (0-based, counted over the whole run, like
        ``TrainState.step``: the number of steps applied before it).
      epoch: epoch of that step, numbered from 1 as in `fit`'s log lines, rows and progress
        bar (its batches are ``funcgrad.Batches(...).epoch(epoch - 1)``).
      batch: index of the (first) batch of that step within its epoch (0-based); a step whose
        loss accumulates K micro-batches (`funcgrad.accumulate`) takes batches ``batch ..
        batch + batches - 1``.
      loss: the loss of that step (a Python float; may be nan or inf).
      grad_norm: the pre-clip global gradient norm of that step (may be nan or inf).
      anomaly: with a step wrapped by `funcgrad.detect_anomaly`, the `funcgrad.debug.anomaly.
        AnomalyReport` of that step's params and batch (primitive, pass and source line of
        the first non-finite value; with accumulation its context names the micro-batch);
        None otherwise.
      batches: how many batches the step took (1, or up to K with accumulation).
      update: when the loss and the norm are finite but the optimizer's update or the new
        params were not (the step's guard skipped it), which leaves and how to fix it (from
        the step's ``explain_skipped_update``); "" otherwise.
      examples: with array data, the indices (rows of the dataset) of that step's examples,
        in batch order; None for a loader's batch.
      bad_examples: with array data and a non-finite loss, the examples among them whose loss
        is not finite on its own (the step's loss evaluated on each example as a batch of
        one, at the state the step started from), at most 8, each a dict: ``"row"`` (its row
        of the dataset), ``"loss"``, each data leaf that holds one number per example (a
        class label: ``"y": 10``), ``"nonfinite_inputs"`` (the leaves with NaN/inf in that
        row) and, for each such number, how many rows of the whole dataset hold it
        (``"rows_with_y": 1``) and its smallest and largest value there (``"range_of_y":
        [0, 10]``); ``bad_count`` says how many such examples there were in all. Empty
        when no example alone is non-finite (a loss that couples the batch) or it could not
        be evaluated per example.
      bad_count: how many examples of the step are non-finite alone (see `bad_examples`).
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
    bad_examples: tuple[dict[str, Any], ...] = ()
    bad_count: int = 0

    def __str__(self) -> str:
        where = (f"batch {self.batch}" if self.batches == 1 else
                 f"batches {self.batch}-{self.batch + self.batches - 1}, accumulated")
        these = 'that batch' if self.batches == 1 else 'those batches'
        if self.update:
            hint = self.update
        elif self.bad_examples:
            hint = _bad_examples_hint(self.bad_examples, self.bad_count,
                                      len(self.examples or ()))
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
                                 else [int(i) for i in self.examples],
                                 "bad_examples": [dict(e) for e in self.bad_examples]}


def _bad_examples_hint(bad: tuple[dict[str, Any], ...], count: int, of: int) -> str:
    """The report's last sentences when some examples are non-finite alone: which rows, their
    one-number leaves (labels) and non-finite inputs, and what to check."""
    def one(e: dict[str, Any]) -> str:
        values = [f"{k}={e[k]!r}" for k in e if k not in ("row", "loss", "nonfinite_inputs")
                  and not k.startswith(("rows_with_", "range_of_"))]
        values += [f"NaN/inf in {k}" for k in e["nonfinite_inputs"]]
        return f"{e['row']}" + (f" ({', '.join(values)})" if values else "")
    named = ", ".join(one(e) for e in bad) + (f", ... ({count} in all)" if count > len(bad)
                                              else "")
    several = count > 1
    text = (f"The loss{'es' if several else ''} of row{'s' if several else ''} {named} alone "
            f"{'are' if several else 'is'} not finite ({count} of the step's {of} examples, "
            "each evaluated as a batch of one)")
    if any(e["nonfinite_inputs"] for e in bad):
        return (text + f": fix or drop {'those rows' if several else 'that row'} of the data "
                "(NaN/inf inputs).")
    labels = dict.fromkeys((k[len("rows_with_"):], e[k[len("rows_with_"):]], e[k])
                           for e in bad for k in e if k.startswith("rows_with_"))
    if labels:
        counts = "; ".join(f"{name}={value!r} in {n} row{'s' if n != 1 else ''} of the data"
                           for name, value, n in labels)
        spans = "; ".join(dict.fromkeys(
            f"{k[len('range_of_'):]} spans {e[k][0]!r}..{e[k][1]!r} in the data"
            for e in bad for k in e if k.startswith("range_of_")))
        return (text + f": check {'those values' if len(labels) > 1 else 'that value'} "
                f"({counts}; {spans}). A class label outside [0, classes) of the model's outputs "
                "(labels numbered from 1, or a class the model does not have) makes "
                "softmax_cross_entropy NaN.")
    return text + ": check those rows of the data."


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
        schedule, or built with ``optax.inject_hyperparams``); empty otherwise (a schedule
        passed straight into optax, ``optax.sgd(schedule)``, is not readable: the step warns
        once and names the fix). Each epoch's
        row then has "learning_rate", the rate of its last update. A schedule counts optimizer
        updates: under `funcgrad.accumulate` one per K batches, and a skipped step does not count.
      skipped_steps: run-wide indices (0-based, every batch counted) of the steps a loss scale
        skipped; each epoch's row then also has "skipped" and "loss_scale".
      dropped_examples: examples left out by an accumulating step's ``tail="drop"`` policy.
      layer_names, step_layer_norm: with a monitored step (``make_train_step(monitor=)``),
        the layers (``params[0]``, ...) and, per applied step, each layer's gradient norm.
      alerts: the monitor's `funcgrad.train.monitor.Alert`s, in step order.
      skipped_batches: with ``fit(..., options=FitOptions(on_nonfinite="skip"))``, one dict
        per non-finite step that was skipped and trained past: "step", "epoch", "batch",
        "loss", "grad_norm", "examples" (the rows of a `Batches`, else None).
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
        from funcgrad.train.alerts import Alert
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
        ``checkpoint=``).
    """
    state: TrainState
    history: History
    nonfinite: NonFiniteReport | None
    interrupted: bool = False


def epoch_row(history: History, epoch: int, run_step: int, first: int, first_skip: int,
              state: Any) -> dict[str, float]:
    """The row of `epoch` (numbered from 1) for ``History.epochs``, from the steps the history
    holds from index `first` on (that epoch's applied steps) and its skipped steps from index
    `first_skip` on; `run_step` is the run's step count at the epoch's end and `state` the
    state there (its loss scale, when it has one)."""
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


def format_epoch(row: Mapping[str, float]) -> str:
    """One line for an epoch's row of the history: ``epoch   3  loss 0.1234  grad_norm ...``."""
    extra = "  ".join(f"{k} {v}" if isinstance(v, (int, np.integer)) else
                      f"{k} {v:.6g}" if k in ("loss_scale", "learning_rate")
                      else f"{k} {v:.4f}"
                      for k, v in row.items() if k not in ("epoch", "steps", "loss", "grad_norm"))
    return (f"epoch {int(row['epoch']):3d}  loss {row['loss']:.4f}  "
            f"grad_norm {row['grad_norm']:.4f}  {extra}").rstrip()

