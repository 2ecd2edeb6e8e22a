"""Compiled memory and time of the gradient of a long recurrence: lax.scan vs fg.checkpointed_scan.

The recurrence is a tanh RNN-like loop over T steps, carry h of shape (64, 256) float32
(64 KiB), h_{t+1} = tanh(h_t @ W + x_t) with W (256, 256) and inputs xs (T, 256), and a loss
sum(h_T) + sum_t mean(h_t); the gradient is taken with respect to W and xs. Three ways:
  * "plain": `jax.lax.scan` (the baseline: the backward pass keeps every step's residuals);
  * "levels=2": `fg.checkpointed_scan(..., levels=2)`, about 2 sqrt(T) stored carries;
  * "log": `fg.checkpointed_scan(..., levels="log")`, about 2 log2(T) stored carries.
Memory is the compiled program's: ``jax.jit(jax.grad(loss)).lower(...).compile()
.memory_analysis()``, temp + output bytes (on XLA:CPU temporaries live inside not-yet-live
output buffers, so temp alone misleads), divided by the carry's bytes: "carries kept". The
outputs include dL/dxs, T * 1 KiB = T/64 carries, and XLA keeps one copy of xs (T/64 carries
more) for the re-runs of the forward pass; the same program without inputs (``length=T``,
"autonomous" rows, compile only) shows the carries alone. The log-log slope of carries kept
between consecutive T is printed (1 for memory growing like T, 0.5 like sqrt(T), ~0 like
log T). Time is the median over rounds of one jitted gradient call, and its ratio to plain
measured in the same round (benchmarks/_timing.py). The gradient is compared with plain's:
max |difference| / max |plain| over each leaf. Prints a table and writes JSON.

    $ python benchmarks/checkpointed_scan.py [--steps 100 1000 10000] [--repeats 5]
                                             [--out benchmarks/results/checkpointed_scan.json]
"""
import argparse
import math
import time

import jax
import jax.numpy as jnp
from _timing import medians, paired_ratio, rounds, write_results

import funcgrad as fg

BATCH, WIDTH = 64, 256
CARRY_BYTES = BATCH * WIDTH * 4
METHODS = {
    "plain": lambda f, h, xs, n: jax.lax.scan(f, h, xs, length=n),
    "levels=2": lambda f, h, xs, n: fg.checkpointed_scan(f, h, xs, length=n, levels=2),
    "log": lambda f, h, xs, n: fg.checkpointed_scan(f, h, xs, length=n, levels="log"),
}


def _loss(scan, steps, driven=True):
    def loss(w, h0, xs):
        def step(h, x):
            h = jnp.tanh(h @ w + x[None, :]) if driven else jnp.tanh(h @ w)
            return h, jnp.mean(h)
        h, ys = scan(step, h0, xs if driven else None, steps)
        return jnp.sum(h) + jnp.sum(ys)
    return loss


def _carries(compiled) -> tuple[int, float]:
    m = compiled.memory_analysis()
    total = m.temp_size_in_bytes + m.output_size_in_bytes
    return total, total / CARRY_BYTES


def _rel_err(got, ref) -> float:
    """max |got - ref| / max |ref| over each leaf, the worst leaf (in float64)."""
    return max(float(jnp.max(jnp.abs(a.astype(b.dtype) - b)) / jnp.max(jnp.abs(b)))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (medians)")
    parser.add_argument("--out", default="benchmarks/results/checkpointed_scan.json")
    args = parser.parse_args()

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k1, (WIDTH, WIDTH), jnp.float32) * (0.9 / math.sqrt(WIDTH))
    h0 = jax.random.normal(k2, (BATCH, WIDTH), jnp.float32)
    rows = []
    for steps in args.steps:
        xs = jax.random.normal(k3, (steps, WIDTH), jnp.float32)
        grads, runs, row = {}, {}, {"T": steps, "log2_T": math.log2(steps),
                                    "sqrt_T": math.sqrt(steps),
                                    "xs_in_carries": steps * WIDTH * 4 / CARRY_BYTES}
        for name, scan in METHODS.items():
            start = time.perf_counter()
            grad = jax.jit(jax.grad(_loss(scan, steps), argnums=(0, 2)))
            compiled = grad.lower(w, h0, xs).compile()
            row[f"{name}_compile_s"] = time.perf_counter() - start
            row[f"{name}_bytes"], row[f"{name}_carries"] = _carries(compiled)
            auto = jax.jit(jax.grad(_loss(scan, steps, driven=False))).lower(w, h0, None)
            row[f"{name}_autonomous_bytes"], row[f"{name}_autonomous_carries"] = _carries(
                auto.compile())
            grads[name] = jax.block_until_ready(compiled(w, h0, xs))
            runs[name] = (lambda c, inputs: lambda n: [jax.block_until_ready(c(*inputs))
                                                       for _ in range(n)])(compiled, (w, h0, xs))
        with jax.enable_x64(True):  # the same gradients in float64, scoped
            grads64 = {name: jax.jit(jax.grad(_loss(scan, steps), argnums=(0, 2)))(
                *(a.astype(jnp.float64) for a in (w, h0, xs))) for name, scan in METHODS.items()}
            for name in METHODS:
                row[f"{name}_f32_err_vs_f64"] = _rel_err(grads[name], grads64["plain"])
                row[f"{name}_grad64_rel_err"] = _rel_err(grads64[name], grads64["plain"])
                row[f"{name}_grad_rel_err"] = _rel_err(grads[name], grads["plain"])
        times = rounds(runs, 1, args.repeats, warmup=1)
        for name, t in medians(times).items():
            row[f"{name}_s"] = t
            row[f"{name}_time_ratio"] = paired_ratio(times, name, "plain")
        rows.append(row)
        print(f"T={steps} done", flush=True)

    for prev, row in zip(rows, rows[1:]):
        for name in METHODS:
            for kind in ("carries", "autonomous_carries"):
                row[f"{name}_{kind}_slope"] = (
                    math.log(row[f"{name}_{kind}"] / prev[f"{name}_{kind}"])
                    / math.log(row["T"] / prev["T"]))

    print(f"\n{'T':>6} {'method':>9} {'temp+out MiB':>13} {'carries':>9} {'slope':>6} "
          f"{'autonomous':>11} {'slope':>6} {'grad s':>8} {'x plain':>8} {'err f32':>8} "
          f"{'err f64':>8} {'f32 vs f64':>10}")
    for row in rows:
        for name in METHODS:
            slope = row.get(f"{name}_carries_slope")
            aslope = row.get(f"{name}_autonomous_carries_slope")
            print(f"{row['T']:>6} {name:>9} {row[f'{name}_bytes'] / 2**20:>13.1f} "
                  f"{row[f'{name}_carries']:>9.1f} "
                  f"{'' if slope is None else f'{slope:.2f}':>6} "
                  f"{row[f'{name}_autonomous_carries']:>11.1f} "
                  f"{'' if aslope is None else f'{aslope:.2f}':>6} "
                  f"{row[f'{name}_s']:>8.3f} {row[f'{name}_time_ratio']:>8.2f} "
                  f"{row[f'{name}_grad_rel_err']:>8.1e} {row[f'{name}_grad64_rel_err']:>8.1e} "
                  f"{row[f'{name}_f32_err_vs_f64']:>10.1e}")
    print("carries = compiled (temp + output) bytes / carry bytes (64 KiB); autonomous: the "
          "same recurrence without xs (compile only); slope: log-log vs the previous T;\n"
          "time: median seconds of one jit(grad) call and its ratio to plain in the same round;"
          " err f32 / f64: max |grad - plain grad| / max |plain grad| over W and xs, in float32 /\n"
          "float64 (jax.enable_x64); f32 vs f64: the float32 gradient against plain's float64"
          " gradient (float32 rounding, for scale)")

    last = rows[-1]
    # The target at the largest T: carries kept <= c * log2(T) for "log", and
    # <= c * sqrt(T) for levels=2, with the c printed (the autonomous rows: the carries alone).
    c_log = last["log_autonomous_carries"] / last["log2_T"]
    c_sqrt = last["levels=2_autonomous_carries"] / last["sqrt_T"]
    err64 = max(last["levels=2_grad64_rel_err"], last["log_grad64_rel_err"])
    err32 = max(last["levels=2_grad_rel_err"], last["log_grad_rel_err"])
    criteria = {"T": last["T"], "log_carries_over_log2_T": c_log,
                "levels2_carries_over_sqrt_T": c_sqrt,
                "log_driven_carries_over_log2_T": last["log_carries"] / last["log2_T"],
                "max_grad64_rel_err": err64, "grad64_rel_err_ok": err64 <= 1e-6,
                "max_grad32_rel_err": err32, "grad32_rel_err_ok": err32 <= 1e-6}
    print(f"criteria at T={last['T']}: log: carries kept = {c_log:.1f} * log2(T) "
          f"(driven, with the xs copy and dL/dxs: {criteria['log_driven_carries_over_log2_T']:.1f}"
          f" * log2(T)); levels=2: {c_sqrt:.2f} * sqrt(T);\ngradient equal to lax.scan's within "
          f"1e-6 relative: float64 {err64:.1e} {'ok' if err64 <= 1e-6 else 'FAILED'}, float32 "
          f"{err32:.1e} {'ok' if err32 <= 1e-6 else 'not met (float32 summation order)'}")
    write_results(args.out, rows, carry_shape=[BATCH, WIDTH], criteria=criteria)


if __name__ == "__main__":
    main()
