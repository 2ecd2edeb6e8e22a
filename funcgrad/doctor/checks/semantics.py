"""The train step's semantics where its pieces use them: accumulation (the accumulated
gradient equals the full-batch gradient), loss scaling (the update does not depend on the
scale: gradients are unscaled before the norm and the clipping), clipping (the coefficient
is clip_norm / ||g|| of the unscaled gradient) and the trainable mask (frozen leaves get no
update). Each is measured on the user's own loss and step, not taken on trust."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding
from funcgrad.doctor._steps import clip_norm

NAME = "semantics"


def check(ctx: Context) -> Finding:
    subject = ctx.subject
    parts = []
    if subject.accumulate:
        parts.append(_accumulation(ctx))
    if subject.step.loss_scale is not None or clip_norm(subject) is not None:
        parts.append(_scale_and_clip(ctx))
    if subject.step.trainable is not None:
        parts.append(_frozen(ctx))
    ignored = _gradient_ignored(ctx)
    if ignored is not None and (ignored[1] != "pass" or parts):
        parts.append(ignored)
    if not parts:
        return Finding(NAME, "skipped", "the step uses no accumulation, loss scale, clip_norm "
                       "or trainable mask: nothing to check (the optimizer's update follows "
                       "the gradient on every leaf)" if ignored else "the step uses no "
                       "accumulation, loss scale, clip_norm or trainable mask: nothing to "
                       "check",
                       {"optimizer": ignored[3]} if ignored else {})
    evidence = {name: ev for name, _, _, ev, _, _ in parts}
    bad = sorted([p for p in parts if p[1] != "pass"], key=lambda p: ("fail", "warn").index(p[1]))
    if not bad:
        return Finding(NAME, "pass", "; ".join(p[2] for p in parts), evidence)
    _, verdict, summary, _, place, fix = bad[0]
    if len(bad) > 1:
        summary += "; " + "; ".join(p[2] for p in bad[1:])
    return Finding(NAME, verdict, summary, evidence, place, fix)


def _rel(a, b) -> float:
    a = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
    b = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
    num = math.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b)))
    den = math.sqrt(sum(float(np.sum(y ** 2)) for y in b))
    return num / den if den else (0.0 if num == 0 else math.inf)


def _accumulation(ctx: Context):
    """The accumulated gradient over K micro-batches against the gradient of the mean loss
    over the same examples as one batch (funcgrad.train.accumulate's module docstring: equal
    up to rounding when each example's loss depends on that example alone)."""
    from funcgrad.train.accumulate import accumulate_grads, stack_microbatches

    subject = ctx.subject
    k = int(subject.accumulate or 1)
    m = max(2, min(subject.batch_size, 8))
    micro = [subject.data.rows(m, start=i * m) for i in range(k)]
    full = jax.tree.map(lambda *xs: np.concatenate(xs), *micro)
    per_example = subject.per_example_loss()
    import warnings

    with warnings.catch_warnings():  # the data check reports coupling itself
        warnings.simplefilter("ignore")
        acc = accumulate_grads(per_example, subject.params, stack_microbatches(micro))
    whole = jax.grad(lambda p, b: jnp.mean(per_example(p, b)))(subject.params, full)
    err = _rel(acc.grads, whole)
    norms = (math.sqrt(sum(float(jnp.sum(g.astype(jnp.float32) ** 2))
                           for g in jax.tree.leaves(acc.grads))),
             math.sqrt(sum(float(jnp.sum(g.astype(jnp.float32) ** 2))
                           for g in jax.tree.leaves(whole))))
    ratio = norms[0] / norms[1] if norms[1] else math.inf
    evidence = {"micro_batches": k, "rows_each": m, "relative_error": err, "norm_ratio": ratio}
    if subject.loss.takes_key:  # dropout draws other masks per micro-batch: compare sizes
        ok = 1 / 1.5 < ratio < 1.5
        how = "norm ratio (the loss draws random masks, so directions differ)"
    else:
        ok = err < 1e-3
        how = "relative error"
    if ok:
        return ("accumulate", "pass", f"accumulate={k}: accumulated gradient = full-batch "
                f"gradient ({how} {err if not subject.loss.takes_key else ratio:.2g})",
                evidence, {}, "")
    diffs = _worst_leaf(ctx, acc.grads, whole)
    return ("accumulate", "fail", f"accumulate={k}: the accumulated gradient differs from the "
            f"full-batch gradient by {err:.3g} relative (norm ratio {ratio:.3g})", evidence,
            ctx.place(diffs) if diffs else {},
            "Return one loss per example, undivided and not normalised by the batch (no "
            "loss / accum_steps, no sum): the step takes the exact mean. A loss coupled "
            "through the batch (BatchNorm in training mode, batch-centred) cannot be "
            "accumulated exactly: use per-example normalisation or drop accumulate."
            + (f" Off by a factor {ratio:.3g} ~ {k}: a loss scaled by the number of "
               "micro-batches." if abs(ratio * k - 1) < 0.05 or abs(ratio / k - 1) < 0.05
               else ""))


def _worst_leaf(ctx: Context, a, b) -> str:
    errs = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return ctx.paths[int(np.argmax(errs))] if errs and len(errs) == len(ctx.paths) else ""


def _scale_and_clip(ctx: Context):
    """One step of the user's step from the initial state against a float32 reference: the
    pre-clip norm the step reports must be the unscaled gradient's norm, and the update the
    same at two loss scales 2**8 apart."""
    from funcgrad.train.precision import LossScaleState

    subject = ctx.subject
    step, state = subject.make_step()
    batches = subject.data.train_batches()
    batch = subject.step_batch(batches)
    loss = subject.scalar_loss()
    if subject.accumulate:
        from funcgrad.train.accumulate import accumulate_grads

        reference = accumulate_grads(subject.per_example_loss(), subject.params, batch).grads
    else:
        reference = jax.grad(loss)(subject.params, batch)
    mask = ctx.trained
    true_norm = math.sqrt(sum(float(jnp.sum(jnp.asarray(g, jnp.float32) ** 2))
                              for g, t in zip(jax.tree.leaves(reference), mask) if t))
    updates = []
    scales = []
    evidence: dict = {"reference_norm": true_norm}
    tol = 5e-2 if step.compute_dtype is not None else 1e-3
    for factor in ((1.0, 2.0 ** -8) if state.loss_scale is not None else (1.0,)):
        s = state
        if state.loss_scale is not None:
            ls: LossScaleState = state.loss_scale
            s = state._replace(loss_scale=ls._replace(scale=ls.scale * factor))
            scales.append(float(s.loss_scale.scale))
        new, metrics = step(s, batch)
        if int(jnp.max(metrics.get("skipped", 0))):
            continue
        norm = float(jnp.mean(metrics["grad_norm"]))
        updates.append(jax.tree.map(lambda a, b: jnp.asarray(a, jnp.float32) -
                                    jnp.asarray(b, jnp.float32), new.params, state.params))
        evidence.setdefault("reported_norm", []).append(norm)
        if "clip_coef" in metrics:
            evidence.setdefault("clip_coef", []).append(float(jnp.min(metrics["clip_coef"])))
    evidence["scales"] = scales
    if not updates:
        return ("loss_scale", "warn", "every probe step was skipped (overflow at the loss "
                "scale): could not check", evidence, {},
                "Lower the initial loss scale.")
    reported = evidence["reported_norm"][0]
    off = abs(reported - true_norm) / max(true_norm, 1e-30)
    evidence["norm_relative_error"] = off
    if off > tol:
        return ("loss_scale", "fail", f"the step reports a pre-clip gradient norm of "
                f"{reported:.4g}, the unscaled gradient's is {true_norm:.4g}: clipping and "
                "the guard see a scaled gradient", evidence, {},
                "Unscale the gradients (divide by the loss scale) before the norm and "
                "the clipping; funcgrad's make_train_step(fg.mixed_precision(loss, dtype, "
                "loss_scale=), optax.chain(fg.clip_by_global_norm(c), tx)) does this.")
    clip = clip_norm(subject)
    if clip is not None and "clip_coef" in evidence:
        want = min(1.0, clip / true_norm) if true_norm else 1.0
        got = evidence["clip_coef"][0]
        if abs(got - want) > tol * max(want, 1e-12):
            return ("clip_norm", "fail", f"clip coefficient {got:.4g}, expected "
                    f"min(1, max_norm / ||g||) = {want:.4g} from the unscaled gradient",
                    evidence, {}, "Clip after unscaling, by the global norm of the unscaled "
                    "gradient.")
    if len(updates) == 2:
        diff = _rel(updates[1], updates[0])
        evidence["update_relative_difference"] = diff
        if diff > tol:
            return ("loss_scale", "fail", f"the update changes by {diff:.3g} relative when the "
                    "loss scale changes by 2**8: the scale leaks into the update", evidence,
                    {}, "Divide the gradients by the loss scale before clipping and the "
                    "optimizer.")
    what = ", ".join(x for x in ("loss_scale" if step.loss_scale is not None else "",
                                 f"clip_by_global_norm({clip:g})" if clip is not None else "") if x)
    return ("loss_scale", "pass", f"{what}: the step's norm is the unscaled gradient's "
            f"(relative error {off:.2g})", evidence, {}, "")


def _frozen(ctx: Context):
    """Two steps of the user's step: frozen leaves must stay bit-identical."""
    subject = ctx.subject
    step, state = subject.make_step()
    batches = subject.data.train_batches()
    start = state
    for _ in range(2):
        state, _ = step(state, subject.step_batch(batches))
    moved = [(path, t) for path, t, a, b in zip(ctx.paths, ctx.trained,
                                                 jax.tree.leaves(start.params),
                                                 jax.tree.leaves(state.params))
             if not np.array_equal(np.asarray(a), np.asarray(b))]
    frozen_moved = [p for p, t in moved if not t]
    evidence = {"frozen": [p for p, t in zip(ctx.paths, ctx.trained) if not t],
                "frozen_moved": frozen_moved, "trained_moved": [p for p, t in moved if t]}
    if frozen_moved:
        return ("trainable", "fail", f"{len(frozen_moved)} frozen leaf/leaves changed in two "
                f"steps: {', '.join(frozen_moved[:4])}", evidence, ctx.place(frozen_moved[0]),
                "Freeze with make_train_step(trainable=mask) or fg.freeze(optimizer, mask): a "
                "mask inside optax.chain after a transformation that moves every leaf (weight "
                "decay) does not freeze.")
    return ("trainable", "pass", f"{len(evidence['frozen'])} frozen leaves unchanged after two "
            "steps", evidence, {}, "")


def _gradient_ignored(ctx: Context):
    """The optimizer's first update for a random gradient g and for -2 g: a trained leaf whose
    update is the same both times (it ignores its gradient) yet not zero is frozen inside the
    optimizer (masked set_to_zero, a 'frozen' group of multi_transform) and still moved by what
    follows (weight decay). None when the optimizer cannot be probed this way."""
    subject = ctx.subject
    params = subject.params
    leaves, tree = jax.tree.flatten(params)
    floating = [jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) for x in leaves]
    rng = np.random.default_rng(ctx.subject.seed + 7)

    def gradient():
        return jax.tree.unflatten(tree, [
            jnp.asarray(rng.standard_normal(np.shape(x)), jnp.asarray(x).dtype) if f
            else jnp.zeros_like(x) for x, f in zip(leaves, floating)])
    try:
        opt = subject.step.optimizer
        state = opt.init(params)
        update = jax.jit(lambda g: opt.update(g, state, params)[0])
        g = gradient()  # and -2 g: a sign-based first step (Adam's) follows the sign, which
        first = jax.tree.leaves(update(g))  # two random draws of a 1-element leaf may share
        second = jax.tree.leaves(update(jax.tree.map(lambda x: -2 * x, g)))
    except Exception:  # noqa: BLE001 - an optimizer that needs more (extra args): not probed
        return None
    if len(first) != len(leaves):
        return None
    moved = []
    for path, trained, f, a, b in zip(ctx.paths, ctx.trained, floating, first, second):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        size = float(np.max(np.abs(a))) if a.size else 0.0
        if trained and f and size > 0 and float(np.max(np.abs(a - b))) <= 1e-6 * size:
            moved.append(path)
    evidence = {"gradient_ignored_but_updated": moved}
    if moved:
        return ("optimizer", "fail", f"{len(moved)} leaf/leaves are frozen inside the optimizer "
                f"yet updated: {', '.join(moved[:4])} get the same nonzero update whatever "
                "their gradient (weight decay after the freeze?)", evidence,
                ctx.place(moved[0]),
                "A set_to_zero mask (optax.masked, a 'frozen' multi_transform group) followed "
                "by weight decay (adamw, add_decayed_weights) still shrinks the frozen leaves. "
                "Freeze with make_train_step(trainable=mask) or fg.freeze(optimizer, mask), or "
                "mask the weight decay too.")
    return ("optimizer", "pass", "the optimizer's update follows the gradient on every "
            "trained leaf", evidence, {}, "")
