"""The loss at initialisation against log(K): a classifier that starts with no preference
predicts 1/K for every class, and its cross-entropy is -log(1/K) = log(K) whatever the class
frequencies (Karpathy, "A Recipe for Training Neural Networks", 2019: "verify loss @ init")."""
from __future__ import annotations

import math

import jax
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding
from funcgrad.doctor.checks.data import label_leaf

NAME = "init_loss"


def classes_of(ctx: Context) -> tuple[int | None, str]:
    """K and where it came from: the model file's `classes`, or the labels when they are one
    integer per example and hold exactly the values 0..K-1 (K <= 1000)."""
    if ctx.subject.classes is not None:
        return int(ctx.subject.classes), "classes"
    found = label_leaf(ctx.subject.data.sample())
    if found is None:
        return None, ""
    y = found[1]
    values = np.unique(y)
    if y.ndim == 1 and 2 <= values.size <= 1000 and values[0] == 0 and \
            values[-1] == values.size - 1:
        return int(values.size), f"the {values.size} distinct labels of {found[0]}"
    return None, ""


def check(ctx: Context) -> Finding:
    k, source = classes_of(ctx)
    loss = float(jax.jit(ctx.subject.scalar_loss())(ctx.subject.params, ctx.batch))
    evidence = {"loss": loss, "classes": k, "classes_from": source,
                "rows": int(np.shape(jax.tree.leaves(ctx.batch)[0])[0])}
    if not math.isfinite(loss):
        return Finding(NAME, "fail", f"the loss at init is {loss} on {evidence['rows']} "
                       "examples", evidence, {},
                       "See the nonfinite check for the operation and line that made it.")
    if k is None:
        return Finding(NAME, "skipped", f"loss at init {loss:.4g}; no class count to compare "
                       "with log(K) (define classes = K in the model file)", evidence)
    expected = math.log(k)
    ratio = loss / expected
    evidence |= {"expected": expected, "ratio": ratio}
    limit = ctx.options.init_loss_ratio
    if ratio > limit:
        cause, fix, place = _why_large(ctx, loss, expected, evidence)
        return Finding(NAME, "warn", f"loss at init {loss:.4g} is {ratio:.1f}x log({k}) = "
                       f"{expected:.4g}: {cause}", evidence, place, fix)
    if ratio < 1 / limit:
        return Finding(NAME, "warn", f"loss at init {loss:.4g} is far below log({k}) = "
                       f"{expected:.4g}: an untrained model should not do this well",
                       evidence, {},
                       "Look for labels leaking into the inputs, a loss that is not "
                       "cross-entropy over K classes, or a wrong classes = K.")
    return Finding(NAME, "pass", f"loss at init {loss:.4g}, log({k}) = {expected:.4g} "
                   f"(ratio {ratio:.2f})", evidence)


#: A weight whose std x sqrt(fan-in) is above this (a fan-in init gives about 1 to 1.5) and
#: this many times the median of the other weights' is called the outlier layer.
OUTLIER_SCALE = 10.0


def _why_large(ctx: Context, loss: float, expected: float, evidence: dict
               ) -> tuple[str, str, dict]:
    """The cause of a loss far above log(K), by what the evidence shows: the loss on half the
    rows (a loss summed over examples halves with them), the losses of single examples (large
    confident logits make some examples' loss near 0 and others huge; a loss multiplied by a
    constant lifts every example) and the weights' scale (an outlier layer)."""
    f = jax.jit(ctx.subject.scalar_loss())
    batch, params = ctx.batch, ctx.subject.params
    rows = int(np.shape(jax.tree.leaves(batch)[0])[0])
    place = _outlier_layer(ctx, evidence)
    if rows >= 4:
        try:
            half = float(f(params, jax.tree.map(lambda x: x[:rows // 2], batch)))
        except Exception:  # noqa: BLE001 - a loss that needs this batch size: no probe
            half = math.nan
        evidence["loss_half_batch"] = half
        if math.isfinite(half) and half > 0 and abs(loss / half - 2) < 0.4:
            return (f"the loss doubles with the batch ({loss:.4g} on {rows} examples, "
                    f"{half:.4g} on {rows // 2}): it looks summed over the examples, not "
                    "averaged",
                    "Average the per-example losses (jnp.mean, not jnp.sum, and no multiply "
                    "by the batch size): a summed loss makes the gradient and the effective "
                    "learning rate grow with the batch.", place)
    singles = []
    try:
        for i in range(min(rows, 16)):
            singles.append(float(f(params, jax.tree.map(lambda x, i=i: x[i:i + 1], batch))))
    except Exception:  # noqa: BLE001 - a loss that cannot take one example: no probe
        singles = []
    if singles and all(math.isfinite(v) for v in singles):
        small = float(np.mean(np.asarray(singles) < 0.1 * expected))
        evidence |= {"single_example_losses": singles, "fraction_near_zero": small}
        if small >= 0.05:
            return ("the initial logits are large and confident (some examples' loss is near "
                    "0, others' far above log K)" + _named(place),
                    "Scale the init down (fan-in variance 1/n_in, a zero or small last layer)"
                    + (f"; {place['layer']} is the outlier" if place else "") + ".", place)
        least = min(singles) / expected
        return (f"every example's loss is far above log K (the smallest {least:.3g}x): a loss "
                "multiplied by a constant (a hand-made loss scale, a sum over micro-batches) "
                "or large initial logits" + _named(place),
                "If the loss is scaled on purpose (loss scaling), unscale the gradients before "
                "clipping and the optimizer (funcgrad.mixed_precision(loss, dtype, "
                "loss_scale=) does); otherwise "
                "return the mean cross-entropy over logits, and check the init's scale.", place)
    return ("large, confident initial logits, or a loss multiplied by a constant (a "
            "hand-made loss scale, a sum)" + _named(place),
            "Scale the init down (fan-in variance 1/n_in, a zero or small last layer), or "
            "check the loss is mean cross-entropy over logits (not a sum, not scaled, not over "
            "probabilities).", place)


def _named(place: dict) -> str:
    return (f"; the weights of {place['layer']} are far larger than a fan-in init's"
            if place else "")


def _outlier_layer(ctx: Context, evidence: dict) -> dict:
    """The place of the weight leaf whose scale (std x sqrt(fan-in), fan-in the smaller of the
    two readings of its layout) is far above a fan-in init's and the others', or {}."""
    scales = {}
    for path, leaf in zip(ctx.paths, ctx.leaves()):
        x = np.asarray(leaf)
        if x.ndim < 2 or not np.issubdtype(x.dtype, np.floating) or x.size < 4:
            continue
        fan = min(x.size // x.shape[-1], x.size // x.shape[0])
        scales[path] = float(np.std(x) * math.sqrt(fan))
    if len(scales) < 2:
        return {}
    worst = max(scales, key=lambda p: scales[p])
    others = float(np.median([v for p, v in scales.items() if p != worst]))
    evidence["weight_scale"] = scales
    if scales[worst] > OUTLIER_SCALE and scales[worst] > OUTLIER_SCALE * max(others, 1e-12):
        evidence["outlier_weight"] = worst
        return ctx.place(worst)
    return {}
