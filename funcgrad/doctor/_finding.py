"""One check's result: a `Finding`, its verdict (`VERDICTS`, worst first), and its JSON form.

The verdicts, from worst: "fail" (the evidence shows a fault), "error" (the check itself
crashed on this model: the reason is the finding), "warn" (the evidence suggests a fault a
reviewer should look at), "pass", "skipped" (the check does not apply; the summary says why).
Only "fail" changes the exit status: a CI gate on `DoctorReport.exit_code` stops on faults
that are certain, not on advice.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

#: The checks, in the order of the report (concept 23 of CONCEPTS.md; the article's B5.3).
CHECKS = ("data", "init_loss", "grad_flow", "fd_audit", "nonfinite", "grad_stats", "training",
          "overfit", "baseline", "semantics", "memory")

#: The verdicts, worst first: the table lists findings in this order.
VERDICTS = ("fail", "error", "warn", "pass", "skipped")


@dataclasses.dataclass
class Finding:
    """One check's result.

    Attributes:
      check: the check's name, one of `funcgrad.doctor.CHECKS`.
      verdict: "pass", "warn", "fail", "skipped" or "error" (see the module docstring).
      summary: one sentence: what was found (for "skipped", why; for "error", the reason).
      evidence: the numbers behind the verdict, JSON-able (floats, ints, strings, lists, dicts).
      place: where the fault is, with any of the keys "leaf" (the leaf path as funcgrad's
        reports print it, e.g. ``params['dense2']['w']``), "layer" (the leaf's parent,
        ``params['dense2']``), "line" (``model.py:23``) and "primitive" (``log``); {} when
        there is nothing to place.
      fix: what to do, in words (and code); "" when there is nothing to do.
      seconds: wall-clock time the check took, in seconds.
    """
    check: str
    verdict: str
    summary: str
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    place: dict[str, str] = dataclasses.field(default_factory=dict)
    fix: str = ""
    seconds: float = 0.0

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Finding: verdict must be one of {VERDICTS}, got {self.verdict!r}.")

    def to_dict(self) -> dict[str, Any]:
        return _strict_json(dataclasses.asdict(self))


def _strict_json(value: Any) -> Any:
    """`value` with NaN and inf as None, tuples as lists and NumPy scalars as Python numbers."""
    if isinstance(value, dict):
        return {str(k): _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
