"""The gradient monitor's alerts, on the host: `monitor_alerts` turns one step's
`funcgrad.MonitorMetrics` into `Alert` objects whose ``str`` is a readable line (the rules are
in `funcgrad.train.monitor`)."""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from funcgrad.debug.dead_relu import UNKNOWN_AXIS_NOTE
from funcgrad.train.monitor import MonitorMetrics

#: Alert kinds, in the order `monitor_alerts` reports them within a step.
ALERT_KINDS = ("nonfinite", "explosion", "vanishing", "dead_relu")


@dataclasses.dataclass(frozen=True)
class Alert:
    """One alert of the monitor, ready to print with ``str(alert)``.

    Attributes:
      step: index of the step (0-based).
      kind: one of `ALERT_KINDS`.
      where: "global", a layer (``params[0]``) or a ReLU site (``relu 0 at mlp.py:96 ...``).
      value: the measured value (a norm in gradient units, or a dead fraction).
      threshold: what it was compared with, in the same units.
      detail: the comparison in words.
    """
    step: int
    kind: str
    where: str
    value: float
    threshold: float
    detail: str = ""

    def __str__(self) -> str:
        return (f"step {self.step}: {self.kind} at {self.where}: value {self.value:.4g}, "
                f"threshold {self.threshold:.4g} ({self.detail})")


def monitor_alerts(metrics: MonitorMetrics, *,
                   previous: MonitorMetrics | None = None) -> list[Alert]:
    """The alerts of one step's `MonitorMetrics` (device or host arrays), in `ALERT_KINDS` order.

    ``nonfinite`` and ``explosion`` are reported on every step that has them; ``vanishing`` on
    the step a layer's streak (below the floor and below ``vanish_ratio`` x the global norm)
    reaches ``vanish_steps``, once per streak; ``dead_relu`` when a
    site's dead fraction reaches ``dead_threshold``: on every step, or, given the `previous`
    step's metrics, only on the step it crosses the threshold. A site whose feature axis was
    not found from the program (its name says so; its units are the last axis) alerts only
    when all its units are dead, i.e. every value of its input is <= 0, true along any axis.
    Metrics stacked by ``lax.scan`` (a leading step axis) give the alerts of every step, each
    step the previous of the next.
    """
    m = jax.device_get(metrics)
    if np.ndim(m.values) > 1:
        out, prev = [], previous
        values = np.reshape(m.values, (-1, np.shape(m.values)[-1]))
        dead = [np.reshape(d, (len(values), -1)) for d in m.dead]
        for i in range(len(values)):
            row = MonitorMetrics(values[i], tuple(d[i] for d in dead), m.layout)
            out += monitor_alerts(row, previous=prev)
            prev = row
        return out
    step = int(m.step)
    out = []
    if bool(m.nonfinite):
        out.append(Alert(step, "nonfinite", "global", float(m.grad_norm), math.inf,
                         f"grad_norm {float(m.grad_norm):.4g}, loss {float(m.loss):.4g}; "
                         "a NaN or inf"))
    if bool(m.explosion):
        limit = m.explode_factor * float(m.baseline)
        out.append(Alert(step, "explosion", "global", float(m.grad_norm), limit,
                         f"grad_norm > {m.explode_factor:g} x baseline {float(m.baseline):.4g}"))
    for name, hit, norm in zip(m.layer_names, np.asarray(m.vanishing), np.asarray(m.layer_norm)):
        if hit:
            out.append(Alert(step, "vanishing", name, float(norm), m.vanish_floor,
                             f"layer norm < floor and < {m.vanish_ratio:g} x the global norm "
                             f"for {m.vanish_steps} steps"))
    before = (np.asarray(previous.dead_fraction) if previous is not None
              else np.full(len(m.relu_names), -1.0))
    for name, frac, prev in zip(m.relu_names, np.asarray(m.dead_fraction), before):
        # A site whose feature axis was not found counts along its last axis, a number that
        # means nothing for another layout; "all of them dead" (every value <= 0) is the one
        # reading that holds along any axis, so only that raises the alert there.
        limit = 1.0 if UNKNOWN_AXIS_NOTE in name else m.dead_threshold
        if frac >= limit and not prev >= limit:
            out.append(Alert(step, "dead_relu", name, float(frac), limit,
                             f"{100 * float(frac):.0f}% of units dead for the whole batch"
                             + ("; feature axis unknown: every value <= 0"
                                if limit != m.dead_threshold else "")))
    return out
