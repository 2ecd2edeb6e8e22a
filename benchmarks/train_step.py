"""Steps per second of funcgrad's jitted train step against hand-written baselines.

Two baselines, both ``jax.jit`` steps written the way users write them by hand:
  * "hand": ``value_and_grad`` + optax update + ``apply_updates`` (returns the loss);
  * "hand+norm": the same, also returning ``optax.tree.norm(grads)`` — the same work as
    funcgrad's step, which reports the pre-clip global gradient norm every step, written with
    optax's per-leaf norm.
funcgrad's ratio to "hand" is the criterion: its whole cost, norm included, against a step that
does less. funcgrad computes the norm as one fused reduction (`funcgrad.global_norm`), which
is why it can match "hand" while "hand+norm" (one reduction per leaf) is slower. All run on the same model, batch and optimizer in one process, in
short repeats whose order is shuffled every round (on a 2-core machine whichever step runs
first in a round is measurably slower, so a fixed order biases the ratio). Each time is the
median over repeats of (repeat time / steps). Prints a table and writes JSON.

    $ python benchmarks/train_step.py [--steps 100] [--repeats 41] [--out benchmarks/results/train_step.json]
"""
import argparse

import jax
import optax

import funcgrad as fg
from _timing import medians, rounds, step_runner, write_results


def _loss_fn(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _hand_step(tx, with_norm):
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = (loss, optax.tree.norm(grads)) if with_norm else loss
        return optax.apply_updates(params, updates), opt_state, metrics
    return step


def _hand_runner(step, params, opt_state, batch):
    """Returns run(n): n hand-written steps from the carried state; blocks at the end."""
    carry = [params, opt_state]

    def run(n):
        p, o = carry
        for _ in range(n):
            p, o, out = step(p, o, batch)
        carry[:] = p, o
        return jax.block_until_ready((p, out))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=41, help="timed repeats (median reported)")
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
    args = parser.parse_args()

    data = fg.load_digits(seed=0)
    rows = []
    for batch_size, clip in [(32, None), (256, None), (32, 1.0)]:
        batch = {"x": jax.device_put(data.x_train[:batch_size]),
                 "y": jax.device_put(data.y_train[:batch_size])}
        params = fg.mlp_init(jax.random.key(0), (64, 128, 10))
        tx = optax.adam(1e-3)
        hand_tx = tx if clip is None else optax.chain(optax.clip_by_global_norm(clip), tx)
        ours = fg.make_train_step(_loss_fn, tx, clip_norm=clip)
        runs = {
            "hand": _hand_runner(_hand_step(hand_tx, False), params, hand_tx.init(params), batch),
            "hand+norm": _hand_runner(_hand_step(hand_tx, True), params, hand_tx.init(params),
                                      batch),
            "funcgrad": step_runner(ours, fg.init_train_state(params, tx), batch),
        }
        t = medians(rounds(runs, args.steps, args.repeats))
        rows.append({"model": "64-128-10 relu, adam", "batch": batch_size, "clip_norm": clip,
                     **{f"{k}_steps_per_s": 1 / v for k, v in t.items()},
                     "ratio_to_hand": t["funcgrad"] / t["hand"],
                     "ratio_to_hand_norm": t["funcgrad"] / t["hand+norm"],
                     "repeats": args.repeats, "steps_per_repeat": args.steps})

    print(f"{'case':<24}{'hand':>9}{'hand+norm':>11}{'funcgrad':>10}   "
          f"{'funcgrad/hand':>13}{'funcgrad/hand+norm':>20}")
    for r in rows:
        case = f"batch {r['batch']}" + (f", clip {r['clip_norm']:g}" if r["clip_norm"] else "")
        print(f"{case:<24}{r['hand_steps_per_s']:>9.0f}{r['hand+norm_steps_per_s']:>11.0f}"
              f"{r['funcgrad_steps_per_s']:>10.0f}   {r['ratio_to_hand']:>13.3f}"
              f"{r['ratio_to_hand_norm']:>20.3f}")
    print("steps/s of a 64-128-10 ReLU MLP with Adam on digits; ratio = funcgrad time per step "
          "/ baseline time per step (medians)")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
