"""A doctor's report: the findings of one run, shown as a table, JSON or HTML.

Each finding is a `funcgrad.doctor.Finding` (``_finding.py``: the verdicts and what they mean).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from funcgrad.doctor._finding import VERDICTS, Finding, _strict_json


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
