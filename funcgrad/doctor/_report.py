"""A doctor's findings and their report: one `Finding` per check, shown as a table, JSON or HTML.

The verdicts, from worst: "fail" (the evidence shows a fault), "error" (the check itself
crashed on this model: the reason is the finding), "warn" (the evidence suggests a fault a
reviewer should look at), "pass", "skipped" (the check does not apply; the summary says why).
Only "fail" changes the exit status: a CI gate on `DoctorReport.exit_code` stops on faults
that are certain, not on advice.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
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


@dataclasses.dataclass
class DoctorReport:
    """What `funcgrad.doctor` returns: the findings, in `funcgrad.doctor.CHECKS` order.

    Attributes:
      findings: one `Finding` per check that was asked for.
      subject: a line describing the model examined (its file, params, data).
      seconds: wall-clock time of the whole run, in seconds (setup included).
      curves: what the HTML report plots: per training step "loss", "grad_norm",
        "layer_norm" ({layer: [norm per step]}), "dead_fraction" ({ReLU site: [fraction per
        step]}), and "init_layer_norm" ({layer: norm at init}); missing when not recorded.
      source: the model file examined, or None; the HTML report quotes its lines.
    """
    findings: list[Finding]
    subject: str = ""
    seconds: float = 0.0
    curves: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str | None = None

    @property
    def exit_code(self) -> int:
        """1 when a check failed; else 3 when a check crashed (verdict "error": the checklist
        is incomplete, so a CI gate must not pass it as healthy); else 0 (warnings do not fail
        a run)."""
        if any(f.verdict == "fail" for f in self.findings):
            return 1
        return 3 if any(f.verdict == "error" for f in self.findings) else 0

    def by_check(self, name: str) -> Finding:
        """The finding of the check `name`; KeyError (naming the checks run) if it did not run."""
        for finding in self.findings:
            if finding.check == name:
                return finding
        raise KeyError(f"no finding of check {name!r}; the report has "
                       f"{[f.check for f in self.findings]}")

    def table(self) -> str:
        """The terminal summary: one line per check, worst verdicts first, with the time each
        took, then each finding's place and fix."""
        order = sorted(self.findings, key=lambda f: VERDICTS.index(f.verdict))
        width = max([len("check")] + [len(f.check) for f in order])
        lines = [f"funcgrad doctor: {self.subject}" if self.subject else "funcgrad doctor",
                 f"  {'check':<{width}}  {'verdict':<8}{'time':>7}  summary"]
        for f in order:
            lines.append(f"  {f.check:<{width}}  {f.verdict.upper():<8}{f.seconds:>6.1f}s  "
                         f"{f.summary}")
        for f in order:
            if f.verdict in ("fail", "warn", "error") and (f.place or f.fix):
                where = ", ".join(f"{k} {v}" for k, v in f.place.items())
                lines.append(f"  {f.check}: " + (f"at {where}. " if where else "") + f.fix)
        counts = {v: sum(f.verdict == v for f in self.findings) for v in VERDICTS}
        lines.append("  " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
                     + f"; {self.seconds:.1f} s in all; exit status {self.exit_code}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return _strict_json({"subject": self.subject, "seconds": self.seconds,
                             "exit_code": self.exit_code,
                             "findings": [dataclasses.asdict(f) for f in self.findings],
                             "curves": self.curves})

    def to_json(self, path: str | os.PathLike) -> str:
        """Writes the report as JSON (NaN and inf as null) to `path`; returns the path."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
        return os.fspath(path)

    def to_html(self, path: str | os.PathLike) -> str:
        """Writes a self-contained HTML page (plots embedded as PNG data URIs; needs
        matplotlib) to `path`; returns the path."""
        from funcgrad.doctor._html import render

        with open(path, "w", encoding="utf-8") as f:
            f.write(render(self))
        return os.fspath(path)


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
