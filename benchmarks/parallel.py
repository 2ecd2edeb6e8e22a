"""Data-parallel train steps per second on 1, 2 and 4 processes (one CPU device each, gloo).

    python benchmarks/parallel.py [--processes 1,2,4] [--steps 100] [--repeats 3]
                                  [--out benchmarks/results/parallel.json]

Each process count is one ``funcgrad launch -n P`` run of this file with ``--worker``. Two
models, one global batch each, split over the processes: the digits MLP (64 -> 128 -> 10,
``fg.load_digits``, global batch 128) and a 1M-parameter MLP (64 -> 1000 -> 1000 -> 10 on
random data, global batch 128). For each: steps per second of ``fg.data_parallel(step,
mesh)``, and the time of the gradient's all-reduce alone (a program that sums gradient-sized
per-device arrays over the data axis: one all-reduce of the same bytes, checked with
``fg.collectives``), as a share of the step. On one process the plain step (no mesh) runs
beside the mesh step: their ratio is the mesh path's overhead on one device.

On a machine with fewer cores than processes (this one: 2) the processes share the cores, so
the numbers show the cost of communication and sharing, not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def worker(args: argparse.Namespace) -> None:
    import funcgrad as fg

    fg.distributed_init(heartbeat_timeout=30, shutdown_timeout=30)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = fg.data_mesh()
    n = jax.process_count()
    rows = fg.process_rows(args.batch, mesh)
    out = {"processes": n, "models": {}}

    def loss(params, batch):
        return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])

    digits = fg.load_digits(seed=0)
    rng = np.random.default_rng(0)
    models = {
        "digits_mlp": ((64, 128, 10), digits.x_train[:args.batch], digits.y_train[:args.batch]),
        "mlp_1m": ((64, 1000, 1000, 10), rng.normal(size=(args.batch, 64)).astype(np.float32),
                   rng.integers(0, 10, size=args.batch).astype(np.int32)),
    }
    for name, (sizes, x, y) in models.items():
        params = fg.mlp_init(jax.random.key(0), sizes)
        count = sum(int(np.size(p)) for p in jax.tree.leaves(params))
        tx = optax.adam(1e-3)
        step = fg.data_parallel(fg.make_train_step(loss, tx), mesh)
        state = fg.replicate(step.init(params), mesh)
        batch = fg.process_batch({"x": x[rows], "y": y[rows]}, mesh)

        # The all-reduce alone: per-device partial gradients (a leading axis of length n,
        # split over the devices) summed into replicated arrays.
        split = NamedSharding(mesh, P("data"))
        partial = [jax.make_array_from_process_local_data(
            split, np.ones((1, *np.shape(p)), np.float32), (n, *np.shape(p)))
            for p in jax.tree.leaves(params)]
        reduce = jax.jit(lambda gs: [jnp.sum(g, axis=0) for g in gs],
                         out_shardings=NamedSharding(mesh, P()))
        comm = fg.collectives(reduce, partial)

        # Every variant once per round, the rounds' order shuffled with the same seed on every
        # process (so the processes call the collectives in the same order); medians, and the
        # all-reduce's share as the median of its within-round ratio to the step.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _timing import medians, paired_ratio, ratio_quartiles, rounds, step_runner

        def reducing(k, reduce=reduce, partial=partial):
            for _ in range(k):
                r = reduce(partial)
            return jax.block_until_ready(r)

        runs = {"step": step_runner(step, state, batch)}
        if n > 1:
            runs["allreduce"] = reducing
        else:  # the plain step beside the mesh step
            plain = fg.make_train_step(loss, tx)
            runs["plain"] = step_runner(plain, plain.init(params),
                                        {"x": jnp.asarray(x), "y": jnp.asarray(y)})
        times = rounds(runs, args.steps, 5 * args.repeats, warmup=5)
        t_step = medians(times)["step"]
        t_reduce = medians(times)["allreduce"] if n > 1 else 0.0
        row = {"params": count, "global_batch": args.batch, "step_ms": 1e3 * t_step,
               "steps_per_s": 1 / t_step, "allreduce_ms": 1e3 * t_reduce,
               "allreduce_share": paired_ratio(times, "allreduce", "step") if n > 1 else 0.0,
               "allreduce_bytes": comm.bytes if n > 1 else 0,
               "step_collectives": str(fg.collectives(step, state, batch)).splitlines()[0]}
        if n == 1:
            row["plain_steps_per_s"] = 1 / medians(times)["plain"]
            row["mesh_vs_plain"] = 1 / paired_ratio(times, "step", "plain")
            low, high = ratio_quartiles(times, "plain", "step")
            row["mesh_vs_plain_quartiles"] = [low, high]
        out["models"][name] = row
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--out", default="benchmarks/results/parallel.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for n in [int(p) for p in args.processes.split(",")]:
        command = [sys.executable, "-m", "funcgrad", "launch", "-n", str(n), "--timeout", "900",
                   "--", sys.executable, os.path.abspath(__file__), "--worker",
                   "--steps", str(args.steps), "--repeats", str(args.repeats),
                   "--batch", str(args.batch)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1000)
        found = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines()
                 if "RESULT " in line]
        if done.returncode or not found:
            sys.exit(f"{n} processes failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                     f"{done.stderr[-4000:]}")
        result = json.loads(found[0])
        for model, row in result["models"].items():
            rows.append({"processes": n, "model": model, **row})
    print(f"{'model':<11} {'params':>9} {'procs':>5} {'steps/s':>9} {'step ms':>8} "
          f"{'all-reduce ms':>13} {'share':>6}  notes")
    for r in rows:
        note = (f"plain step {r['plain_steps_per_s']:.0f}/s; mesh speed / plain "
                f"{r['mesh_vs_plain']:.2f}x [{r['mesh_vs_plain_quartiles'][0]:.2f}-"
                f"{r['mesh_vs_plain_quartiles'][1]:.2f}]" if "plain_steps_per_s" in r else
                r["step_collectives"])
        print(f"{r['model']:<11} {r['params']:>9,} {r['processes']:>5} {r['steps_per_s']:>9.1f} "
              f"{r['step_ms']:>8.2f} {r['allreduce_ms']:>13.2f} {r['allreduce_share']:>6.0%}  "
              f"{note}")
    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import write_results

    write_results(args.out, rows, cores=os.cpu_count())


if __name__ == "__main__":
    main()
