"""Time per step of funcgrad's jitted train step against hand-written baselines, in one run.

Three baselines, all ``jax.jit`` steps written the way users write them by hand:
  * "hand": ``value_and_grad`` + optax update + ``apply_updates``, returning the loss: the
    step of issue 2's criterion (funcgrad / hand <= 1.05);
  * "hand+norm": the same, also returning ``optax.tree.norm(grads)``;
  * "hand, same": a hand-written step that does and returns what funcgrad's does: a
    TrainState with the step counter, the loss, the pre-clip global norm (``optax.tree.norm``),
    the non-finite guard (``jnp.where`` keeps params and optimizer state unless the loss, the
    norm and every new param are finite) and the "skipped" flag;
  * "hand, loss guard": the same with the guard of funcgrad before issue 11 (loss and norm
    only, no "skipped" output), which let a NaN that the optimizer makes from a finite
    gradient through. "hand, same" / "hand, loss guard" is the cost of the guard on the
    updates.
funcgrad / "hand, same" is the cost of funcgrad's code over the same work written by hand;
funcgrad / "hand" also counts the work funcgrad does that "hand" does not: the norm's
kernels, the guard, and two more arrays crossing the jit boundary (the counter and the norm),
each of which costs dispatch time on the host on every call (see docs/benchmarks.md, "Train step").

The cases: the 64-128-10 MLP at batch 32 (the CLI's default), at batch 256, with clipping
(``fg.clip_by_global_norm`` in funcgrad's chain, ``optax.clip_by_global_norm`` by hand), and
a 64-1024-1024-10 MLP (1.1M parameters) at batch 32, where a step is compute-bound and the
launch cost of a few kernels no longer matters (it is timed with fewer steps and rounds).
Each case runs every step on the same model, batch and optimizer in one process, in short repeats
whose order is shuffled every round (`_timing.rounds`). Times are medians over rounds; ratios are
medians over rounds of the ratio of two times measured in the same round (the load of a shared
machine drifts between rounds), with the 25th-75th percentile range of those ratios. Prints a table
and writes JSON.

    $ python benchmarks/train_step.py [--steps 50] [--repeats 101] \
          [--out benchmarks/results/train_step.json]
"""
import jax
import jax.numpy as jnp
import optax
from _timing import (
    medians,
    paired_ratio,
    ratio_quartiles,
    rounds,
    step_args,
    step_runner,
    write_results,
)

import funcgrad as fg

LIMIT = 1.05


def _loss_fn(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _hand_step(tx, with_norm):
    @jax.jit
    def step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(_loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = (loss, optax.tree.norm(grads)) if with_norm else loss
        return (optax.apply_updates(params, updates), opt_state), metrics
    return step


def _hand_same_step(tx, guard_updates=True):
    """What funcgrad's default step does, written out by hand with optax (with
    ``guard_updates=False``: its guard before issue 11, on the loss and the norm only)."""
    @jax.jit
    def step(state, batch):
        loss, grads = jax.value_and_grad(_loss_fn)(state.params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if guard_updates:
            for leaf in jax.tree.leaves(new_params):
                ok = ok & jnp.all(jnp.isfinite(leaf))
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(ok, new, old),
            (new_params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        if guard_updates:
            metrics["skipped"] = (~ok).astype(jnp.int32)
        return fg.TrainState(params, opt_state, state.step + 1), metrics
    return step


def main() -> None:
    args = step_args(__doc__, steps=50, repeats=101,
                     out="benchmarks/results/train_step.json")

    data = fg.load_digits(seed=0)
    rows = []
    small, large = (64, 128, 10), (64, 1024, 1024, 10)
    for sizes, batch_size, clip in [(small, 32, None), (small, 256, None), (small, 32, 1.0),
                                    (large, 32, None)]:
        batch = {"x": jax.device_put(data.x_train[:batch_size]),
                 "y": jax.device_put(data.y_train[:batch_size])}
        params = fg.mlp_init(jax.random.key(0), sizes)
        steps, repeats = ((args.steps, args.repeats) if sizes == small else
                          (max(1, args.steps // 12), max(11, args.repeats * 2 // 5)))
        tx = optax.adam(1e-3)
        hand_tx = tx if clip is None else optax.chain(optax.clip_by_global_norm(clip), tx)
        ours = fg.make_train_step(
            _loss_fn, tx if clip is None else optax.chain(fg.clip_by_global_norm(clip), tx))
        state = ours.init(params)
        runs = {
            "hand": step_runner(_hand_step(hand_tx, False), (params, hand_tx.init(params)), batch),
            "hand+norm": step_runner(_hand_step(hand_tx, True), (params, hand_tx.init(params)),
                                     batch),
            "funcgrad": step_runner(ours, state, batch),
        }
        if clip is None:
            runs["hand, same"] = step_runner(_hand_same_step(tx), state, batch)
            runs["hand, loss guard"] = step_runner(_hand_same_step(tx, False), state, batch)
        times = rounds(runs, steps, repeats, warmup=20 if sizes == small else 3)
        t = medians(times)
        row = {"model": "-".join(map(str, sizes)) + " relu, adam", "batch": batch_size,
               "clip_norm": clip, **{f"{k}_us_per_step": 1e6 * v for k, v in t.items()},
               "limit": LIMIT, "repeats": repeats, "steps_per_repeat": steps}
        for base in runs:
            if base != "funcgrad":
                row[f"ratio_to_{base}"] = paired_ratio(times, "funcgrad", base)
                row[f"ratio_to_{base}_quartiles"] = ratio_quartiles(times, "funcgrad", base)
        if "hand, same" in runs:  # what the guard on the updates costs, written by hand
            row["guard_cost"] = paired_ratio(times, "hand, same", "hand, loss guard")
        rows.append(row)

    names = ["hand", "hand+norm", "hand, loss guard", "hand, same", "funcgrad"]
    print(f"{'case':<24}" + "".join(f"{n:>17}" for n in names)
          + f"{'funcgrad/hand':>22}{'/hand+norm':>12}{'/hand, same':>13}{'guard cost':>12}")
    for r in rows:
        case = (r["model"].split()[0] + f", batch {r['batch']}"
                + (f", clip {r['clip_norm']:g}" if r["clip_norm"] else ""))
        us = "".join(f"{r[n + '_us_per_step']:>17.1f}" if n + "_us_per_step" in r else f"{'-':>17}"
                     for n in names)
        lo, hi = r["ratio_to_hand_quartiles"]
        ratios = f"{r['ratio_to_hand']:>8.3f} ({lo:.2f}-{hi:.2f})"
        ratios += f"{r['ratio_to_hand+norm']:>12.3f}"
        ratios += (f"{r['ratio_to_hand, same']:>13.3f}" if "ratio_to_hand, same" in r
                   else f"{'-':>13}")
        ratios += (f"{r['guard_cost']:>12.3f}" if "guard_cost" in r else f"{'-':>12}")
        verdict = "ok" if r["ratio_to_hand"] <= LIMIT else "over"
        if "ratio_to_hand, same" in r:
            verdict += ", same " + ("ok" if r["ratio_to_hand, same"] <= LIMIT else "OVER LIMIT")
        print(f"{case:<24}{us}{ratios:>22}   {verdict}")
    print(f"microseconds per jitted step (medians) of ReLU MLPs with Adam on digits; "
          f"ratios: funcgrad time / baseline time within a round, median over rounds (quartiles); "
          f"guard cost: hand, same / hand, loss guard; "
          f"limit funcgrad/hand <= {LIMIT:.2f}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
