"""Fuzzes every public tool of funcgrad with hypothesis: calls per tool, right answers, clear
errors, wrong answers and internal crashes, as a table and as JSON.

The cases and the judging are tests/_fuzz_cases.py's (the same as tests/test_fuzz.py's, with
more examples): each call either gives the answer derived without funcgrad (jax.grad, the
function's value, the arguments' shapes) or raises one of funcgrad's documented errors, or a
TypeError/ValueError raised by funcgrad's own code; anything else is a crash.

    $ python benchmarks/fuzz.py [--examples 400] [--tools trace,remat] [--float16]
          [--out benchmarks/results/fuzz.json]

Exit status 1 when any call crashed or answered wrong (each is printed).
"""
import argparse
import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

import _fuzz_cases as fz  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

KINDS = ("right", "clear", "wrong", "crash")


def fuzz(tool: str, examples: int, float16: bool, seed: int) -> tuple[collections.Counter, list]:
    counts: collections.Counter = collections.Counter()
    problems: list = []
    run = fz.TOOLS.get(tool, fz.run_interop)
    strategy = fz.interop_cases() if tool == "interop" else fz.cases(float16=float16)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed == 0,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case):
        outcome = run(case)
        counts[outcome.kind] += 1
        if outcome.kind in ("wrong", "crash"):
            problems.append({"tool": tool, "kind": outcome.kind, "detail": outcome.detail,
                             "case": case.describe() if tool != "interop" else repr(case)})

    one()
    return counts, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400, help="examples per tool")
    parser.add_argument("--tools", default=",".join([*fz.TOOLS, "interop"]),
                        help="comma-separated; 'interop' fuzzes from_linen/from_nnx/from_equinox")
    parser.add_argument("--float16", action="store_true", help="add a float16 leaf to each case")
    parser.add_argument("--seed", type=int, default=0, help="0: derandomized (reproducible)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "fuzz.json"))
    args = parser.parse_args()
    rows, problems, start = {}, [], time.perf_counter()
    print(f"{'tool':<26}{'calls':>7}" + "".join(f"{k:>8}" for k in KINDS) + f"{'seconds':>9}")
    for tool in args.tools.split(","):
        t0 = time.perf_counter()
        counts, found = fuzz(tool, args.examples, args.float16, args.seed)
        seconds = time.perf_counter() - t0
        rows[tool] = {"calls": sum(counts.values()), **{k: counts[k] for k in KINDS},
                      "seconds": round(seconds, 1)}
        problems += found
        print(f"{tool:<26}{rows[tool]['calls']:>7}" + "".join(f"{counts[k]:>8}" for k in KINDS)
              + f"{seconds:>9.1f}", flush=True)
    total = sum(r["calls"] for r in rows.values())
    print(f"{'all':<26}{total:>7}" + "".join(f"{sum(r[k] for r in rows.values()):>8}"
                                              for k in KINDS)
          + f"{time.perf_counter() - start:>9.1f}")
    for p in problems:
        print(f"\n{p['kind'].upper()} {p['tool']}: {p['case']}\n  {p['detail']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"examples_per_tool": args.examples, "float16": args.float16,
                   "seed": args.seed, "tools": rows, "problems": problems}, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
