"""Clipping by global norm, with the numbers optax does not keep (A §3.4, B §4.3).

The global norm of gradients g is ||g|| = sqrt(sum over leaves of sum(leaf²)). Clipping to
max_norm c multiplies every leaf by min(1, c/||g||): the direction is kept, only the length
shrinks. `fg.clip_by_global_norm` is an optax transformation whose state records the pre-clip
norm and that coefficient; a train step with it in its optimizer's chain reports them, and
says what happens to a non-finite step ("skip" by default: nothing is applied).

    $ python examples/13_clipping.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg


def main() -> None:
    c = Check("clipping g = (3, 4) to max_norm 1")
    # ||g|| = sqrt(9 + 16) = 5 > 1: coefficient 1/5, g' = (0.6, 0.8), ||g'|| = 1.
    grads = {"a": jnp.array([3.0]), "b": jnp.array([4.0])}
    clip = fg.clip_by_global_norm(1.0)
    clipped, info = clip.update(grads, clip.init(grads))  # info: a ClipState
    c.row("pre-clip norm", info.grad_norm, 5.0, tol=1e-6)
    c.row("clip coefficient", info.clip_coef, 0.2, tol=1e-7)
    c.row("g'_a", clipped["a"][0], 0.6, tol=1e-7)
    c.row("g'_b", clipped["b"][0], 0.8, tol=1e-7)
    c.row("post-clip norm", fg.global_norm(clipped), 1.0, tol=1e-6)
    c.row("cosine(g, g')", (3 * clipped["a"][0] + 4 * clipped["b"][0]) / 5.0, 1.0, tol=1e-6)

    # One NaN leaf: optax divides everything by the NaN norm; zeroing the bad leaf first
    # (fg.zero_nonfinite, before the clip in the chain) keeps the rest (a = 3 alone, norm
    # 3 > 1: a' = 1).
    bad = {"a": jnp.array([3.0]), "b": jnp.array([jnp.nan])}
    poisoned, _ = optax.clip_by_global_norm(1.0).update(bad, optax.EmptyState())
    zero_then_clip = optax.chain(fg.zero_nonfinite(), fg.clip_by_global_norm(1.0))
    kept, records = zero_then_clip.update(bad, zero_then_clip.init(bad))
    info = fg.recorded(records)  # the chain's records, as a train step reports them
    print("\n  optax alone on a tree with one NaN leaf:",
          {k: float(v[0]) for k, v in poisoned.items()})
    c.same("optax: leaf a after clipping", str(float(poisoned["a"][0])), "nan")
    c.row("zero_nonfinite: leaf a", kept["a"][0], 1.0, tol=1e-6)
    c.row("zero_nonfinite: leaf b", kept["b"][0], 0.0)
    c.same("non-finite leaves counted", int(info["nonfinite_leaves"]), 1)

    # In the train step on digits: the metrics carry norm and coefficient every step.
    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    loss_fn = lambda p, b: fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])
    tx = optax.chain(fg.clip_by_global_norm(0.5), optax.sgd(0.1))
    step = fg.make_train_step(loss_fn, tx)
    batch = {"x": data.x_train[:64], "y": data.y_train[:64]}
    state = step.init(params)
    new, m = step(state, batch)
    g = jax.grad(loss_fn)(params, batch)
    norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(g))))
    print()
    c2 = Check("train step on 64 digits, clipped to 0.5", right="numpy")
    c2.row("metrics grad_norm", m["grad_norm"], norm, tol=1e-5 * norm)
    c2.row("metrics clip_coef", m["clip_coef"], min(1.0, 0.5 / norm), tol=1e-6)
    moved = float(fg.global_norm(jax.tree.map(lambda a, b: a - b, new.params, params)))
    c2.row("||update|| = lr * min(||g||, 0.5)", moved, 0.1 * min(norm, 0.5), tol=1e-6)

    # A batch with a NaN input: the step is skipped, params stay bit-identical.
    nan_batch = {"x": batch["x"].copy(), "y": batch["y"]}
    nan_batch["x"][0, 0] = np.nan
    after, m = step(new, nan_batch)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after.params),
                                                    jax.tree.leaves(new.params)))
    c2.same("NaN batch: skipped", fg.train.step_was_skipped(m), True)
    c2.same("NaN batch: params bit-identical", same, True)
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
