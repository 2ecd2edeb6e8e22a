"""funcgrad.micro against its targets: jax.grad on 1,000 random programs, a 100,000-deep
chain, the digits MLP.

  * programs: hypothesis draws 1,000 programs over every op and broadcast shape
    (tests/_micro_programs.py); each is differentiated by micro and by jax.grad in float64
    (x64 scoped); the largest relative error (target <= 1e-12) and the ops covered.
  * chain: z <- z * a, 100,000 times; backward time (median of 5; target < 1 s), and what a
    recursive topological sort (micrograd's) does on the same graph.
  * digits: examples/23_micro.py's MLP trained with micro for seeds 0-4: test accuracy
    (target >= 0.97) and training time (target <= 20 s).

    $ python benchmarks/micro.py [--programs 1000] [--out benchmarks/results/micro.json]
"""
import argparse
import collections
import contextlib
import importlib.util
import io
import math
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))
sys.path.insert(0, HERE)

import _micro_programs as programs  # noqa: E402
from _timing import write_results  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from funcgrad import micro  # noqa: E402


def random_programs(n: int) -> dict:
    errors, ops, skipped, seconds = [], collections.Counter(), [0], {"micro": 0.0, "jax": 0.0}

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs.programs())
    def one(program):
        shapes, steps, seed = program
        xs = programs.inputs(shapes, seed)
        start = time.perf_counter()
        loss_ref, refs = programs.jax_grads(steps, xs)
        seconds["jax"] += time.perf_counter() - start
        if not (np.isfinite(loss_ref) and all(np.isfinite(r).all() for r in refs)):
            skipped[0] += 1
            return
        start = time.perf_counter()
        with np.errstate(over="ignore"):
            loss, grads = programs.micro_grads(steps, xs)
        seconds["micro"] += time.perf_counter() - start
        errors.append(max(programs.relative_errors(grads, refs)
                          + [abs(loss - loss_ref) / max(abs(loss_ref), 1e-3)]))
        ops.update(op for op, *_ in steps)

    one()
    return {"programs": len(errors), "skipped_nonfinite": skipped[0],
            "max_relative_error": max(errors), "over_1e-12": sum(e > 1e-12 for e in errors),
            "median_relative_error": statistics.median(errors),
            "ops_covered": len(ops), "ops_total": len(programs.OPS),
            "micro_seconds": seconds["micro"], "jax_seconds": seconds["jax"]}


def _recursive_order(root):
    """micrograd's topological sort (recursive), on micro's graph, for comparison."""
    order, seen = [], set()

    def visit(v):
        if id(v) not in seen:
            seen.add(id(v))
            for p in v.parents:
                visit(p)
            order.append(v)
    visit(root)
    return order


def chain(depth: int = 100_000, repeats: int = 5) -> dict:
    times, builds = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        z0 = micro.Tensor(1.0, requires_grad=True)
        z, a = z0, 1.0 + 1e-5
        for _ in range(depth):
            z = z * a
        builds.append(time.perf_counter() - start)
        start = time.perf_counter()
        z.backward()
        times.append(time.perf_counter() - start)
        error = abs(float(z0.grad) - math.exp(depth * math.log(a))) / math.exp(depth * math.log(a))
    try:
        _recursive_order(z)
        recursive = "ok"
    except RecursionError:
        recursive = f"RecursionError (limit {sys.getrecursionlimit()})"
    return {"depth": depth, "backward_seconds": statistics.median(times),
            "forward_seconds": statistics.median(builds), "relative_error": error,
            "recursive_sort": recursive}


def digits(seeds=range(5)) -> dict:
    import funcgrad as fg
    spec = importlib.util.spec_from_file_location(
        "micro_example", os.path.join(HERE, os.pardir, "examples", "23_micro.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from _check import Check
    data = fg.load_digits(seed=0)
    accuracies, seconds = [], []
    for seed in seeds:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            start = time.perf_counter()
            example.train_digits(Check(""), data, seed=seed)
            seconds.append(time.perf_counter() - start)
        line = next(line for line in out.getvalue().splitlines() if "test accuracy" in line)
        accuracies.append(float(line.split("test accuracy ")[1].split()[0]))
    return {"seeds": list(seeds), "accuracies": accuracies, "min_accuracy": min(accuracies),
            "median_seconds": statistics.median(seconds), "max_seconds": max(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "micro.json"))
    args = parser.parse_args()
    p, c, d = random_programs(args.programs), chain(), digits()
    rows = [
        {"claim": "jax.grad on random programs", "value": p["max_relative_error"],
         "target": "<= 1e-12", "ok": p["max_relative_error"] <= 1e-12 and p["programs"] >= 1000,
         **p},
        {"claim": "100,000-deep chain backward, s", "value": c["backward_seconds"],
         "target": "< 1", "ok": c["backward_seconds"] < 1.0, **c},
        {"claim": "digits MLP test accuracy (min of 5 seeds)", "value": d["min_accuracy"],
         "target": ">= 0.97", "ok": d["min_accuracy"] >= 0.97, **d},
        {"claim": "digits MLP training time, s (max of 5 seeds)", "value": d["max_seconds"],
         "target": "<= 20", "ok": d["max_seconds"] <= 20.0},
    ]
    print(f"{'claim':<46}{'value':>12}  {'target':<10} ok")
    for r in rows:
        print(f"{r['claim']:<46}{r['value']:>12.4g}  {r['target']:<10} {r['ok']}")
    print(f"programs: {p['programs']} compared ({p['skipped_nonfinite']} skipped: non-finite "
          f"reference), {p['ops_covered']}/{p['ops_total']} ops, median error "
          f"{p['median_relative_error']:.2g}; micro {p['micro_seconds']:.1f} s, "
          f"jax.grad (eager) {p['jax_seconds']:.1f} s")
    print(f"chain: forward {c['forward_seconds']:.2f} s, backward {c['backward_seconds']:.2f} s, "
          f"relative error {c['relative_error']:.1g}; recursive sort: {c['recursive_sort']}")
    print(f"digits: accuracies {d['accuracies']}, median {d['median_seconds']:.2f} s")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
