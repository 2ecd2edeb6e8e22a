"""Runs tests/parallel/_worker.py under ``funcgrad launch``, failing a run that hangs (its
processes stop using CPU) but never one that is only slow, and parses its ``RESULT`` lines
(one per process)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_worker.py")
#: A run is hung when its processes together used less than `IDLE_CPU` seconds of CPU in the
#: last `STALL` seconds: a deadlock waits on a socket or a barrier, where JAX's runtime threads
#: still use 1-2 s a minute (seen: 2 processes deadlocked in gloo all-reduces, 9 s of CPU each
#: in 13 min); a slow run on a loaded machine still computes (at a load of 10 on 2 cores each
#: process gets ~20 s of CPU in 120 s), and is not failed for being slow.
STALL = 120
IDLE_CPU = 10.0
#: A last backstop against a run that spins without end (never reached by a working run: the
#: slowest scenario takes about 20 s alone, 60 s at a load of 10 on 2 cores).
BACKSTOP = 1800


def _cpu_seconds(root: int) -> float:
    """The CPU time (user + system, s) of `root` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # the process ended meanwhile
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent
        ticks[pid] = int(fields[11]) + int(fields[12])       # utime + stime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def run_watched(command: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `command`; fails the test when its processes stop using CPU for `STALL` s."""
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        out: list[str] = []
        readers = [threading.Thread(target=lambda s=stream, o=i: out.append((o, s.read())),
                                    daemon=True)
                   for i, stream in enumerate((proc.stdout, proc.stderr))]
        for r in readers:
            r.start()
        samples: list[tuple[float, float]] = []  # (time, CPU seconds so far)
        while proc.poll() is None:
            time.sleep(2)
            now = time.perf_counter()
            samples.append((now, _cpu_seconds(proc.pid)))
            while len(samples) > 1 and samples[1][0] <= now - STALL:
                samples.pop(0)  # samples[0]: the last one at least STALL s old
            stalled = (samples[0][0] <= now - STALL
                       and samples[-1][1] - samples[0][1] < IDLE_CPU)
            if stalled or now - start > BACKSTOP:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                for r in readers:
                    r.join(5)
                text = dict(out)
                why = (f"its processes used under {IDLE_CPU} s of CPU in {STALL} s (a hang)"
                       if stalled else f"it ran past the {BACKSTOP} s backstop")
                pytest.fail(f"funcgrad launch was stopped: {why}; output:\n"
                            f"{text.get(0, '')[-3000:]}\n{text.get(1, '')[-3000:]}")
        for r in readers:
            r.join()
    text = dict(out)
    done = subprocess.CompletedProcess(command, proc.returncode, text.get(0, ""),
                                       text.get(1, ""))
    return done, time.perf_counter() - start


def launch(*scenarios: str, n: int = 2, failing: bool = False
           ) -> tuple[list[dict], float] | tuple[Any, float]:
    """The RESULT of each process (ordered by process index) and the run's wall time; with
    `failing`, the finished launcher process (a run expected to fail) instead of results.
    A run is failed for hanging (`STALL`), never for being slow."""
    command = [sys.executable, "-m", "funcgrad", "launch", "-n", str(n), "--init-timeout",
               "120", "--grace", "2", "--", sys.executable, WORKER, *scenarios]
    done, seconds = run_watched(command)
    if failing:
        return done, seconds
    if done.returncode != 0:
        pytest.fail(f"the {n}-process run of {scenarios} ended with status {done.returncode} "
                    f"after {seconds:.1f} s:\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    results = {}
    for line in done.stdout.splitlines():
        head, _, rest = line.partition("] RESULT ")
        if rest:
            results[int(head.strip("[ "))] = json.loads(rest)
    assert sorted(results) == list(range(n)), done.stdout[-3000:] + done.stderr[-3000:]
    return [results[i] for i in range(n)], seconds
