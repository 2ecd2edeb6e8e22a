"""A short training run watching the gradient norm against the loss (the article's checklist,
B5.3 item 4): divergence, a loss that does not move, explosion and vanishing (the monitor's
alerts), units dying, model state never updated, and clipping advice from the observed norms
(clip near their 90th percentile; most steps clipped is a learning-rate problem: Pascanu et
al. 2013, arXiv:1211.5063 §3.2, set the threshold from the norms observed in training)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding
from funcgrad.doctor._steps import clip_norm

NAME = "training"

#: The run diverged when its last steps' mean loss is this many times its first steps'.
DIVERGED = 1.5
#: The loss did not move when its last steps' mean is above this fraction of its first steps'.
STUCK = 0.98


def run(ctx: Context) -> dict:
    """The training run (cached on `ctx`): per-step loss, norm, clip coefficient, layer norms
    and dead fractions, the final state, and the first non-finite step."""
    if "run" in ctx.shared:
        return ctx.shared["run"]
    subject = ctx.subject
    step, state = subject.make_step(monitor=True)
    start = state
    batches = subject.data.train_batches()
    record: dict = {"loss": [], "grad_norm": [], "clip_coef": [], "skipped": [],
                    "layer_norm": [], "dead": [], "alerts": []}
    layer_names: tuple = ()
    relu_names: tuple = ()
    from funcgrad.train.alerts import monitor_alerts

    previous = None
    for s in range(ctx.options.steps):
        batch = subject.step_batch(batches)
        before = state
        state, metrics = step(state, batch)
        loss = float(jnp.mean(metrics["loss"]))
        norm = float(jnp.mean(metrics["grad_norm"]))
        record["loss"].append(loss)
        record["grad_norm"].append(norm)
        if "clip_coef" in metrics:
            record["clip_coef"].append(float(jnp.min(metrics["clip_coef"])))
        record["skipped"].append(int(jnp.max(metrics.get("skipped", 0))))
        monitor = jax.device_get(metrics.get("monitor"))
        if monitor is not None:
            layer_names, relu_names = monitor.layer_names, monitor.relu_names
            record["layer_norm"].append(np.asarray(monitor.layer_norm).reshape(
                -1, len(layer_names))[-1].tolist())
            record["dead"].append(np.asarray(monitor.dead_fraction).reshape(
                -1, len(relu_names))[-1].tolist() if relu_names else [])
            record["alerts"] += monitor_alerts(monitor, previous=previous)
            previous = monitor
        if not (math.isfinite(loss) and math.isfinite(norm)):
            one = batch if not subject.accumulate else jax.tree.map(
                lambda x: x[0], batch.data if hasattr(batch, "data") else batch)
            ctx.shared["nonfinite_step"] = (s, before.params, one)
            break
    record |= {"state": state, "start": start, "layer_names": list(layer_names),
               "relu_names": list(relu_names)}
    ctx.shared["run"] = record
    return record


def check(ctx: Context) -> Finding:
    record = run(ctx)
    losses = np.asarray(record["loss"], float)
    norms = np.asarray(record["grad_norm"], float)
    n = len(losses)
    ctx.curves |= {"loss": losses.tolist(), "grad_norm": norms.tolist(),
                   "layer_norm": {name: [row[j] for row in record["layer_norm"]]
                                  for j, name in enumerate(record["layer_names"])},
                   "dead_fraction": {name: [row[j] for row in record["dead"]]
                                     for j, name in enumerate(record["relu_names"])}}
    finite = norms[np.isfinite(norms)]
    q = ctx.options.clip_quantile
    p90 = float(np.quantile(finite, q)) if finite.size else math.nan
    head = float(np.mean(losses[: max(1, min(5, n // 10 or 1))]))
    tail = float(np.mean(losses[-max(1, n // 10):]))
    alerts = record["alerts"]
    evidence = {"steps": n, "loss_first": head, "loss_last": tail,
                "grad_norm_median": float(np.median(finite)) if finite.size else None,
                f"grad_norm_p{round(100 * q)}": p90,
                "grad_norm_max": float(finite.max()) if finite.size else None,
                "alerts": [str(a) for a in alerts[:20]],
                "alert_counts": {k: sum(a.kind == k for a in alerts)
                                 for k in ("explosion", "vanishing", "dead_relu", "nonfinite")},
                "skipped_steps": int(sum(record["skipped"]))}
    clip = clip_norm(ctx.subject)
    advice = (f"If you clip, clip near the {round(100 * q)}th percentile of the observed "
              f"norms: optax.chain(fg.clip_by_global_norm({p90:.3g}), tx).")
    findings: list[tuple[str, str, dict, str]] = []
    if "nonfinite_step" in ctx.shared:
        s = ctx.shared["nonfinite_step"][0]
        findings.append(("fail", f"the loss or gradient went non-finite at step {s} "
                         f"(loss {losses[-1]:.4g}, grad norm {norms[-1]:.4g})", {},
                         "The nonfinite check locates the operation; a learning rate far too "
                         "high, or NaN in the data, are the usual causes."))
    elif tail > DIVERGED * losses[0] and math.isfinite(tail):
        exploded = [a for a in alerts if a.kind == "explosion"]
        why = (f"; the gradient norm exploded from step {exploded[0].step} "
               f"({exploded[0].value:.3g} > {exploded[0].threshold:.3g})" if exploded else "")
        findings.append(("fail", f"the loss rose from {losses[0]:.4g} to {tail:.4g} in {n} steps"
                         f"{why}: training diverges", {},
                         "Lower the learning rate (by 10x), or clip: " + advice))
    elif not (tail < STUCK * head):
        findings.append(("warn", f"the loss did not decrease in {n} steps ({head:.4g} -> "
                         f"{tail:.4g}) while the gradient norm was {np.median(finite):.3g}"
                         if finite.size else f"the loss did not decrease in {n} steps", {},
                         "With a gradient of ordinary size and a flat loss, check the data "
                         "(labels matching inputs) and the learning rate (too low, or so high "
                         "it oscillates)."))
    vanishing = [a for a in alerts if a.kind == "vanishing"]
    if vanishing:
        findings.append(("warn", f"layer {vanishing[0].where}'s gradient vanished (norm "
                         f"{vanishing[0].value:.3g} < {vanishing[0].threshold:g} and < 1% of "
                         f"the global norm for 10 steps, from step {vanishing[0].step})",
                         {"layer": vanishing[0].where},
                         "Use non-saturating activations, residual connections or "
                         "normalisation; a fan-in init."))
    if record["dead"] and record["relu_names"]:
        last = dict(zip(record["relu_names"], record["dead"][-1]))
        worst = max(last, key=lambda name: last[name])
        evidence["dead_fraction_last"] = last
        if last[worst] >= 0.9:
            findings.append(("warn", f"{100 * last[worst]:.0f}% of the units at {worst} are "
                             f"dead at step {n - 1}", {"line": _short(worst)},
                             "Units died during training: lower the learning rate, use "
                             "LeakyReLU, or check the init's biases."))
    stale = _stale_state(record)
    if stale:
        evidence["model_state_unchanged"] = stale
        findings.append(("warn", f"the model state never changed in {n} steps ({stale[0]}"
                         + (f" and {len(stale) - 1} more" if len(stale) > 1 else "") + ")",
                         {"leaf": stale[0]},
                         "The loss must return the new model state (BatchNorm's running "
                         "statistics): (loss, new_model_state) with has_state=True."))
    if clip is not None and finite.size:
        clipped = float(np.mean(finite > clip))
        evidence["clipped_fraction"] = clipped
        if clipped > 0.5:
            findings.append(("warn", f"{100 * clipped:.0f}% of the steps were clipped "
                             f"(clip_by_global_norm({clip:g}), median norm "
                             f"{np.median(finite):.3g})", {},
                             "Most steps clipped means the clipping is setting the step size: "
                             "lower the learning rate, or " + advice))
    if not findings:
        return Finding(NAME, "pass", f"loss {head:.4g} -> {tail:.4g} in {n} steps, gradient "
                       f"norm median {np.median(finite):.3g}, p{round(100 * q)} {p90:.3g}; "
                       f"{len(alerts)} monitor alerts", evidence, {}, advice)
    findings.sort(key=lambda f: ("fail", "warn").index(f[0]))
    verdict, summary, place, fix = findings[0]
    if "layer" in place:
        leaf = next((p for p in ctx.paths if p.startswith(place["layer"])), "")
        place = (ctx.place(leaf) if leaf else {}) | {"layer": place["layer"]}
    if len(findings) > 1:
        summary += "; " + "; ".join(f[1] for f in findings[1:])
    return Finding(NAME, verdict, summary, evidence, place, fix)


def _stale_state(record: dict) -> list[str]:
    """Paths of the floating model-state leaves, when none of them changed in the run."""
    from funcgrad._paths import leaf_names

    before, after = record["start"].model_state, record["state"].model_state
    if before is None or len(record["loss"]) < 2:
        return []
    names = leaf_names(before, "model_state")
    pairs = [(name, a, b) for name, a, b in zip(names, jax.tree.leaves(before),
                                                 jax.tree.leaves(after))
             if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    if not pairs or any(not np.array_equal(np.asarray(a), np.asarray(b)) for _, a, b in pairs):
        return []
    return [name for name, _, _ in pairs]


def _short(where: str) -> str:
    head = where.split(" at ", 1)[-1].split(" ", 1)[0]
    parts = head.split(":")
    return ":".join(parts[:2]) if len(parts) >= 2 else head
