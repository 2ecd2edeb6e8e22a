"""What the gradient monitor costs: the jitted train step with and without it, in one run.

Three steps on the same model, batch and optimizer (a ReLU MLP on digits, Adam):
  * "plain": ``funcgrad.make_train_step(loss_fn, tx)``;
  * "monitor": ``make_train_step(loss_fn, optax.chain(fg.grad_monitor(), tx))``: per-leaf
    norm, mean and std, per-layer norms, dead-ReLU fractions, baseline and vanishing streaks,
    in the step;
  * "plain, again": a second, separately built plain step. plain, again / plain is an A/A
    comparison: how far apart two identical steps measure on this machine in this run.
The cases: the 64-128-10 MLP at batch 32 (the CLI's default) and 256, and a 64-1024-1024-10
MLP (1.1M parameters) at batch 32, timed with fewer steps and rounds (a step takes ~3.5 ms).
The criterion is monitor / plain <= 1.10 (issue 5). Repeats are short and their order is
shuffled every round (on a 2-core machine the first in a round is slower); each time is the
median over rounds of (repeat time / steps), each ratio the median over rounds of the ratio of
the two times measured in that round (the load of a shared machine drifts between rounds, and
both times of a round share it).

    $ python benchmarks/monitor.py [--steps 25] [--repeats 161] [--out FILE.json]
"""
import jax
import optax
from _timing import medians, paired_ratio, rounds, step_args, step_runner, write_results

import funcgrad as fg

LIMIT = 1.10


def _loss_fn(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def main() -> None:
    args = step_args(__doc__, steps=25, repeats=161,
                     out="benchmarks/results/monitor.json")

    data = fg.load_digits(seed=0)
    rows = []
    small, large = (64, 128, 10), (64, 1024, 1024, 10)
    for sizes, batch_size in [(small, 32), (small, 256), (large, 32)]:
        batch = {"x": jax.device_put(data.x_train[:batch_size]),
                 "y": jax.device_put(data.y_train[:batch_size])}
        params = fg.mlp_init(jax.random.key(0), sizes)
        steps, repeats = ((args.steps, args.repeats) if sizes == small else
                          (max(1, args.steps // 6), max(11, args.repeats // 4)))
        tx = optax.adam(1e-3)
        plain = fg.make_train_step(_loss_fn, tx)
        watched = fg.make_train_step(_loss_fn, optax.chain(fg.grad_monitor(), tx))
        state = plain.init(params)
        runs = {"plain": step_runner(plain, state, batch),
                "monitor": step_runner(watched, watched.init(params), batch),
                "plain, again": step_runner(fg.make_train_step(_loss_fn, tx), state, batch)}
        times = rounds(runs, steps, repeats, warmup=20 if sizes == small else 3)
        t = medians(times)
        rows.append({"model": "-".join(map(str, sizes)) + " relu, adam", "batch": batch_size,
                     **{f"{k}_us_per_step": 1e6 * v for k, v in t.items()},
                     "ratio_monitor_to_plain": paired_ratio(times, "monitor", "plain"),
                     "ratio_plain_again_to_plain": paired_ratio(times, "plain, again", "plain"),
                     "ratio_of_medians_monitor_to_plain": t["monitor"] / t["plain"],
                     "limit": LIMIT, "repeats": repeats, "steps_per_repeat": steps})

    print(f"{'case':<28}{'plain':>9}{'monitor':>9}{'plain, again':>14}   "
          f"{'monitor/plain':>13}{'(of medians)':>14}{'A/A':>8}")
    for r in rows:
        ok = "ok" if r["ratio_monitor_to_plain"] <= LIMIT else "OVER LIMIT"
        case = r["model"].split()[0] + f", batch {r['batch']}"
        print(f"{case:<28}{r['plain_us_per_step']:>9.1f}"
              f"{r['monitor_us_per_step']:>9.1f}{r['plain, again_us_per_step']:>14.1f}   "
              f"{r['ratio_monitor_to_plain']:>13.3f}{r['ratio_of_medians_monitor_to_plain']:>14.3f}"
              f"{r['ratio_plain_again_to_plain']:>8.3f}   {ok}")
    print(f"microseconds per jitted train step (medians) of ReLU MLPs with Adam on "
          f"digits; ratios: medians over rounds of the ratio within a round ((of medians): "
          f"monitor/plain of the medians; A/A: plain, again / plain); limit monitor/plain <= "
          f"{LIMIT:.2f}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
