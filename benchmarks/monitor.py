"""What the gradient monitor costs: the jitted train step with and without it, in one run.

Three steps on the same model, batch and optimizer (the 64-128-10 ReLU MLP on digits, Adam):
  * "funcgrad": ``funcgrad.make_train_step(loss_fn, tx)``, no monitor;
  * "plain": the train step's body written out here without the monitor, and
  * "monitor": the same body with the monitor as `make_train_step(monitor=...)` would run it:
    ``value_and_grad(with_dead_relu(loss_fn), has_aux=True)``, then ``monitor.update`` (per-leaf
    norm, mean and std, per-layer norms, dead-ReLU fractions, baseline, flags), its global norm
    reused for the metrics.
When ``make_train_step`` itself takes ``monitor=``, "plain" and "monitor" are it, without and
with. The criterion is monitor / plain <= 1.10; funcgrad / plain shows that "plain" is a fair
stand-in. Repeats are short and their order is shuffled every round (on a 2-core machine the
first in a round is slower); each time is the median over repeats of (repeat time / steps),
each ratio the median over rounds of the ratio of the two times measured in that round (the
load of a shared machine drifts between rounds, and both times of a round share it).

    $ python benchmarks/monitor.py [--steps 25] [--repeats 161] [--out FILE.json]
"""
import argparse
import inspect

import jax
import jax.numpy as jnp
import optax

import funcgrad as fg
from _timing import medians, paired_ratio, rounds, step_runner, write_results
from funcgrad.monitor import grad_monitor, with_dead_relu

LIMIT = 1.10


def _loss_fn(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _written_out_step(tx, monitor):
    """make_train_step's default path (nonfinite="skip", no clipping), +/- the monitor."""
    if monitor is None:
        value_and_grad = jax.value_and_grad(_loss_fn)
    else:
        value_and_grad = jax.value_and_grad(with_dead_relu(_loss_fn), has_aux=True)

    @jax.jit
    def step(carry, batch):
        state, mstate = (carry, None) if monitor is None else carry
        out, grads = value_and_grad(state.params, batch)
        if monitor is None:
            loss = out
            grad_norm = fg.global_norm(grads)
            metrics = {"loss": loss, "grad_norm": grad_norm}
        else:
            loss, dead = out
            mstate, report = monitor.update(mstate, grads, loss=loss, dead_relu=dead)
            grad_norm = report.grad_norm
            metrics = {"loss": loss, "grad_norm": grad_norm, "monitor": report}
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params, opt_state = jax.tree.map(
            lambda n, o: jnp.where(ok, n, o),
            (optax.apply_updates(state.params, updates), opt_state),
            (state.params, state.opt_state))
        metrics["skipped"] = (~ok).astype(jnp.int32)
        state = fg.TrainState(params, opt_state, state.step + 1)
        return (state if monitor is None else (state, mstate)), metrics
    return step


def _steps(tx, params, monitor):
    """(funcgrad, plain, monitored) runners' steps and start states."""
    built_in = "monitor" in inspect.signature(fg.make_train_step).parameters
    state = fg.init_train_state(params, tx)
    if built_in:  # make_train_step(monitor=...) and init_train_state(monitor=...) exist
        mstate = fg.init_train_state(params, tx, monitor=monitor)
        return ((fg.make_train_step(_loss_fn, tx), state),
                (fg.make_train_step(_loss_fn, tx), state),
                (fg.make_train_step(_loss_fn, tx, monitor=monitor), mstate)), True
    mstate = monitor.init(params)
    return ((fg.make_train_step(_loss_fn, tx), state),
            (_written_out_step(tx, None), state),
            (_written_out_step(tx, monitor), (state, mstate))), False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=161, help="timed repeats (median reported)")
    parser.add_argument("--out", default="benchmarks/results/monitor.json")
    args = parser.parse_args()

    data = fg.load_digits(seed=0)
    monitor = grad_monitor()
    rows = []
    for batch_size in (32, 256):
        batch = {"x": jax.device_put(data.x_train[:batch_size]),
                 "y": jax.device_put(data.y_train[:batch_size])}
        params = fg.mlp_init(jax.random.key(0), (64, 128, 10))
        tx = optax.adam(1e-3)
        (ours, plain, monitored), built_in = _steps(tx, params, monitor)
        runs = {"funcgrad": step_runner(*ours, batch), "plain": step_runner(*plain, batch),
                "monitor": step_runner(*monitored, batch)}
        times = rounds(runs, args.steps, args.repeats)
        t = medians(times)
        rows.append({"model": "64-128-10 relu, adam", "batch": batch_size,
                     "monitor_in_make_train_step": built_in,
                     **{f"{k}_us_per_step": 1e6 * v for k, v in t.items()},
                     "ratio_monitor_to_plain": paired_ratio(times, "monitor", "plain"),
                     "ratio_funcgrad_to_plain": paired_ratio(times, "funcgrad", "plain"),
                     "ratio_of_medians_monitor_to_plain": t["monitor"] / t["plain"],
                     "limit": LIMIT, "repeats": args.repeats, "steps_per_repeat": args.steps})

    print(f"{'case':<12}{'funcgrad':>10}{'plain':>9}{'monitor':>9}   "
          f"{'monitor/plain':>13}{'funcgrad/plain':>16}{'(of medians)':>14}")
    for r in rows:
        ok = "ok" if r["ratio_monitor_to_plain"] <= LIMIT else "OVER LIMIT"
        print(f"{'batch ' + str(r['batch']):<12}{r['funcgrad_us_per_step']:>10.1f}"
              f"{r['plain_us_per_step']:>9.1f}{r['monitor_us_per_step']:>9.1f}   "
              f"{r['ratio_monitor_to_plain']:>13.3f}{r['ratio_funcgrad_to_plain']:>16.3f}"
              f"{r['ratio_of_medians_monitor_to_plain']:>14.3f}   {ok}")
    print(f"microseconds per jitted train step (medians) of a 64-128-10 ReLU MLP with Adam on "
          f"digits; ratios: medians over rounds of the ratio within a round (last column: "
          f"monitor/plain of the medians); limit monitor/plain <= {LIMIT:.2f}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
