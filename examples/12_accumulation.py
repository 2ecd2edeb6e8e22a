"""Gradient accumulation, a short last micro-batch and a partial last group (A §3.3; concept 12).

100 digits in micro-batches of 16 (six of 16 and one of 4), accumulated 3 per update. The
accumulated gradient weights each micro-batch by its example count, so it equals the
full-batch gradient of the mean loss up to float rounding; PyTorch's ``loss / accum_steps``
habit (the mean of the micro-batch means) does not when the sizes differ. The seven
micro-batches make groups of 3, 3 and 1: the last, partial group is applied ("apply") or
dropped and counted ("drop"), never left behind. optax.MultiSteps, fed the same seven, applies
two updates and keeps the seventh micro-batch's gradient in its state. Last, the condition:
a loss centred on its batch's mean couples the examples, so accumulated over micro-batches of
one its gradient is 0, not the full batch's 2; the first call warns (CoupledExamplesWarning).

    $ python examples/12_accumulation.py
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg
from funcgrad.train.accumulate import accumulate_grads, stack_microbatches
from funcgrad.train.step import make_train_step

SIZES = [16] * 6 + [4]
LR = 0.1


def per_example_loss(params, batch):  # one loss per example: accumulation needs the sum
    return optax.softmax_cross_entropy_with_integer_labels(fg.mlp_apply(params, batch["x"]),
                                                           batch["y"])


def mean_loss(params, batch):
    return per_example_loss(params, batch).mean()


grad_mean_loss = jax.jit(jax.grad(mean_loss))  # the full-batch reference, compiled per shape


def split(batch, sizes):
    bounds = np.cumsum([0, *sizes])
    return [{k: v[a:b] for k, v in batch.items()} for a, b in zip(bounds[:-1], bounds[1:])]


def concat(microbatches):
    return {k: np.concatenate([mb[k] for mb in microbatches]) for k in microbatches[0]}


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def accumulated_vs_full(params, batch, microbatches) -> Check:
    mbs = stack_microbatches(microbatches)  # padded arrays and the mask of real rows, together
    acc = jax.jit(lambda p, b: accumulate_grads(per_example_loss, p, b))(params, mbs)
    loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params, batch)
    naive = [grad_mean_loss(params, mb) for mb in microbatches]  # loss / accum_steps
    naive = jax.tree.map(lambda *g: sum(g) / len(g), *naive)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads))
    c = Check(f"{sum(SIZES)} digits in micro-batches of {SIZES}: mean loss and gradient",
              left="accumulated", right="full batch")
    c.row("mean loss", acc.loss, loss, tol=1e-6 * float(loss))  # float32: a few ulps
    c.same("examples counted", int(acc.count), len(batch["y"]))
    # Both sum the same per-example float32 terms in different orders: a few ulps of the
    # largest element, which 1e-6 of it bounds with room to spare.
    c.below("max |g_acc - g_full|", max_abs_diff(acc.grads, grads), 1e-6 * scale)
    c.same("mean of micro-batch means is off", max_abs_diff(naive, grads) > 1e-3 * scale, True)
    print(f"  (largest |g| {scale:.4g}; mean of means off by {max_abs_diff(naive, grads):.3g})")
    return c


def tail_policy(params, microbatches, tail) -> Check:
    groups = [concat(microbatches[0:3]), concat(microbatches[3:6]), microbatches[6]]
    applied = groups if tail == "apply" else groups[:2]
    tx = optax.sgd(LR)
    step = make_train_step(fg.accumulate(per_example_loss, 3, tail=tail), tx)
    state, metrics = step(step.init(params), stack_microbatches(microbatches))
    hand = params  # full-batch SGD on each applied group: p <- p - lr * grad mean loss
    for group in applied:
        hand = jax.tree.map(lambda p, g: p - LR * g, hand, grad_mean_loss(hand, group))
    c = Check(f'tail="{tail}": 7 micro-batches, 3 per update, SGD lr={LR}',
              right="hand loop")
    c.same("updates applied", int(state.step), len(applied))
    c.same("examples per update", " ".join(map(str, np.asarray(metrics["examples"]))),
           " ".join(str(len(g["y"])) for g in applied))
    c.same("dropped examples", int(metrics["dropped_examples"]), 0 if tail == "apply" else 4)
    c.below("max |params - hand loop params|", max_abs_diff(state.params, hand), 1e-6)
    return c


def multisteps(params, microbatches) -> Check:
    multi = optax.MultiSteps(optax.sgd(LR), every_k_schedule=3)

    @jax.jit
    def mini_step(params, opt_state, mb):
        updates, opt_state = multi.update(jax.grad(mean_loss)(params, mb), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    p, opt_state = params, multi.init(params)
    for mb in microbatches:
        before, (p, opt_state) = p, mini_step(p, opt_state, mb)
    c = Check("optax.MultiSteps(every_k_schedule=3), one call per micro-batch",
              left="MultiSteps", right="expected")
    c.same("updates applied", int(opt_state.gradient_step), 2)
    c.same("micro-batches waiting in state", int(opt_state.mini_step), 1)
    c.same("7th micro-batch changed params", max_abs_diff(p, before) > 0, False)
    return c


def coupled() -> Check:
    def centred(params, batch):  # (w x_i - mean_k w x_k)^2: every loss reads the batch mean
        h = params["w"] * batch["x"]
        return (h - jnp.mean(h)) ** 2

    params, x = {"w": jnp.float32(1.0)}, np.float32([0.0, 2.0])
    # Full batch at w = 1: x - mean = [-1, 1], d/dw mean (w (x_i - mean))^2 = 2 * mean 1 = 2.
    full = jax.grad(lambda p: jnp.mean(centred(p, {"x": x})))(params)["w"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = accumulate_grads(centred, params, stack_microbatches([{"x": x[:1]}, {"x": x[1:]}]))
    # Each micro-batch of one example is its own mean: loss 0, gradient 0.
    c = Check("a loss centred on the batch mean, micro-batches of one example",
              left="computed", right="by hand")
    c.same("dL/dw accumulated / full batch", f"{float(acc.grads['w']):g} / {float(full):g}",
           "0 / 2")
    c.same("CoupledExamplesWarning raised",
           any(issubclass(w.category, fg.CoupledExamplesWarning) for w in caught), True)
    return c


def main() -> None:
    data = fg.load_digits(seed=0)
    batch = {"x": data.x_train[:sum(SIZES)], "y": data.y_train[:sum(SIZES)]}
    microbatches = split(batch, SIZES)
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    checks = [accumulated_vs_full(params, batch, microbatches)]
    for tail in ("apply", "drop"):
        print()
        checks.append(tail_policy(params, microbatches, tail))
    print()
    checks.append(multisteps(params, microbatches))
    print()
    checks.append(coupled())
    for other in checks[1:]:
        checks[0].failed += other.failed
    checks[0].done()


if __name__ == "__main__":
    main()
