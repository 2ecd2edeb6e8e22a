"""Where the seconds of ``funcgrad train`` went: data, compile, train, plot, setup."""
from __future__ import annotations

import time
from collections.abc import Callable


class _Clock:
    """Where `_train`'s seconds went, for its last line: the named stretches between calls of
    `lap` (a name may recur), less the time JAX spent tracing, lowering and compiling (or
    loading from its cache), which is reported as "compile": the union of those spans, as
    JAX's monitoring records them (they nest). One listener serves every run of the process
    (a run that raised leaves nothing registered behind it but that)."""

    _EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
               "/jax/core/compile/jaxpr_to_mlir_module_duration",
               "/jax/core/compile/backend_compile_duration")
    _current: "_Clock | None" = None
    _listening = False

    def __init__(self, now: Callable[[], float] = time.time):
        import jax.monitoring

        self.now = now  # JAX's spans are time.time() seconds
        self.start = self.last = now()
        self.laps: list[tuple[str, float, float]] = []
        self.spans: list[tuple[float, float]] = []
        _Clock._current = self
        if not _Clock._listening:
            jax.monitoring.register_event_time_span_listener(_Clock._span)
            _Clock._listening = True

    @staticmethod
    def _span(event: str, start_time: float, end_time: float, **_) -> None:
        if _Clock._current is not None and event in _Clock._EVENTS:
            _Clock._current.spans.append((start_time, end_time))

    def lap(self, name: str) -> None:
        now = self.now()
        self.laps.append((name, self.last, now))
        self.last = now

    def summary(self) -> str:
        _Clock._current = None
        merged: list[list[float]] = []
        for a, b in sorted(self.spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        overlap = lambda a, b: sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)
        parts = {"data": 0.0, "compile": sum(b - a for a, b in merged), "train": 0.0,
                 "plot": 0.0, "setup": 0.0}
        end = self.now()
        for name, a, b in [*self.laps, ("setup", self.last, end)]:
            parts[name] += b - a - overlap(a, b)
        total = end - self.start
        return f"{total:.1f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
