"""What the checks share while a doctor runs: the subject, the options, the batches they
examine, leaf names and places, and results one check hands to another."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from funcgrad._paths import leaf_names
from funcgrad.doctor._options import DoctorOptions
from funcgrad.doctor._places import layer_of, leaf_lines
from funcgrad.doctor._subject import Subject


@dataclasses.dataclass
class Context:
    """One doctor run's shared state (see the module docstring)."""
    subject: Subject
    options: DoctorOptions
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)
    curves: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.paths = leaf_names(self.subject.params)
        self.trained = self.subject.trained()
        self.tiny = self.subject.data.rows(self.options.tiny_rows)
        self.batch = self.subject.data.rows(self.options.check_rows)
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
