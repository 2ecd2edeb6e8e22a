"""Time and compiled memory of gradient accumulation against a full-batch step on the same data.

For M micro-batches of m digits (m = 32 and 128 by default, M = 4, 8, 16, 32), three ways to
make one Adam update of a 64-128-10 ReLU MLP from the same m*M examples (the 1,437 training
digits repeated where m*M is larger):
  * "full": funcgrad's `make_train_step` on one batch of m*M examples (the baseline);
  * "scan": `make_train_step(funcgrad.accumulate(loss, M), tx)` on the M micro-batches stacked
    ``(M, m, 64)``: one jitted call, a `lax.scan` over the micro-batches, one Adam update;
  * "multisteps": ``optax.MultiSteps(adam, every_k_schedule=M)``, the PyTorch-style loop: M
    jitted calls, one per micro-batch, each running Adam's update (and discarding it M-1 times).
Time is per update: the median over rounds of (repeat time / updates). Each round runs the
three once, in short repeats whose order is shuffled every round (on a 2-core machine whichever
runs first in a round is measurably slower, so a fixed order would bias the ratios); a ratio is
the median over rounds of the two times measured in the same round, so that load from other
processes, which comes and goes over seconds, mostly cancels. Memory is XLA's compiled
temporary bytes (``jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``): the
buffers a call needs besides its arguments and outputs. The criteria of issue 5: scan / full
<= 1.3, and the scan's temporary bytes do not grow with M. Prints a table and writes JSON.

    $ python benchmarks/accumulate.py [--micro 32 128] [--updates 5] [--repeats 61]
                                      [--out benchmarks/results/accumulate.json]
"""
import argparse

import jax
import optax
from _timing import medians, paired_ratio, rounds, step_runner, write_results

import funcgrad as fg

COUNTS = (4, 8, 16, 32)


def _per_example_loss(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(fg.mlp_apply(params, batch["x"]),
                                                           batch["y"])


def _mean_loss(params, batch):
    return _per_example_loss(params, batch).mean()


def _multistepsstep_runner(tx, params, microbatches, count):
    """run(n): n updates of optax.MultiSteps, i.e. n * count jitted mini-step calls."""
    multi = optax.MultiSteps(tx, every_k_schedule=count)

    @jax.jit
    def mini_step(params, opt_state, mb):
        updates, opt_state = multi.update(jax.grad(_mean_loss)(params, mb), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    carry = [params, multi.init(params)]

    def run(n):
        p, o = carry
        for _ in range(n):
            for mb in microbatches:
                p, o = mini_step(p, o, mb)
        carry[:] = p, o
        return jax.block_until_ready(p)
    return run, mini_step.lower(params, multi.init(params), microbatches[0])


def _temp(lowered) -> int:
    return lowered.compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5, help="updates per timed repeat")
    parser.add_argument("--repeats", type=int, default=61, help="timed rounds (medians reported)")
    parser.add_argument("--micro", type=int, nargs="+", default=[32, 128],
                        help="micro-batch sizes (examples per micro-batch)")
    parser.add_argument("--out", default="benchmarks/results/accumulate.json")
    args = parser.parse_args()

    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 128, 10))
    tx = optax.adam(1e-3)
    state = fg.make_train_step(_mean_loss, tx).init(params)  # the state of every step below
    rows = []
    for micro, count in [(m, c) for m in args.micro for c in COUNTS]:
        n = micro * count  # more than the 1,437 training digits for large n: wrap around
        batch = {k: jax.device_put(v.take(range(n), axis=0, mode="wrap"))
                 for k, v in (("x", data.x_train), ("y", data.y_train))}
        stacked = {k: v.reshape(count, micro, *v.shape[1:]) for k, v in batch.items()}
        microbatches = [{k: v[i] for k, v in stacked.items()} for i in range(count)]
        full = fg.make_train_step(_mean_loss, tx)
        scan = fg.make_train_step(fg.accumulate(_per_example_loss, count), tx)
        multi_run, multi_lowered = _multistepsstep_runner(tx, params, microbatches, count)
        times = rounds({"full": step_runner(full, state, batch),
                        "scan": step_runner(scan, state, stacked), "multisteps": multi_run},
                       args.updates, args.repeats, warmup=3)
        t = medians(times)
        rows.append({
            "model": "64-128-10 relu, adam", "micro_batch": micro, "micro_batches": count,
            "examples": n, **{f"{k}_ms_per_update": 1e3 * v for k, v in t.items()},
            "scan_over_full": paired_ratio(times, "scan", "full"),
            "multisteps_over_full": paired_ratio(times, "multisteps", "full"),
            "full_temp_bytes": _temp(full.lower(state, batch)),
            "scan_temp_bytes": _temp(scan.lower(state, stacked)),
            "multisteps_temp_bytes_per_call": _temp(multi_lowered),
            "repeats": args.repeats, "updates_per_repeat": args.updates})

    print(f"{'micro':>6}{'M':>4}{'examples':>9}{'full ms':>10}{'scan ms':>10}"
          f"{'MultiSteps ms':>15}{'scan/full':>11}{'MS/full':>9}   "
          f"{'temp full':>10}{'temp scan':>10}{'temp MS':>9}")
    for r in rows:
        print(f"{r['micro_batch']:>6}{r['micro_batches']:>4}{r['examples']:>9}"
              f"{r['full_ms_per_update']:>10.3f}{r['scan_ms_per_update']:>10.3f}"
              f"{r['multisteps_ms_per_update']:>15.3f}"
              f"{r['scan_over_full']:>11.3f}{r['multisteps_over_full']:>9.3f}   "
              f"{r['full_temp_bytes']:>10,}{r['scan_temp_bytes']:>10,}"
              f"{r['multisteps_temp_bytes_per_call']:>9,}")
    worst = max(r["scan_over_full"] for r in rows)
    flat = True  # for each micro-batch size: no M needs more temp bytes than the smallest M
    for m in args.micro:
        temps = [r["scan_temp_bytes"] for r in rows if r["micro_batch"] == m]
        flat = flat and max(temps) <= temps[0]
    print("ms per Adam update of a 64-128-10 ReLU MLP over micro*M digits (medians); temp = "
          "compiled temporary bytes\n(MultiSteps: per mini-step call, M calls per update); "
          "ratios: median over rounds of the two times of each round")
    print(f"criteria: scan/full <= 1.3: worst {worst:.3f} {'ok' if worst <= 1.3 else 'FAILED'}; "
          f"scan temp bytes not growing with M: {'ok' if flat else 'FAILED'}")
    write_results(args.out, rows, criteria={"max_scan_over_full": worst,
                                            "scan_over_full_ok": worst <= 1.3,
                                            "scan_temp_flat": flat})


if __name__ == "__main__":
    main()
