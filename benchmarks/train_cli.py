"""Wall time of the whole `funcgrad train` command with its default settings (issue 15: at most
3.0 s, median of 5 warm runs).

Each run is a fresh process, ``python -m funcgrad train --out DIR`` (the 64-128-10 MLP on
digits, 30 epochs, the gradient monitor, an evaluation per epoch, metrics.json and
training.png), timed from before the process starts until it has exited. One cold run comes
first, with an empty cache folder (FUNCGRAD_CACHE_DIR set to a new temporary folder, so the
command line is the default one): it fills the caches (the digits split, JAX's compiled
programs) and warms the disk; then --runs warm runs. Reported per run: wall seconds, the
child's CPU seconds (user + system, all its threads) and peak RSS (os.wait4's rusage of that
child alone), and the CLI's own breakdown from its last line (data, compile = JAX's tracing,
lowering and compiling or loading from the cache, train = fit less its compiling, plot);
"startup" is the wall time outside `_train`: the interpreter, the imports and the exit. The
machine's load average is recorded: this is a 2-core machine shared with other jobs, and a
loaded core shows in every column.

    $ python benchmarks/train_cli.py [--runs 5] [--out benchmarks/results/train_cli.json]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

LIMIT_S = 3.0
#: The CLI's last line: "... (2.9 s: data 0.01 s, compile 0.62 s, train 1.55 s, plot 0.48 s)".
_BREAKDOWN = re.compile(r"\((?P<total>[\d.]+) s: (?P<parts>[^)]*)\)\s*$")


def _run(out: str, env: dict, cwd: str) -> dict:
    """One `funcgrad train --out OUT` in a fresh process: wall s, peak RSS MiB, breakdown.
    It runs in `cwd`, not here: ``python -m`` puts its working folder first on sys.path, so
    from the repository root it would import this checkout whatever PYTHONPATH says."""
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "funcgrad", "train", "--out", out],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"funcgrad train exited {proc.returncode}:\n{text}")
    row = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
           "peak_rss_mib": usage.ru_maxrss / 1024}  # Linux: KiB
    found = _BREAKDOWN.search(text.strip().splitlines()[-1])
    if found:
        row["in_train_s"] = float(found["total"])
        row["startup_s"] = wall - row["in_train_s"]
        for part in found["parts"].split(","):
            name, seconds, _ = part.split()
            row[f"{name}_s"] = float(seconds)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="warm runs (median reported)")
    parser.add_argument("--out", default="benchmarks/results/train_cli.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="funcgrad-bench-") as tmp:
        env = {**os.environ, "FUNCGRAD_CACHE_DIR": os.path.join(tmp, "cache")}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the run's own cache, as for a user
        where = subprocess.run([sys.executable, "-c", "import funcgrad; print(funcgrad.__file__)"],
                               env=env, cwd=tmp, capture_output=True, text=True, check=True)
        funcgrad_file = where.stdout.strip()
        load_before = os.getloadavg()
        cold = _run(os.path.join(tmp, "run"), env, tmp)
        warm = [_run(os.path.join(tmp, "run"), env, tmp) for _ in range(args.runs)]
        load_after = os.getloadavg()

    columns = [c for c in ("wall_s", "cpu_s", "startup_s", "data_s", "compile_s", "train_s",
                           "plot_s", "peak_rss_mib") if c in cold]
    print(f"funcgrad train --out DIR (defaults; {funcgrad_file}), {args.runs} warm runs "
          "after one cold; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"{'run':>8} " + " ".join(f"{c:>12}" for c in columns))
    for name, row in [("cold", cold), *((f"warm {i + 1}", r) for i, r in enumerate(warm))]:
        print(f"{name:>8} " + " ".join(f"{row[c]:12.2f}" for c in columns))
    summary = {c: {"median": statistics.median(r[c] for r in warm),
                   "min": min(r[c] for r in warm), "max": max(r[c] for r in warm)}
               for c in columns}
    for stat in ("median", "min", "max"):
        print(f"{stat:>8} " + " ".join(f"{summary[c][stat]:12.2f}" for c in columns))
    median = summary["wall_s"]["median"]
    print(f"warm median {median:.2f} s: {'meets' if median <= LIMIT_S else 'misses'} "
          f"the {LIMIT_S} s target")

    from importlib import metadata
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python -m funcgrad train --out DIR", "funcgrad": funcgrad_file,
                   "limit_s": LIMIT_S,
                   "versions": {p: metadata.version(p) for p in
                                ("jax", "jaxlib", "ml_dtypes", "numpy", "scikit-learn",
                                 "matplotlib")},
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "cpus": os.cpu_count(),
                   "load_average": {"before": load_before, "after": load_after},
                   "cold": cold, "warm": warm, "summary": summary,
                   "meets_limit": median <= LIMIT_S}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
