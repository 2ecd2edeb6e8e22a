"""Loss scaling: float16 gradients that underflow to zero, recovered by a dynamic loss scale.

A 64 -> 128 -> 10 MLP on the digits set, forward and backward in float16 over float32 master
params. The cross-entropy is multiplied by w = 2**-24 (think of a small loss weight, or a deep
net's small activation gradients), which shrinks every gradient below float16's range. Adam is
given eps * w, which makes its steps on w * loss the same as on the loss itself, so the float32
run is the reference and any difference comes from float16 alone. Each float16 run is
``fg.make_train_step(fg.mixed_precision(loss_fn, jnp.float16, loss_scale=ls), tx)``
(``loss_scale=None`` unscaled; the float32 run takes ``loss_fn`` itself), its state from
``step.init(params)``, trained by ``fg.fit``, which takes a loss-scale skip as routine and
lists it in ``History.skipped_steps``.

    $ python examples/15_loss_scaling.py
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg
from funcgrad.train.precision import cast_floating, dynamic_loss_scale, scaled_value_and_grad

WEIGHT = 2.0**-24
EPOCHS, BATCH = 10, 32


def loss_fn(params, batch):
    # Logits to float32 before the cross-entropy, as PyTorch's autocast does for losses.
    logits = fg.mlp_apply(params, batch["x"]).astype(jnp.float32)
    return WEIGHT * fg.softmax_cross_entropy(logits, batch["y"])


def test_accuracy(params, data, dtype) -> float:
    logits = fg.mlp_apply(cast_floating(params, dtype), jnp.asarray(data.x_test, dtype))
    return float(fg.accuracy(logits, data.y_test))


def train(params, data, *, compute_dtype, loss_scale, eval_dtype=None):
    """EPOCHS of Adam with `fg.fit`; returns its FitResult (state, history, nonfinite)."""
    tx = optax.adam(1e-3, eps=1e-8 * WEIGHT)
    loss = (loss_fn if compute_dtype is None
            else fg.mixed_precision(loss_fn, compute_dtype, loss_scale=loss_scale))
    step = fg.make_train_step(loss, tx)
    state = step.init(params)
    evaluate = (None if eval_dtype is None else
                lambda p: {"test_accuracy": test_accuracy(p, data, eval_dtype)})
    return fg.fit(step, state, fg.Batches(data.x_train, data.y_train, batch_size=BATCH),
                  epochs=EPOCHS, evaluate=evaluate, progress=False)


def main() -> None:
    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 128, 10))
    n_steps = EPOCHS * math.ceil(len(data.x_train) / BATCH)

    # 1. One batch at the initial params: the float16 gradient, unscaled and scaled by 2**40
    #    (about where the dynamic scale of part 2 settles).
    batch = {"x": data.x_train[:BATCH], "y": data.y_train[:BATCH]}
    grads = {name: jax.jit(scaled_value_and_grad(loss_fn, compute_dtype=dtype))(
                 params, batch, jnp.float32(scale))[1]
             for name, dtype, scale in [("f32", jnp.float32, 1.0), ("f16", jnp.float16, 1.0),
                                        ("f16 scaled", jnp.float16, 2.0**40)]}
    flat = {k: np.concatenate([np.ravel(g) for g in jax.tree.leaves(v)]) for k, v in grads.items()}
    nonzero = int(np.count_nonzero(flat["f32"]))
    lost = lambda g: int(np.count_nonzero((g == 0) & (flat["f32"] != 0)))
    c = Check(f"float16 gradients of w * cross-entropy, w = 2**-24 ({nonzero} non-zero elements "
              "in float32)", "measured", "bound")
    # The backward pass starts at the logits with w * (softmax - onehot) / 32, at most
    # 2**-24 / 2**5 = 2**-29 in size. float16's smallest subnormal is 2**-24 and anything below
    # half of it rounds to 0, so in float16 every cotangent, and every gradient, is 0.
    logits = fg.mlp_apply(params, batch["x"])
    d_logits = jax.grad(lambda z: WEIGHT * fg.softmax_cross_entropy(z, batch["y"]))(logits)
    c.below("largest |dL/dlogits| in float32", jnp.abs(d_logits).max(), 2.0**-29)
    c.same("elements lost, float16 unscaled", lost(flat["f16"]), nonzero)
    c.same("elements lost, float16 x 2**40", lost(flat["f16 scaled"]), 0)
    # float16 keeps 11 significant bits (rounding 2**-11 ~ 5e-4); a few roundings per element.
    rel = np.linalg.norm(flat["f16 scaled"] - flat["f32"]) / np.linalg.norm(flat["f32"])
    c.below("relative error x 2**40 vs float32", rel, 1e-2)

    # 2. Train three times. The dynamic scale starts too high on purpose (2**50; its ceiling is
    #    raised because w moves the useful range up by 2**24) and grows every 50 steps (the
    #    default 2000 is for runs of 10**5 steps), so the run shows both back-off and growth.
    ls = dynamic_loss_scale(init_scale=2.0**50, max_scale=2.0**50, growth_interval=50)
    ref = train(params, data, compute_dtype=None, loss_scale=None)
    plain = train(params, data, compute_dtype=jnp.float16, loss_scale=None)
    scaled = train(params, data, compute_dtype=jnp.float16, loss_scale=ls,
                   eval_dtype=jnp.float16)
    for name, run in [("float32", ref), ("float16", plain), ("float16 + scale", scaled)]:
        if run.nonfinite is not None:
            print(f"  {name} run stopped early: {run.nonfinite}")
            c.failed += 1

    print()
    c2 = Check(f"digits, {EPOCHS} epochs of Adam, {n_steps} steps (fit)", "measured",
               "reference")
    c2.below("float32: test error (1 - accuracy)",
             1 - test_accuracy(ref.state.params, data, jnp.float32), 0.05)
    c2.same("float16 unscaled: zero-gradient steps",
            sum(g == 0 for g in plain.history.step_grad_norm), n_steps)
    changed = any(bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(plain.state.params),
                                                        jax.tree.leaves(params)))
    c2.same("float16 unscaled: params changed", changed, False)
    c2.below("float16 + dynamic scale: test error",
             1 - scaled.history.epochs[-1]["eval/test_accuracy"], 0.05)
    skipped = int(scaled.state.loss_scale.skipped_total)
    at = scaled.history.skipped_steps
    c2.same("skipped_total = len(skipped_steps)", skipped, len(at))
    c2.same("sum of the epochs' skipped", sum(r["skipped"] for r in scaled.history.epochs),
            skipped)
    c2.same("applied steps = steps - skipped", len(scaled.history.step_loss), n_steps - skipped)
    # A skipped step leaves the optimizer state as it was, so Adam's own count = applied steps.
    c2.same("Adam's count = steps - skipped", int(scaled.state.opt_state[0].count),
            n_steps - skipped)
    print(f"  skipped steps {at}; scale 2**{math.log2(float(ls.init().scale)):.0f} at the "
          f"start, 2**{math.log2(float(scaled.state.loss_scale.scale)):.0f} at the end")
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
