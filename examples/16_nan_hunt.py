"""A training run whose gradients turn into NaN half-way, stopped and located to the line (B §1).

The digits MLP below computes its log-probabilities by hand, ``log(softmax(z))``, and trains
with a learning rate that grows 5% per step. As the model grows confident, the probability of
some wrong class underflows to exactly 0 in float32: log gives -inf there, but the loss only
reads the true class, so the loss stays finite. The gradient does not: log's derivative 1/p is
inf where p = 0, and the backward pass multiplies it by the zero cotangent of the unread
elements, 0 * inf = NaN. `fit` stops at that step and keeps the state from before it;
`find_nonfinite` on that state and batch names the primitive, the pass and the line.

    $ python examples/16_nan_hunt.py
"""
import inspect
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg
from funcgrad.debug.anomaly import find_nonfinite


def probabilities_by_hand(logits):
    z = logits - jnp.max(logits, axis=-1, keepdims=True)   # no overflow: exp(z) <= 1
    return jnp.exp(z) / jnp.sum(jnp.exp(z), axis=-1, keepdims=True)


def log_softmax_by_hand(logits):
    return jnp.log(probabilities_by_hand(logits))  # <- the bug: log of a probability that can be 0


def loss_fn(params, batch):
    logp = log_softmax_by_hand(fg.mlp_apply(params, batch["x"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def fixed_loss_fn(params, batch):
    logp = jax.nn.log_softmax(fg.mlp_apply(params, batch["x"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def marked_line(fn, marker: str = "# <- the bug") -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def main() -> None:
    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 64, 10))
    # inject_hyperparams keeps the rate in the optimizer state, so fit records it per step
    # (optax.sgd(schedule) would train the same and report no rate, with a warning).
    tx = optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.exponential_decay(0.01, transition_steps=1, decay_rate=1.05))
    print("training: lr = 0.01 * 1.05**step, 4 epochs of batch 32 (180 steps)")
    with warnings.catch_warnings():   # the report is printed below, not as a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        step = fg.make_train_step(loss_fn, tx)
        train = fg.Batches(data.x_train, data.y_train, batch_size=32)
        result = fg.fit(step, step.init(params), train, epochs=4, progress=print)
    stop = result.nonfinite
    print(stop, end="\n\n")
    if stop is None:
        raise SystemExit("the run did not go non-finite; nothing to hunt")
    batch = list(train.epoch(stop.epoch - 1))[stop.batch]  # epochs count from 1
    report = find_nonfinite(loss_fn, result.state.params, batch)
    print(report, end="\n\n")

    c = Check(f"the NaN of step {stop.step}, located", left="find_nonfinite", right="reference")
    c.same("fit stopped half-way (step < 180)", stop.step < 180, True)
    c.same("loss of that step finite", math.isfinite(stop.loss), True)
    c.same("its gradient norm finite", math.isfinite(stop.grad_norm), False)
    # A finite loss with a non-finite gradient can only come from the backward pass.
    c.same("pass", report.phase, "forward" if not math.isfinite(stop.loss) else "backward")
    c.same("primitive", report.primitive, "log")
    c.same("line", report.line, marked_line(log_softmax_by_hand))
    c.same("file", os.path.basename(report.file), os.path.basename(__file__))
    # Second method for the operands: the probabilities recomputed directly.
    p = np.asarray(probabilities_by_hand(fg.mlp_apply(result.state.params, batch["x"])))
    c.row("smallest probability (underflowed)", report.inputs[0].min, p.min())
    c.same("NaN cotangents = probabilities == 0", report.output.nan, int(np.sum(p == 0)))
    c.same("hint suggests jax.nn.log_softmax", "jax.nn.log_softmax" in report.hint, True)
    print()

    fixed = find_nonfinite(fixed_loss_fn, result.state.params, batch)
    print(fixed, end="\n\n")
    c2 = Check("the fix: jax.nn.log_softmax, same state and batch", left="fixed",
               right="reference")
    c2.same("loss and gradient finite", fixed.ok, True)
    # Same loss up to float32 rounding: only the true class is read, and its p is not tiny.
    c2.row("loss (hand-written loss as reference)", fixed.value, report.value, tol=1e-4)
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
