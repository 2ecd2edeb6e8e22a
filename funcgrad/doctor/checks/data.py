"""The data check: labels out of range or shifted, constant and non-finite features, and
examples coupled through the batch."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._paths import leaf_names
from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding

NAME = "data"

#: Keys that name the labels of a batch (a dict's key, or a field's name).
LABEL_KEYS = ("y", "label", "labels", "target", "targets")


def check(ctx: Context) -> Finding:
    sample = ctx.subject.data.sample()
    names = leaf_names(sample, "data")
    leaves = jax.tree.leaves(sample)
    problems: list[tuple[str, str, dict, dict, str]] = []  # verdict, summary, evidence, place, fix
    evidence: dict[str, Any] = {"examples_scanned": int(np.shape(leaves[0])[0])}
    labels = label_leaf(sample)
    if labels is not None:
        problems += _labels(labels[0], labels[1], ctx.subject.classes, evidence)
    inputs = [(name, x) for name, x in zip(names, leaves)
              if labels is None or name != labels[0]]
    constant_leaves: list[str] = []
    for name, x in inputs:
        if np.issubdtype(x.dtype, np.floating):
            problems += _features(name, np.asarray(x, np.float64), evidence, constant_leaves)
        elif np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.bool_):
            _integer_input(name, np.asarray(x), evidence, constant_leaves)
    problems += _constant_inputs(inputs, constant_leaves, evidence)
    problems += _coupling(ctx, evidence)
    if not problems:
        zeros = sum(v["count"] for v in evidence.get("constant_features", {}).values())
        return Finding(NAME, "pass", "labels in range, features finite"
                       + (f" ({zeros} features constant, as a blank border pixel)" if zeros
                          else "") + "; " + evidence.get("coupled", "examples independent of "
                                                         "each other"), evidence)
    problems.sort(key=lambda p: ("fail", "warn").index(p[0]))
    verdict, summary, more, place, fix = problems[0]
    if len(problems) > 1:
        summary += f" (and {len(problems) - 1} more: " + "; ".join(p[1] for p in problems[1:]) + ")"
    return Finding(NAME, verdict, summary, evidence | more, place, fix)


def label_leaf(batch: Any) -> tuple[str, np.ndarray] | None:
    """``(path, labels)``: the integer leaf named like a label (`LABEL_KEYS`), or None."""
    for path, leaf in zip(leaf_names(batch, "data"), jax.tree.leaves(batch)):
        last = path.rsplit("[", 1)[-1].strip("]'\"").rsplit(".", 1)[-1]
        if last.lower() in LABEL_KEYS and np.issubdtype(np.asarray(leaf).dtype, np.integer):
            return path, np.asarray(leaf)
    return None


def _labels(path: str, y: np.ndarray, classes: int | None, evidence: dict) -> list:
    lo, hi = int(y.min()), int(y.max())
    values = np.unique(y)
    evidence["labels"] = {"leaf": path, "min": lo, "max": hi, "distinct": int(values.size),
                          "classes": classes}
    place = {"leaf": path}
    if classes is not None:
        bad = (y < 0) | (y >= classes)
        if lo == 1 and hi == classes:
            return [("fail", f"labels run 1..{classes}, not 0..{classes - 1}: shifted by one",
                     {"rows_out_of_range": int(bad.sum())}, place,
                     f"Subtract 1 from the labels ({path} - 1): class k must be index k of "
                     "the logits; label K is out of range and gathers a clamped logit.")]
        if bad.any():
            rows = np.argwhere(bad.reshape(len(y), -1).any(axis=1))[:, 0]
            return [("fail", f"{int(bad.sum())} labels outside 0..{classes - 1} (min {lo}, "
                     f"max {hi})", {"rows_out_of_range": int(bad.sum()),
                                    "first_rows": rows[:5].tolist()}, place,
                     f"Labels must lie in 0..{classes - 1}; JAX clamps an out-of-range index "
                     "silently, so the loss reads another class's logit.")]
        return []
    if y.ndim == 1 and lo == 1 and values.size == hi and values.size >= 2:
        return [("warn", f"labels run 1..{hi} with no 0: shifted by one?", {}, place,
                 f"If there are {hi} classes, subtract 1 from the labels; define classes = K "
                 "in the model file to have them checked against K.")]
    return []


def _features(name: str, x: np.ndarray, evidence: dict, constant_leaves: list) -> list:
    out = []
    flat = x.reshape(len(x), -1)
    finite = np.isfinite(flat)
    if not finite.all():
        rows = np.argwhere(~finite.all(axis=1))[:, 0]
        cols = np.argwhere(~finite.all(axis=0))[:, 0]
        out.append(("fail", f"{name} holds {int((~finite).sum())} NaN/inf values in "
                    f"{rows.size} examples", {"nonfinite": {
                        "leaf": name, "values": int((~finite).sum()), "rows": rows[:10].tolist(),
                        "features": cols[:10].tolist()}}, {"leaf": name},
                    f"Drop or impute the rows {rows[:5].tolist()} of {name} (np.isnan) before "
                    "training: one NaN input makes the whole batch's gradient NaN."))
        flat = np.where(finite, flat, np.nan)
    if len(flat) < 2:
        return out
    with np.errstate(invalid="ignore"):
        spread = np.nanmax(flat, axis=0) - np.nanmin(flat, axis=0)
        first = np.nanmin(flat, axis=0)
    constant = spread == 0
    if constant.all() and flat.shape[1] > 0:
        constant_leaves.append(name)
        evidence.setdefault("constant_features", {})[name] = {
            "count": int(constant.sum()), "of": int(constant.size),
            "value": float(first.flat[0])}
    elif constant.any():
        nonzero = np.argwhere(constant & (first != 0))[:, 0]
        evidence.setdefault("constant_features", {})[name] = {
            "count": int(constant.sum()), "of": int(constant.size),
            "nonzero": nonzero[:10].tolist()}
        # A few constant columns (a blank border pixel, standardised or not) are harmless to
        # the gradients; most of the input constant is a pipeline that lost the input.
        if constant.sum() > MOSTLY_CONSTANT * constant.size:
            out.append(("warn", f"{int(constant.sum())} of the {constant.size} features of "
                        f"{name} are the same in every example of the "
                        f"{len(flat)} scanned", {}, {"leaf": name},
                        "Most of this input carries no information: check the preprocessing "
                        "(a crop, a mask or a normalisation that blanked it)."))
    return out


#: Warn when more than this fraction of an input leaf's features are constant.
MOSTLY_CONSTANT = 0.5


def _integer_input(name: str, x: np.ndarray, evidence: dict, constant_leaves: list) -> None:
    """An integer (token, index) input: constant when every element of every example is the
    same value."""
    if x.size == 0 or len(x) < 2:
        return
    if np.all(x == x.flat[0]):
        constant_leaves.append(name)
        evidence.setdefault("constant_features", {})[name] = {
            "count": int(x[0].size), "of": int(x[0].size), "value": int(x.flat[0])}


def _constant_inputs(inputs: list, constant_leaves: list, evidence: dict) -> list:
    """Fail when every input leaf (all but the labels) is the same for every example; warn
    when one whole input leaf among others is."""
    if not constant_leaves:
        return []
    name = constant_leaves[0]
    value = evidence["constant_features"][name]["value"]
    if len(constant_leaves) == len(inputs):
        return [("fail", f"{name} is the same for every example (value {value:.4g}): the model "
                 "cannot see its input", {}, {"leaf": name},
                 "Check the preprocessing that builds this input (a broadcast of one row, a "
                 "normalisation dividing by a zero std, an integer division, a column "
                 "overwritten by a padding mask).")]
    return [("warn", f"input {', '.join(constant_leaves)} is the same for every example "
             f"({name} = {value:.4g})", {}, {"leaf": name},
             "This input carries no information: check the step that builds it.")]


def _coupling(ctx: Context, evidence: dict) -> list:
    """Whether an example's loss depends on other examples of the batch: the cross terms
    d2 L / dx_i dx_j (i != j) of the loss's Hessian in the floating inputs, which are exactly
    zero when the loss is a sum or mean of per-example terms (one Hessian-vector product with
    a tangent on row 0 only). Integer-only inputs: the loss of the batch against the mean of
    its two halves' losses."""
    subject = ctx.subject
    batch = jax.tree.map(jnp.asarray, subject.data.rows(4))
    rows = int(np.shape(jax.tree.leaves(batch)[0])[0])
    if rows < 2:
        return []
    loss = subject.scalar_loss()
    flat, tree = jax.tree.flatten(batch)
    floats = [i for i, x in enumerate(flat) if jnp.issubdtype(x.dtype, jnp.floating)]
    if floats:
        def f(xs):
            leaves = list(flat)
            for i, x in zip(floats, xs):
                leaves[i] = x
            return loss(subject.params, jax.tree.unflatten(tree, leaves))
        xs = [flat[i] for i in floats]
        rng = np.random.default_rng(0)
        tangent = [jnp.asarray(np.concatenate([rng.normal(size=(1, *x.shape[1:])),
                                               np.zeros((rows - 1, *x.shape[1:]))]), x.dtype)
                   for x in xs]
        try:
            _, hv = jax.jvp(jax.grad(f), (xs,), (tangent,))
        except TypeError:  # a custom_vjp rule has no forward mode: reverse over reverse
            def along(ys):
                return sum(jnp.vdot(g, t) for g, t in zip(jax.grad(f)(ys), tangent))
            hv = jax.grad(along)(xs)
        own = max(float(jnp.max(jnp.abs(h[:1]))) for h in hv)
        cross = max(float(jnp.max(jnp.abs(h[1:]))) for h in hv)
        measure = cross / own if own > 0 else (np.inf if cross > 0 else 0.0)
        coupled = bool(cross > 1e-5 * max(own, 1e-30)) and np.isfinite(cross)
        how = "Hessian cross terms between examples"
    elif not subject.loss.takes_key and rows >= 4:
        half = rows // 2
        whole = float(loss(subject.params, batch))
        parts = [float(loss(subject.params, jax.tree.map(lambda x, s=s: x[s], batch)))
                 for s in (slice(0, half), slice(half, 2 * half))]
        measure = abs(whole - sum(parts) / 2) / max(abs(whole), 1e-30)
        summed = abs(whole - sum(parts)) / max(abs(whole), 1e-30)
        coupled = bool(measure > 1e-4 and summed > 1e-4)
        how = "loss of the batch against the mean of its halves' losses"
    else:
        evidence["coupling"] = "not probed: no floating input, and the loss takes a key"
        return []
    evidence["coupling"] = {"coupled": coupled, "relative_cross_term": float(measure),
                            "probe": how, "rows": rows}
    if not coupled:
        return []
    if subject.accumulate:
        return [("warn", f"examples are coupled through the batch ({how}: "
                 f"{measure:.3g} relative), and the step accumulates micro-batches "
                 "(funcgrad.accumulate)", {}, {},
                 "Accumulation averages micro-batches computed separately: with batch "
                 "statistics (BatchNorm in training mode) or a loss centred on the batch, the "
                 "accumulated gradient is not the full-batch one. Use per-example losses "
                 "(LayerNorm/GroupNorm, running statistics) or drop accumulate.")]
    if subject.model_state is None:
        return [("warn", f"examples are coupled through the batch ({how}: {measure:.3g} "
                 "relative) and the model has no state: a loss centred on, or normalised by, "
                 "the batch?", {}, {},
                 "Each example's loss should depend on that example alone, unless the "
                 "coupling is the point (in-batch negatives of a contrastive loss).")]
    evidence["coupled"] = ("examples are coupled through the batch (batch statistics, as "
                           "BatchNorm in training mode): fine without accumulation")
    return []
