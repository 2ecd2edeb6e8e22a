"""Time and maximum error of gradient checkers on a 64 -> h -> 10 tanh MLP (digits, float64).

In one run, for h = 32, 64, 128, with softmax cross-entropy on a batch of 16 digits:
funcgrad full, funcgrad directional, ``jax.test_util.check_grads`` (one random direction,
order 1, fwd+rev), and, when PyTorch is installed, ``torch.autograd.gradcheck`` with default
settings and with ``fast_mode=True`` (same weights, same batch). Times are medians over
repeats after a first call, which is reported separately (it includes tracing and
compilation for the JAX checkers). "max err" is the largest |analytic - numeric| each tool
reports (torch and jax.test_util report only pass/fail; for torch the error of its default
central differences, eps = 1e-6, is recomputed element by element, see `_torch_max_error`).
A second table sets full mode against the FLOP limit of its 2n forward passes (`_flop_limit`):
the same FLOPs run as one forward on a 2n-times larger batch, and at the float64 matmul peak.

    $ python benchmarks/gradcheck.py [--repeats 5] [--out benchmarks/results/gradcheck.json]
"""
import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import have_torch as torch_installed
from jax.test_util import check_grads as jax_check_grads

import funcgrad as fg


def _loss(params, x, y):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, x, activation="tanh"), y)


def _timed(fn, repeats):
    start = time.perf_counter()
    out = fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), out


def _torch_case(params, x, y):
    import torch
    ws = [torch.tensor(np.asarray(p[k], np.float64), requires_grad=True)
          for p in params for k in ("w", "b")]
    xt = torch.tensor(np.asarray(x, np.float64))
    yt = torch.tensor(np.asarray(y), dtype=torch.long)

    def f(w1, b1, w2, b2):
        logits = torch.tanh(xt @ w1 + b1) @ w2 + b2
        return torch.nn.functional.cross_entropy(logits, yt)
    return torch, f, tuple(ws)


def _torch_max_error(torch, f, inputs):
    # gradcheck only says pass/fail, so its error is recomputed the way it computes it: central
    # differences with its default eps = 1e-6 for every element, against torch.autograd.grad.
    with torch.no_grad():
        out = []
        for w in inputs:
            flat = w.view(-1)
            for i in range(flat.numel()):
                old = flat[i].item()
                flat[i] = old + 1e-6
                fp = f(*inputs).item()
                flat[i] = old - 1e-6
                fm = f(*inputs).item()
                flat[i] = old
                out.append((i, w, (fp - fm) / 2e-6))
    grads = torch.autograd.grad(f(*inputs), inputs)
    index = {id(w): g.view(-1) for w, g in zip(inputs, grads)}
    return max(abs(index[id(w)][i].item() - num) for i, w, num in out)


def _flop_limit(params, x64, y, repeats):
    """The FLOP limit of full mode's 2n forward passes, two ways (float64, this machine, now).

    F = XLA's FLOP count for one loss evaluation (``cost_analysis()["flops"]``); the 2n passes
    do 2n·F. "batched": the same 2n·F FLOPs as ONE forward on a batch 2n times larger (the
    best arrangement of that work: large matmuls), timed; "peak": 2n·F at the rate of a
    1024x1024 float64 matmul, the machine's dense peak (a bound no small-matmul MLP reaches).
    """
    n = sum(int(np.size(v)) for v in jax.tree.leaves(params))
    with jax.enable_x64(True):
        one = jax.jit(_loss).lower(params, x64, y).compile().cost_analysis()
        flops = float((one[0] if isinstance(one, list) else one)["flops"])
        big_x = jnp.tile(x64, (2 * n, 1))
        big_y = jnp.tile(jnp.asarray(y), 2 * n)
        batched = jax.jit(_loss)
        _, batched_s, _ = _timed(lambda: batched(params, big_x, big_y).block_until_ready(),
                                 repeats)
        a = jnp.ones((1024, 1024), jnp.float64)
        matmul = jax.jit(lambda a: a @ a)
        _, matmul_s, _ = _timed(lambda: matmul(a).block_until_ready(), repeats)
    peak = 2 * 1024 ** 3 / matmul_s
    return {"flops_per_pass": flops, "passes": 2 * n, "total_gflop": 2 * n * flops / 1e9,
            "batched_s": batched_s, "peak_gflops": peak / 1e9, "peak_s": 2 * n * flops / peak}


def _localise_large(seed=0):
    """Directional mode on a 512 -> 1024 -> 512 -> 10 tanh MLP (1,055,242 params) with one
    element of dW[1] doubled by a custom_vjp: seconds to find and locate it (first call), with
    tangents over each whole leaf (``check_directional``) and with the blocks
    `audit` picks within its default evaluation budget, and the resolution each states for
    the leaf."""
    def make(bug):
        @jax.custom_vjp
        def d(w, b, x):
            return x @ w + b[None, :]

        def bwd(res, g):
            w, x = res
            dw = x.T @ g
            return (dw if bug is None else dw.at[bug].multiply(2.0)), g.sum(axis=0), g @ w.T
        d.defvjp(lambda w, b, x: (d(w, b, x), (w, x)), bwd)
        return d

    sizes = (512, 1024, 512, 10)
    params = fg.mlp_init(jax.random.key(seed), sizes, activation="tanh")
    x = jax.random.normal(jax.random.key(1), (16, 512))
    y = jnp.arange(16) % 10

    def loss(params, x, y, layer1):
        h = jnp.tanh(make(None)(params[0]["w"], params[0]["b"], x))
        h = jnp.tanh(layer1(params[1]["w"], params[1]["b"], h))
        return fg.softmax_cross_entropy(make(None)(params[2]["w"], params[2]["b"], h), y)

    g = jax.grad(loss)(params, x, y, make(None))
    bug = tuple(int(i) for i in np.unravel_index(np.argmax(np.abs(g[1]["w"])), g[1]["w"].shape))
    start = time.perf_counter()
    report = fg.check_directional(lambda params, x, y: loss(params, x, y, make(bug)), params,
                                  x, y)
    seconds = time.perf_counter() - start
    [bad] = report.failures
    start = time.perf_counter()
    blocked = fg.audit(lambda params, x, y: loss(params, x, y, make(bug)), params, x, y)
    audit_seconds = time.perf_counter() - start
    [bad_blocked] = blocked.failures
    n = sum(int(np.size(v)) for p in params for v in p.values())
    return {"params": n, "planted": list(bug), "located_leaf": bad.path,
            "located_element": list(bad.worst_index), "seconds": seconds,
            "resolution": bad.resolution,
            "correct": bad.path == "params[1]['w']" and bad.worst_index == bug,
            "audit_seconds": audit_seconds, "audit_resolution": bad_blocked.resolution,
            "audit_note": blocked.notes[0],
            "audit_correct": (bad_blocked.path == "params[1]['w']"
                              and bad_blocked.worst_index == bug)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/gradcheck.json")
    args = parser.parse_args()
    have_torch = torch_installed()
    data = fg.load_digits(seed=0)
    x, y = data.x_train[:16], data.y_train[:16]
    rows, limits = [], []
    for h in (32, 64, 128):
        with jax.enable_x64(True):
            params = fg.mlp_init(jax.random.key(0), (64, h, 10), activation="tanh",
                                 dtype=jnp.float64)
            x64 = jnp.asarray(x, jnp.float64)
        n = sum(int(np.size(v)) for p in params for v in p.values())
        results = {}
        first, med, rep = _timed(functools.partial(fg.check_grads, _loss, params, x, y),
                                 args.repeats)
        results["funcgrad full"] = (first, med, max(r.max_abs_error for r in rep.rows), rep.ok)
        first, med, rep = _timed(functools.partial(fg.check_directional, _loss, params, x, y,
                                                   num_directions=1),
                                 args.repeats)
        results["funcgrad directional (1 dir)"] = (
            first, med, max(r.max_abs_error for r in rep.rows), rep.ok)

        def jax_tu(params=params, x64=x64):
            with jax.enable_x64(True):
                jax_check_grads(lambda q: _loss(q, x64, y), (params,), order=1,
                                modes=("fwd", "rev"))
            return True
        first, med, _ = _timed(jax_tu, args.repeats)
        results["jax.test_util.check_grads"] = (first, med, None, True)
        if have_torch:
            torch, f, inputs = _torch_case(params, x, y)
            for name, kw in (("torch gradcheck", {}),
                             ("torch gradcheck fast_mode", {"fast_mode": True})):
                first, med, ok = _timed(
                    functools.partial(torch.autograd.gradcheck, f, inputs, **kw), args.repeats)
                results[name] = (first, med, _torch_max_error(torch, f, inputs), bool(ok))
        limit = _flop_limit(params, x64, y, args.repeats)
        limits.append({"h": h, "params": n, "full_s": results["funcgrad full"][1], **limit})
        base = results["funcgrad full"][1]
        for name, (first, med, err, ok) in results.items():
            rows.append({"h": h, "params": n, "checker": name, "first_s": first, "median_s": med,
                         "ratio_to_funcgrad_full": med / base, "max_error": err, "passed": ok})
    print(f"{'h':>4} {'params':>7}  {'checker':<30}{'first (s)':>10}{'median (s)':>11}"
          f"{'x full':>8}{'max err':>11}")
    for r in rows:
        err = "-" if r["max_error"] is None else f"{r['max_error']:.2e}"
        print(f"{r['h']:>4} {r['params']:>7}  {r['checker']:<30}{r['first_s']:>10.3f}"
              f"{r['median_s']:>11.4f}{r['ratio_to_funcgrad_full']:>8.2f}{err:>11}")
    print("\nfull mode against the FLOP limit of its 2n forward passes (float64):")
    print(f"{'h':>4} {'2n·F GFLOP':>11} {'full (s)':>9} {'batched (s)':>12} {'x batched':>10}"
          f" {'peak GF/s':>10} {'at peak (s)':>12} {'x peak':>7}")
    for r in limits:
        print(f"{r['h']:>4} {r['total_gflop']:>11.3f} {r['full_s']:>9.3f} {r['batched_s']:>12.3f}"
              f" {r['full_s'] / r['batched_s']:>10.2f} {r['peak_gflops']:>10.1f}"
              f" {r['peak_s']:>12.3f} {r['full_s'] / r['peak_s']:>7.2f}")
    loc = _localise_large()
    print(f"directional localisation, {loc['params']:,} params: planted at params[1]['w']"
          f"{tuple(loc['planted'])}, located {loc['located_leaf']}{tuple(loc['located_element'])} "
          f"in {loc['seconds']:.2f} s (first call, compile included)"
          + ("" if loc["correct"] else "  WRONG")
          + f"; resolution of that leaf {loc['resolution']:.3g} (whole-leaf tangents)")
    print(f"audit on the same model: {loc['audit_seconds']:.2f} s, resolution "
          f"{loc['audit_resolution']:.3g}" + ("" if loc["audit_correct"] else "  WRONG"))
    print(f"  {loc['audit_note']}")
    if not have_torch:
        print("note: PyTorch is not installed; torch.autograd.gradcheck rows skipped "
              "(pip install torch to include them)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"jax": jax.__version__, "repeats": args.repeats, "rows": rows,
                   "flop_limit": limits, "localisation": loc}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
