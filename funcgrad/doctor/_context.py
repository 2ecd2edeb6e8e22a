"""What the checks share while a doctor runs: the subject, the options, the batches they
examine, leaf names and places, and results one check hands to another."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from funcgrad._paths import leaf_names
from funcgrad.doctor._places import layer_of, leaf_lines
from funcgrad.doctor._subject import Subject

#: The options of `funcgrad.doctor.doctor` and their defaults (budgets and thresholds).
DEFAULTS: dict[str, Any] = {
    "steps": 100,              # training check: optimizer steps
    "overfit_steps": 300,      # overfit check: the most steps on one small batch
    "overfit_rows": 16,        # overfit check: examples in the batch to overfit
    "tiny_rows": 8,            # grad_flow, fd_audit: the tiny batch
    "check_rows": 64,          # init_loss, grad_stats, nonfinite: the examination batch
    "max_full_elements": 12_000,  # fd_audit: full check up to this many elements
    "max_evaluations": 4_000,  # fd_audit: directional budget (function evaluations)
    "init_loss_ratio": 2.0,    # init_loss: warn when loss / log(K) is above this or below 1/it
    "overfit_ratio": 0.2,      # overfit: the loss must fall below this fraction of its start
    "clip_quantile": 0.9,      # training: clipping advice at this quantile of the norms
}


@dataclasses.dataclass
class Context:
    """One doctor run's shared state (see the module docstring)."""
    subject: Subject
    options: dict[str, Any]
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)
    curves: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.paths = leaf_names(self.subject.params)
        self.trained = self.subject.trained_paths(self.paths)
        self.tiny = self.subject.data.rows(self.options["tiny_rows"])
        self.batch = self.subject.data.rows(self.options["check_rows"])
        self._lines: dict[int, str] | None = None

    def place(self, path: str, **extra: str) -> dict[str, str]:
        """{"leaf", "layer", "line"} of a leaf path (line where known), plus `extra`."""
        out = {"leaf": path, "layer": layer_of(path)}
        line = self.line_of(path)
        if line:
            out["line"] = line
        return out | {k: v for k, v in extra.items() if v}

    def line_of(self, path: str) -> str:
        if self._lines is None:
            try:
                self._lines = leaf_lines(self.subject.scalar_loss(), self.subject.params,
                                         self.tiny, self.subject.source)
            except Exception:  # noqa: BLE001 - a line is a courtesy, not a check
                self._lines = {}
        try:
            return self._lines.get(self.paths.index(path), "")
        except ValueError:
            return ""

    def leaves(self) -> list[Any]:
        return jax.tree.leaves(self.subject.params)
