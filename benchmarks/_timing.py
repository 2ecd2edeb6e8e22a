"""Shared by the benchmarks: timing in shuffled rounds on a noisy machine.

On a small shared machine whichever variant runs first in a round is measurably slower, and
load comes and goes, so every variant runs once per round in an order shuffled each round
(seeded), and results are medians over rounds — of times, or of ratios taken within a round.
"""
import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import jax


def step_args(doc: str, *, steps: int, repeats: int, out: str) -> argparse.Namespace:
    """The command line shared by the step benchmarks: --steps, --repeats, --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="timed rounds (medians reported)")
    parser.add_argument("--out", default=out)
    return parser.parse_args()


def step_runner(step: Callable, state: object, *args: object) -> Callable[[int], object]:
    """``run(n)``: n calls ``state, out = step(state, *args)`` from the carried state; blocks
    on the last state and output. The state carries over from one call of run to the next."""
    carry = [state]

    def run(n):
        s = carry[0]
        for _ in range(n):
            s, out = step(s, *args)
        carry[0] = s
        return jax.block_until_ready((s, out))
    return run


def rounds(runs: dict[str, Callable[[int], object]], n: int, repeats: int, *, warmup: int = 20,
           seed: int = 0) -> dict[str, list[float]]:
    """Seconds per unit of each run, one entry per round.

    Args:
      runs: name -> ``run(n)``, which does n units of work (steps, calls) and blocks until done.
      n: units per timed call.
      repeats: rounds.
      warmup: units each run does once before timing (compilation, caches).
      seed: seed of the shuffled order.
    """
    for run in runs.values():
        run(warmup)
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            runs[name](n)
            times[name].append((time.perf_counter() - start) / n)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """The median of each run's per-round times."""
    return {name: statistics.median(t) for name, t in times.items()}


def paired_ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over rounds of ``times[name] / times[baseline]`` measured in the same round."""
    return statistics.median(a / b for a, b in zip(times[name], times[baseline]))


def ratio_quartiles(times: dict[str, list[float]], name: str,
                    baseline: str) -> tuple[float, float]:
    """25th and 75th percentiles over rounds of ``times[name] / times[baseline]``."""
    q = statistics.quantiles((a / b for a, b in zip(times[name], times[baseline])), n=4)
    return q[0], q[2]


def write_results(path: str, rows: list[dict], **extra: object) -> None:
    """Writes `rows` and the versions and device they were measured on as JSON to `path`."""
    import optax
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, "optax": optax.__version__,
                   "device": str(jax.devices()[0]), "machine": platform.machine(),
                   **extra, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def have_torch() -> bool:
    """Whether PyTorch is installed (the benchmarks then time it beside JAX)."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None
