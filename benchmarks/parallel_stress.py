"""Runs the multi-process tests N times in a row and reports every run that hung or failed.

    python benchmarks/parallel_stress.py [-n 50] [--scenarios step,accumulate,...]
                                         [--processes 2] [--out benchmarks/results/...json]

Each run is one ``funcgrad launch`` of tests/parallel/_worker.py per scenario of
tests/parallel/test_distributed.py (default: every one), under the same limits as the tests:
the launcher stops a launch after 60 s (status 124: a hang), this script kills it after 90 s.
A scenario is written ``name``, ``name@N`` (on N processes instead of --processes),
``name!`` (expected to fail, as its test expects: processes running different step counts),
or ``a+b+c``: one launch running a, b and c in turn in the same processes (their collectives
back to back; the limit is --limit times their number), which saves each launch's start-up
(the default runs every passing scenario so, then the two others).
A launch passes when it ends with status 0 within the limit (``name!``: with an error status
other than the limit's 124, within the limit); its result is not re-checked here (the tests
do that). Exit status 1 if any launch did not pass.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "..", "tests", "parallel", "_worker.py")
SCENARIOS = ("step+accumulate+zero+state_keys_scale+mapped+bad+fit+resume+fit_zero+fit_loader"
             "+fit_loader_accumulate+fit_loader_bad,uneven!,smoke@3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=50)
    parser.add_argument("--scenarios", default=SCENARIOS,
                        help="comma-separated; each run runs them all, one launch each")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds per launch")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no run after this many seconds (then report)")
    parser.add_argument("--out", default="benchmarks/results/parallel_stress.json")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    outcomes: list[dict] = []
    began = time.perf_counter()
    for run in range(args.runs):
        if args.max_seconds is not None and time.perf_counter() - began > args.max_seconds:
            print(f"stopping after {run} runs: --max-seconds {args.max_seconds:g}")
            args.runs = run
            break
        for scenario in scenarios:
            names, _, count = scenario.rstrip("!").partition("@")
            failing = scenario.endswith("!")
            limit = args.limit * len(names.split("+"))
            label = (scenario if "+" not in scenario
                     else f"{len(names.split('+'))} scenarios")
            command = [sys.executable, "-m", "funcgrad", "launch", "-n",
                       count or str(args.processes),
                       "--timeout", str(limit), "--init-timeout", "20", "--grace", "2",
                       "--", sys.executable, WORKER, *names.split("+")]
            start = time.perf_counter()
            try:
                done = subprocess.run(command, capture_output=True, text=True,
                                      timeout=limit + 30)
                status = done.returncode
                # The lines that say why (JAX's errors come before its stack traces).
                said = [line for line in done.stderr.splitlines() if any(
                    word in line for word in ("Error", "error", "barrier", "heartbeat",
                                              "Terminating", "DEADLINE", "funcgrad launch"))]
                tail = (("\n".join(said[:30]) + "\n" + done.stdout[-800:])
                        if status and not failing else "")
            except subprocess.TimeoutExpired:
                status, tail = "killed", "the launcher itself did not end"
            seconds = time.perf_counter() - start
            verdict = ("hang" if status in (124, "killed")
                       else "ok" if (status != 0) == failing else "failed")
            outcomes.append({"run": run, "scenario": label, "status": status,
                             "seconds": round(seconds, 2), "verdict": verdict,
                             "why": tail[-3000:]})
            print(f"run {run + 1:>3}/{args.runs} {label:<17} {verdict:<6} {seconds:6.1f} s",
                  flush=True)
            if verdict != "ok":
                print(tail, flush=True)
    bad = [o for o in outcomes if o["verdict"] != "ok"]
    labels = list(dict.fromkeys(o["scenario"] for o in outcomes))
    by_scenario = {s: [o["seconds"] for o in outcomes if o["scenario"] == s] or [0.0]
                   for s in labels}
    runs_ok = sum(all(o["verdict"] == "ok" for o in outcomes if o["run"] == r)
                  for r in range(args.runs))
    print(f"\n{runs_ok}/{args.runs} runs passed every scenario; "
          f"{sum(o['verdict'] == 'hang' for o in outcomes)} hangs, "
          f"{sum(o['verdict'] == 'failed' for o in outcomes)} failures")
    for s, t in by_scenario.items():
        print(f"  {s:<17} median {statistics.median(t):5.1f} s, max {max(t):5.1f} s")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"runs": args.runs, "processes": args.processes, "passed": runs_ok,
                   "outcomes": outcomes}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
