"""The host's side of `fit`'s chunks: each chunk's rows (one per step: loss, norm, "bad",
"routine", learning rate, monitor values) go into the `History`, the monitor's alerts are
raised and logged, and the first bad step becomes a `NonFiniteReport` naming the step, its
batch, its examples and (array data) which of them are not finite alone.

`Recorder` is the part of a run (`funcgrad.train.loop._epochs._Run`) that does this; it
holds the run's step count and the monitor's last row between chunks.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._paths import key_paths, slash_path
from funcgrad.debug.dead_relu import UNKNOWN_AXIS_NOTE
from funcgrad.train.alerts import monitor_alerts
from funcgrad.train.batching import take_rows
from funcgrad.train.loop._checks import called
from funcgrad.train.loop._chunks import alert_flag
from funcgrad.train.loop.history import NonFiniteReport
from funcgrad.train.monitor import MonitorMetrics
from funcgrad.train.state import TrainState

PyTree = Any

#: How many monitor alerts `fit` passes to its `log`; all are kept in `History.alerts`.
MAX_LOGGED_ALERTS = 20


class Recorder:
    """Records chunks' rows into ``self.history`` (see the module docstring).

    The run that subclasses it sets: ``history`` (a `History`), ``step`` (the train step),
    ``state`` (the current `TrainState`), ``source`` (the `Source`), ``skip_bad``,
    ``run_step`` (steps applied so far), ``bar`` (a tqdm bar), ``say`` (a function of one
    line for the log), ``fast`` and ``runner`` (its `ChunkRunner`s or None) and
    ``previous_report`` (None at the start).
    """
    history: Any
    step: Any
    state: Any
    source: Any
    skip_bad: bool
    run_step: int
    bar: Any
    say: Any
    fast: Any
    runner: Any
    previous_report: Any

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
        if math.isfinite(loss) and math.isfinite(norm):
            update = self.step.explain_skipped_update(self.state, *call)  # which leaf, why
        if anomaly is None and self.step.detect_anomaly:
            # The chunk ran the plain step: the located run is the step with its anomaly
            # detection, once, on this step's state and batch.
            anomaly = called(self.step, self.state, call, first=False)[1].get("anomaly")
        culprits: tuple[dict[str, Any], ...] = ()
        count = 0
        if not math.isfinite(loss) and examples is not None and self.source.tree is not None:
            culprits, count = examples_not_finite(self.step, self.state, self.source.tree,
                                                   examples)
        return NonFiniteReport(self.run_step, epoch, batch_index, loss, norm, anomaly,
                               batches, update, examples, culprits, count), len(taken)

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


def fetched(ran, rows_) -> tuple:
    """A chunk's count and rows on the host, but the monitor's dead-unit masks, which stay on
    the device until a step's alert needs them (one transfer fewer per ReLU site a chunk)."""
    lazy = {"monitor_dead": rows_["monitor_dead"]} if "monitor_dead" in rows_ else {}
    got = jax.device_get((ran, {k: v for k, v in rows_.items() if k not in lazy}))
    return got[0], dict(got[1], **lazy)


def with_ran(got) -> dict[str, Any]:
    """A chunk's ``(count, rows)`` as rows with "ran" (the first `count` steps ran)."""
    count, rows_ = got
    length = len(rows_["loss"])
    return dict(rows_, ran=np.arange(length) < int(count))


def host_row(metrics: Mapping[str, Any], new_state: Any) -> dict[str, Any]:
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


#: Most examples `examples_not_finite` describes (the count says how many there were).
_MAX_BAD_EXAMPLES = 8


def examples_not_finite(step, state: TrainState, tree: PyTree, examples: tuple[int, ...]
                         ) -> tuple[tuple[dict[str, Any], ...], int]:
    """(descriptions, count) of the `examples` (rows of the dataset `tree`) whose loss alone
    is not finite: the step's loss (``step.loss``, a `funcgrad.Loss`) evaluated on each as a
    batch of one, vmapped, at `state` (its model state; the key the step drew). Each
    description is a dict (see `NonFiniteReport.bad_examples`). ((), 0) when every example
    is finite alone, or when that evaluation fails (a loss that needs more than one example)."""
    loss = step.loss
    if loss is None:
        return (), 0
    index = np.asarray(examples)
    batch = take_rows(tree, index)
    key = (jax.random.fold_in(state.key, state.step)
           if getattr(loss, "takes_key", False) and state.key is not None else None)
    one = loss.bind(state.model_state, key)

    def alone(params, row):
        return jnp.reshape(one(params, jax.tree.map(lambda a: a[None], row)), (-1,))
    try:
        with warnings.catch_warnings():  # the step's own trace said what it had to say
            warnings.simplefilter("ignore")
            losses = np.asarray(jax.jit(jax.vmap(alone, in_axes=(None, 0)))(state.params,
                                                                              batch))
    except Exception:  # noqa: BLE001 - a loss that cannot run on one example: no rows named
        return (), 0
    if losses.ndim != 2 or losses.shape[0] != len(index):
        return (), 0
    bad = np.flatnonzero(~np.isfinite(losses).all(axis=1))
    if len(bad) == 0:
        return (), 0
    paths = [slash_path(p) or "data" for p in key_paths(tree)]
    leaves = jax.tree.leaves(batch)
    whole = jax.tree.leaves(tree)
    found = []
    for i in bad[:_MAX_BAD_EXAMPLES]:
        entry: dict[str, Any] = {"row": int(index[i]), "loss": float(losses[i].sum())}
        nonfinite = []
        for name, leaf, data in zip(paths, leaves, whole):
            value = np.asarray(leaf)[i]
            if value.ndim == 0 and value.dtype.kind in "iub":
                entry[name] = value.item()
                entry[f"rows_with_{name}"] = int(np.count_nonzero(np.asarray(data) == value))
                entry[f"range_of_{name}"] = [np.min(data).item(), np.max(data).item()]
            elif value.ndim == 0 and value.dtype.kind == "f":
                entry[name] = value.item()
            if value.dtype.kind in "fc" and not np.isfinite(value).all():
                nonfinite.append(name)
        entry["nonfinite_inputs"] = nonfinite
        found.append(entry)
    return tuple(found), len(bad)
