"""Cost of taps: a jitted forward pass with and without taps, and intermediate_grads.

A tap is the identity and lowers to nothing, so the tapped forward pass should run at the
speed of the untapped one (the issue's bound: ratio <= 1.02). For scale, the table also shows
`intermediate_grads` against ``jax.value_and_grad`` of the same loss (both jitted): the
gradients of the taps cost one extra add per tap site. Same model and batch for every
variant, measured in one process in short repeats whose order is shuffled every round; each
time is the median over repeats of (repeat time / calls). Prints a table and writes JSON.

    $ python benchmarks/taps.py [--calls 200] [--repeats 41] [--out benchmarks/results/taps.json]
"""
import argparse

import jax
from _timing import medians, rounds, write_results

import funcgrad as fg


def _forward(tapped: bool):
    def forward(params, x):
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"][None, :]
            if i < len(params) - 1:
                h = jax.nn.relu(h)
                h = fg.tap(f"hidden{i}", h) if tapped else h
        return h
    return forward


def _loss(forward):
    def loss(params, x, y):
        return fg.softmax_cross_entropy(forward(params, x), y)
    return loss


def _runner(fn, *args):
    def run(n):
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--out", default="benchmarks/results/taps.json")
    args = parser.parse_args()

    data = fg.load_digits(seed=0)
    rows = []
    for batch, sizes in [(32, (64, 128, 10)), (256, (64, 256, 256, 10))]:
        x = jax.device_put(data.x_train[:batch])
        y = jax.device_put(data.y_train[:batch])
        params = fg.mlp_init(jax.random.key(0), sizes)
        runs = {
            "forward": _runner(jax.jit(_forward(False)), params, x),
            "forward+taps": _runner(jax.jit(_forward(True)), params, x),
            "value_and_grad": _runner(jax.jit(jax.value_and_grad(_loss(_forward(False)))),
                                      params, x, y),
            "intermediate_grads": _runner(jax.jit(fg.intermediate_grads(_loss(_forward(True)))),
                                          params, x, y),
        }
        t = medians(rounds(runs, args.calls, args.repeats, warmup=10))
        rows.append({"model": "-".join(map(str, sizes)) + " relu", "batch": batch,
                     **{f"{k}_us": v * 1e6 for k, v in t.items()},
                     "forward_ratio": t["forward+taps"] / t["forward"],
                     "grad_ratio": t["intermediate_grads"] / t["value_and_grad"],
                     "repeats": args.repeats, "calls_per_repeat": args.calls})

    print(f"{'model':<22}{'batch':>6}{'forward':>10}{'+taps':>10}{'ratio':>8}"
          f"{'v_and_g':>10}{'interm.':>10}{'ratio':>8}")
    for r in rows:
        print(f"{r['model']:<22}{r['batch']:>6}{r['forward_us']:>10.1f}{r['forward+taps_us']:>10.1f}"
              f"{r['forward_ratio']:>8.3f}{r['value_and_grad_us']:>10.1f}"
              f"{r['intermediate_grads_us']:>10.1f}{r['grad_ratio']:>8.3f}")
    print("microseconds per jitted call (medians); ratio = tapped / untapped, "
          "intermediate_grads / jax.value_and_grad")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
