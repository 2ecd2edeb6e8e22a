"""Runs tests/parallel/_worker.py under ``funcgrad launch`` with hard limits, and parses its
``RESULT`` lines (one per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_worker.py")
#: The launcher stops the run after this many seconds (a deadlock ends as a failure)...
RUN_LIMIT = 60
#: ...and this process kills the launcher if even that did not end it.
HARD_LIMIT = 90


def launch(*scenarios: str, n: int = 2, limit: float = RUN_LIMIT,
           failing: bool = False) -> tuple[list[dict], float] | tuple[Any, float]:
    """The RESULT of each process (ordered by process index) and the run's wall time; with
    `failing`, the finished launcher process (a run expected to fail) instead of results."""
    command = [sys.executable, "-m", "funcgrad", "launch", "-n", str(n), "--timeout",
               str(limit), "--init-timeout", "20", "--grace", "2", "--",
               sys.executable, WORKER, *scenarios]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=HARD_LIMIT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"funcgrad launch did not end within {HARD_LIMIT} s; output:\n"
                    f"{(e.stdout or '')[-3000:]}\n{(e.stderr or '')[-3000:]}")
    seconds = time.perf_counter() - start
    if failing:
        return done, seconds
    if done.returncode != 0:
        pytest.fail(f"the {n}-process run of {scenarios} ended with status {done.returncode} "
                    f"after {seconds:.1f} s (124: it hit the {limit} s limit, a hang):\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    results = {}
    for line in done.stdout.splitlines():
        head, _, rest = line.partition("] RESULT ")
        if rest:
            results[int(head.strip("[ "))] = json.loads(rest)
    assert sorted(results) == list(range(n)), done.stdout[-3000:] + done.stderr[-3000:]
    return [results[i] for i in range(n)], seconds
