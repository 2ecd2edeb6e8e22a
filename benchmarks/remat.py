"""Remat on XLA: compiled memory and step time of `funcgrad.memory.checkpointing` against no remat
and ``jax.checkpoint`` (issue 14, point 2 and its targets). Prints tables and writes JSON.

1. The 16-layer tanh MLP, width 512, batch 2048, ``jit(grad(0.5 * mean(h**2)))``: ``temp +
   output`` of ``memory_analysis()``, and the median step time (ratios against no remat, in
   this process), for no remat, ``jax.checkpoint`` per layer and per 4-layer segment (the
   naive use), and ``fg`` remat_sequential (sqrt n = 4 segments of 4, last kept; sizes
   6, 5, 4, 1; two levels, each half cut into 3, 3, 2; "log", halved down to single layers). Each of
   no remat and fg's sqrt plan is also run in a fresh process, whose peak RSS above the RSS before
   the call confirms the compiled figure (it adds a constant of about 16-19 MiB here: the runtime's
   own first-call allocations).
2. Budget: `plan_remat` for b in {0.25, 0.5, 0.75}.
   ``jax.checkpoint`` per 4 layers is also compiled in fresh processes with XLA passes
   disabled: without ``cse_barrier_expander`` (the barrier kept) it saves as much as fg's remat;
   without ``cse`` alone the recomputed dots stay but the memory does not fall (the
   recomputation is scheduled early, inside the forward pass).
3. Depth n in {16, 64, 256} at width 256, batch 1024: the memory beyond the gradient output
   (``temp``) without remat and with sqrt n segments; log-log slope against n.

    $ python benchmarks/remat.py [--quick] [--out benchmarks/results/remat.json]
"""
import argparse
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.memory.checkpointing import plan_remat, remat_sequential

MiB = 2 ** 20


def layer(p, h):
    w, b = p
    return jnp.tanh(h @ w + b[None, :])


def make(n, width, batch, seed=0):
    keys = jax.random.split(jax.random.key(seed), n + 1)
    params = [(jax.random.normal(k, (width, width)) / np.sqrt(width), jnp.zeros((width,)))
              for k in keys[:n]]
    x = jax.random.normal(keys[n], (batch, width))
    return params, x


def head(h):
    return 0.5 * jnp.mean(h ** 2)


def plain(params, x):
    h = x
    for p in params:
        h = layer(p, h)
    return head(h)


def naive(params, x, k):
    """jax.checkpoint on every segment of k layers (the documented way)."""
    def seg(ps, h):
        for p in ps:
            h = layer(p, h)
        return h
    h = x
    for i in range(0, len(params), k):
        h = jax.checkpoint(seg)(params[i:i + k], h)
    return head(h)


def ours(params, x, segments):
    return head(remat_sequential(layer, params, x, segments=segments))


VARIANTS = {
    "no remat": plain,
    "jax.checkpoint per layer": functools.partial(naive, k=1),
    "jax.checkpoint per 4 layers": functools.partial(naive, k=4),
    "fg remat_sequential sqrt (4x4)": functools.partial(ours, segments="sqrt"),
    "fg remat_sequential (6,5,4,1)": functools.partial(ours, segments=(6, 5, 4, 1)),
    "fg two levels ((3,3,2),(3,3,2))": functools.partial(ours, segments=((3, 3, 2), (3, 3, 2))),
    "fg remat_sequential log (halving)": functools.partial(ours, segments="log"),
}


def compiled(fn, params, x):
    c = jax.jit(jax.grad(fn)).lower(params, x).compile()
    m = c.memory_analysis()
    return c, m


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))  # KiB


def child(name):
    """Fresh process: the peak RSS of the first call above the RSS just before it (Linux).

    The high-water mark is reset first (``echo 5 > /proc/self/clear_refs``): compiling peaks
    higher than running, and ru_maxrss would report the compiler's peak."""
    params, x = make(16, 512, 2048)
    c, _ = compiled(VARIANTS[name], params, x)
    jax.block_until_ready((params, x))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    jax.block_until_ready(c(params, x))
    print(json.dumps({"peak_above_rss_kib": _status("VmHWM") - before}))


def child_memory(name):
    """The compiled temp+output (MiB) and dot count of one variant, under this process's
    XLA_FLAGS."""
    params, x = make(16, 512, 2048)
    c, m = compiled(VARIANTS[name], params, x)
    dots = sum(1 for line in c.as_text().splitlines() if " dot(" in line)
    print(json.dumps({"mib": (m.temp_size_in_bytes + m.output_size_in_bytes) / MiB,
                      "dots": dots}))


XLA_EXPERIMENTS = {  # why jax.checkpoint saves nothing on XLA:CPU, pass by pass
    "default passes": "",
    "without cse_barrier_expander": "--xla_disable_hlo_passes=cse_barrier_expander",
    "without cse": "--xla_disable_hlo_passes=cse",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="depths 16 and 64 only, 3 repeats")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "remat.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-memory", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    if args.child_memory:
        return child_memory(args.child_memory)
    repeats = 5 if args.quick else 15
    out = {"jax": jax.__version__, "backend": jax.default_backend()}

    print("1. 16-layer tanh MLP, width 512, batch 2048: jit(grad)")
    params, x = make(16, 512, 2048)
    rows, calls = {}, {}
    for name, fn in VARIANTS.items():
        c, m = compiled(fn, params, x)
        jax.block_until_ready(c(params, x))
        calls[name] = c
        rows[name] = {"temp_output_mib": (m.temp_size_in_bytes + m.output_size_in_bytes) / MiB}
    # Rounds in shuffled order; the time ratio is the median of within-round ratios (the
    # machine is shared: a slow moment hits every variant of a round alike).
    times = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    rng = np.random.default_rng(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name](params, x))
            times[name].append(time.perf_counter() - t0)
    base = rows["no remat"]
    print(f"{'variant':34s} {'temp+out MiB':>12s} {'x':>6s} {'ms':>8s} {'time x':>7s}")
    for name, r in rows.items():
        r["ms"] = 1e3 * float(np.median(times[name]))
        r["memory_ratio"] = r["temp_output_mib"] / base["temp_output_mib"]
        r["time_ratio"] = float(np.median(np.array(times[name]) / np.array(times["no remat"])))
        print(f"{name:34s} {r['temp_output_mib']:12.1f} {r['memory_ratio']:6.2f} "
              f"{r['ms']:8.1f} {r['time_ratio']:7.2f}")
    out["mlp"] = rows
    rss = {}
    for name in ("no remat", "jax.checkpoint per 4 layers", "fg remat_sequential sqrt (4x4)",
                 "fg remat_sequential log (halving)"):
        proc = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True,
                              text=True, check=True)
        rss[name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_above_rss_kib"] / 1024
    ours_name = "fg remat_sequential sqrt (4x4)"
    print("fresh-process peak RSS above the RSS before the call (MiB): "
          + ", ".join(f"{k} {v:.1f}" for k, v in rss.items())
          + f"; saved {rss['no remat'] - rss[ours_name]:.1f} MiB, compiled figures say "
          f"{rows['no remat']['temp_output_mib'] - rows[ours_name]['temp_output_mib']:.1f}")
    out["mlp_peak_rss_mib"] = rss

    print("\njax.checkpoint per 4 layers under XLA flags (fresh processes): MiB, dots compiled")
    out["xla_flags"] = {}
    for label, flags in XLA_EXPERIMENTS.items():
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        proc = subprocess.run([sys.executable, __file__, "--child-memory",
                               "jax.checkpoint per 4 layers"], capture_output=True, text=True,
                              check=True, env=env)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        out["xla_flags"][label] = r
        print(f"  {label:32s} {r['mib']:7.1f} MiB  {r['dots']} dots")

    print("\n2. Budget (plan_remat), same MLP")
    out["budget"] = {}
    for b in (0.25, 0.5, 0.75):
        try:
            plan = plan_remat(layer, params, x, b)
            print(f"b={b}: {plan}")
            out["budget"][str(b)] = {"segments": plan.segments, "fraction": plan.fraction,
                                     "recompute": plan.recompute, "met": True}
        except ValueError as e:
            print(f"b={b}: not reachable: {e}")
            out["budget"][str(b)] = {"met": False, "message": str(e)}

    print("\n3. Depth, width 256, batch 1024: memory beyond the gradient output (temp, MiB)")
    depths = (16, 64) if args.quick else (16, 64, 256)
    depth_rows = {}
    for n in depths:
        params, x = make(n, 256, 1024)
        _, m0 = compiled(plain, params, x)
        _, m1 = compiled(functools.partial(ours, segments="sqrt"), params, x)
        depth_rows[n] = {"plain": m0.temp_size_in_bytes / MiB, "sqrt": m1.temp_size_in_bytes / MiB}
        print(f"n={n:4d}: no remat {depth_rows[n]['plain']:8.1f}   sqrt segments "
              f"{depth_rows[n]['sqrt']:8.1f}")
    ns = np.log(np.array(depths, float))
    for key in ("plain", "sqrt"):
        slope = float(np.polyfit(ns, np.log([depth_rows[n][key] for n in depths]), 1)[0])
        out[f"depth_slope_{key}"] = slope
        print(f"log-log slope, {key}: {slope:.2f}")
    out["depth"] = depth_rows

    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=float))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
