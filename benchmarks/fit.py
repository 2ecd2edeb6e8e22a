"""The training loop's speed: `funcgrad.fit` against torch eager and a hand-written scanned
epoch, side by side in one process (issue 15). Prints a table and writes JSON.

Loops, each recording the loss and the global gradient norm of every step, Adam, digits:
  * torch eager: ``zero_grad``, ``backward``, ``clip_grad_norm_(inf)`` for the norm, ``step``,
    ``.item()`` of the loss and norm (when torch is installed);
  * "fit": ``funcgrad.fit`` with a step from ``make_train_step``, ``progress=False`` (the data
    on the device; each epoch's order, full batches and smaller last batch in one program, and
    the epochs of a call in one dispatch, nothing on the host needing them in between);
  * "fit + monitor": the same with ``optax.chain(fg.grad_monitor(), tx)``;
  * "hand scan": a hand-written ``jax.jit`` of ``lax.scan`` over one epoch's full batches
    (order drawn on the device, loss and ``optax.global_norm`` per step, read once per epoch);
    the fastest the loop can be written in JAX.
Cases: the 64-128-10 ReLU MLP at batch 32 (the CLI's default) and 256, and a 64-1024-1024-10
MLP at batch 32. First, the fixed cost per call (issue 27): `fit` against the hand scan at 3
and 20 epochs per call (`--per-call`), the 64-128-10 MLP at batch 32; target fit / hand scan
<= 1.10 at 3 epochs per call. Times are microseconds per step (epoch time / steps of the
epoch), medians over rounds whose order is shuffled each round; ratios are medians of the
within-round ratios (`_timing`). Targets: fit >= 10x torch eager and within 1.25x of the hand
scan at batch 32; fit + monitor <= 1.10x fit; fit >= 0.9x the hand scan (hand / fit) at batch
256 and on the large MLP.

    $ python benchmarks/fit.py [--repeats 15] [--epochs 10] [--per-call 3,20] [--per-call-only]
          [--out benchmarks/results/fit.json]
"""
import argparse
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from _timing import have_torch as torch_installed
from _timing import medians, paired_ratio, ratio_quartiles, rounds, write_results

import funcgrad as fg


def _loss_fn(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _hand_scan(tx, x, y, batch):
    """A hand-written scanned epoch: the loop as fast as JAX allows."""
    n = len(x)
    steps = n // batch

    @jax.jit
    def epoch(params, opt_state, key):
        idx = jax.random.permutation(key, n)[:steps * batch].reshape(steps, batch)

        def body(carry, rows):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(_loss_fn)(params, {"x": x[rows], "y": y[rows]})
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), (loss,
                                                                      optax.global_norm(grads))
        (params, opt_state), metrics = jax.lax.scan(body, (params, opt_state), idx)
        return params, opt_state, metrics

    return epoch, steps


def _torch_loop(sizes, x, y, batch):
    import torch
    torch.set_num_threads(2)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    n = len(x)
    g = torch.Generator().manual_seed(0)

    def run(epochs):
        losses = []
        for _ in range(epochs):
            order = torch.randperm(n, generator=g)
            for s in range(0, n, batch):
                rows = order[s:s + batch]
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(xt[rows]), yt[rows])
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                opt.step()
                losses.append((loss.item(), norm.item()))
        return losses
    return run


def case(name, sizes, batch, data, repeats, epochs, torch_ok):
    x, y = data.x_train, data.y_train
    n = len(x)
    params = fg.mlp_init(jax.random.key(0), sizes)
    tx = optax.adam(1e-3)
    plain = fg.make_train_step(_loss_fn, tx)
    watched = fg.make_train_step(_loss_fn, optax.chain(fg.grad_monitor(), tx))
    steps_fit = -(-n // batch)
    runs, per_epoch = {}, {}

    def fit_run(step, state):
        def run(k):
            fg.fit(step, state, fg.Batches(x, y, batch_size=batch), epochs=k, progress=False)
        return run

    runs["fit"] = fit_run(plain, plain.init(params))
    per_epoch["fit"] = steps_fit
    runs["fit + monitor"] = fit_run(watched, watched.init(params))
    per_epoch["fit + monitor"] = steps_fit
    hand, steps_hand = _hand_scan(tx, jnp.asarray(x), jnp.asarray(y), batch)
    carry = [params, tx.init(params), jax.random.key(0)]

    def hand_run(k):
        p, o, key = carry
        for _ in range(k):
            key, sub = jax.random.split(key)
            p, o, metrics = hand(p, o, sub)
            jax.device_get(metrics)  # read the epoch's per-step metrics, as fit does
        carry[:] = [p, o, key]
    runs["hand scan"] = hand_run
    per_epoch["hand scan"] = steps_hand
    if torch_ok:
        runs["torch eager"] = _torch_loop(sizes, x, y, batch)
        per_epoch["torch eager"] = steps_fit
    times = rounds(runs, epochs, repeats, warmup=1)
    us = {k: 1e6 * v / per_epoch[k] for k, v in medians(times).items()}
    per_step = {k: [t / per_epoch[k] for t in v] for k, v in times.items()}
    row = {"case": name, "us_per_step": us}
    ratios = {
        "hand scan / fit (>= 0.8 at batch 32; >= 0.9 at 256 and large)":
            ("hand scan", "fit"),
        "fit + monitor / fit (<= 1.10)": ("fit + monitor", "fit"),
    }
    if torch_ok:
        ratios["torch eager / fit (>= 10)"] = ("torch eager", "fit")
    row["ratios"] = {}
    for label, (a, b) in ratios.items():
        row["ratios"][label] = {"median": paired_ratio(per_step, a, b),
                                "quartiles": ratio_quartiles(per_step, a, b)}
    return row


def per_call(data, epochs_per_call, repeats):
    """`fit` against the hand scan with `epochs_per_call` epochs per call (one `fit` call, or
    that many hand-scanned epochs with one read each), the 64-128-10 MLP at batch 32: the
    fixed cost of a call shows at few epochs per call."""
    x, y = data.x_train, data.y_train
    batch, sizes = 32, (64, 128, 10)
    params = fg.mlp_init(jax.random.key(0), sizes)
    tx = optax.adam(1e-3)
    step = fg.make_train_step(_loss_fn, tx)
    state = step.init(params)
    hand, steps_hand = _hand_scan(tx, jnp.asarray(x), jnp.asarray(y), batch)
    carry = [params, tx.init(params), jax.random.key(0)]
    steps_fit = -(-len(x) // batch)

    def fit_run(calls):
        for _ in range(calls):
            fg.fit(step, state, fg.Batches(x, y, batch_size=batch), epochs=epochs_per_call,
                   progress=False)

    def hand_run(calls):
        p, o, key = carry
        for _ in range(calls * epochs_per_call):
            key, sub = jax.random.split(key)
            p, o, metrics = hand(p, o, sub)
            jax.device_get(metrics)
        carry[:] = [p, o, key]

    times = rounds({"fit": fit_run, "hand scan": hand_run}, 1, repeats, warmup=1)
    per_epoch = {"fit": steps_fit, "hand scan": steps_hand}
    per_step = {k: [t / (per_epoch[k] * epochs_per_call) for t in v] for k, v in times.items()}
    return {"case": f"64-128-10, batch 32, {epochs_per_call} epochs per call",
            "epochs_per_call": epochs_per_call,
            "us_per_step": {k: 1e6 * statistics.median(v) for k, v in per_step.items()},
            "ratios": {"fit / hand scan (<= 1.10 at 3 epochs per call)": {
                "median": paired_ratio(per_step, "fit", "hand scan"),
                "quartiles": ratio_quartiles(per_step, "fit", "hand scan")}}}


def _load() -> str:
    try:
        return ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover - no load average on this platform
        return "unknown"


def _print_row(title: str, row: dict) -> None:
    print(f"\n{title}")
    for name, v in row["us_per_step"].items():
        print(f"  {name:16s} {v:9.1f}")
    for label, r in row["ratios"].items():
        q = r["quartiles"]
        print(f"  {label:62s} {r['median']:6.2f}  [{q[0]:.2f}, {q[1]:.2f}]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=10, help="epochs per timed round (one fit call)")
    ap.add_argument("--per-call", default="3,20",
                    help="epochs per call for the fixed-cost comparison, comma-separated")
    ap.add_argument("--per-call-only", action="store_true",
                    help="only the fixed-cost comparison (fit / hand scan per call)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "fit.json"))
    args = ap.parse_args()
    torch_ok = torch_installed()
    data = fg.load_digits(seed=0)
    rows = []
    t0 = time.perf_counter()
    print(f"load average before: {_load()}")
    for k in (int(v) for v in args.per_call.split(",") if v):
        row = per_call(data, k, args.repeats)
        rows.append(row)
        _print_row(f"{row['case']}: microseconds per step", row)
    if args.per_call_only:
        print(f"\n({time.perf_counter() - t0:.0f} s; load average after: {_load()})")
        write_results(args.out, rows, torch=torch_ok, load=_load())
        return
    cases = [("64-128-10, batch 32", (64, 128, 10), 32, args.repeats),
             ("64-128-10, batch 256", (64, 128, 10), 256, args.repeats),
             ("64-1024-1024-10, batch 32", (64, 1024, 1024, 10), 32, max(3, args.repeats // 3))]
    for name, sizes, batch, repeats in cases:
        row = case(name, sizes, batch, data, repeats, args.epochs, torch_ok)
        rows.append(row)
        _print_row(f"{name}: microseconds per step (loss and norm of every step recorded)", row)
    print(f"\n({time.perf_counter() - t0:.0f} s; load average after: {_load()})")
    write_results(args.out, rows, torch=torch_ok, load=_load())


if __name__ == "__main__":
    main()
