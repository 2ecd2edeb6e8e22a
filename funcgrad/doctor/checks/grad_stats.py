"""Gradient statistics at initialisation, per leaf and per layer (the article's checklist,
B5.3 item 3: mean, std and global norm as a baseline), and the dead ReLU units at init."""
from __future__ import annotations

import math

import jax
import numpy as np

from funcgrad.doctor._context import Context
from funcgrad.doctor._finding import Finding
from funcgrad.doctor._places import layer_of
from funcgrad.doctor.checks.grad_flow import explanation

NAME = "grad_stats"

#: Above this global norm at init the gradient is called large: the article (A §4.2) calls
#: 0.01 to 10 normal; a factor of 100 beyond leaves room for large healthy models.
LARGE_NORM = 1e3
#: A layer whose norm is below this fraction of the largest layer's is attenuated: with depth,
#: vanishing gradients shrink by orders of magnitude (a 12-layer sigmoid net: ~1e-7).
LAYER_RATIO = 1e-4
#: A ReLU site with at least this fraction of units dead for the whole batch, at init.
DEAD_FRACTION = 0.5


def check(ctx: Context) -> Finding:
    from funcgrad.train.monitor import GradMonitor

    loss = ctx.subject.scalar_loss()
    grads = jax.jit(jax.grad(loss))(ctx.subject.params, ctx.batch)
    monitor = GradMonitor()
    _, m = monitor.measure(monitor.init(ctx.subject.params), grads)
    m = jax.device_get(m)
    trained = dict(zip(ctx.paths, ctx.trained))
    leaves = {name: {"norm": float(n), "mean": float(mu), "std": float(sd)}
              for name, n, mu, sd in zip(m.leaf_names, m.leaf_norm, m.leaf_mean, m.leaf_std)}
    layers = {name: float(n) for name, n in zip(m.layer_names, m.layer_norm)}
    watched = {name: n for name, n in layers.items()
               if any(trained.get(leaf, True) for leaf in leaves if leaf.startswith(name))}
    relus = explanation(ctx, ctx.batch).relus
    dead = {s.where or f"relu {i}": s.dead_fraction for i, s in enumerate(relus)}
    norm = float(m.grad_norm)
    evidence = {"global_norm": norm, "leaves": leaves, "layer_norm": layers,
                "dead_fraction": dead}
    ctx.curves["init_layer_norm"] = layers
    ctx.curves["init_dead_fraction"] = dead
    if not math.isfinite(norm):
        return Finding(NAME, "fail", f"global gradient norm at init is {norm}", evidence, {},
                       "See the nonfinite check for the operation and line.")
    findings = []
    if norm > LARGE_NORM:
        top = max(watched, key=lambda name: watched[name]) if watched else ""
        findings.append(("warn", f"global gradient norm at init is {norm:.3g} (above "
                         f"{LARGE_NORM:g}; 0.01 to 10 is usual)", {"layer": top},
                         "An exploding init: scale the weights by 1/sqrt(fan_in) (He or "
                         "Glorot), or normalise (LayerNorm, BatchNorm)."))
    live = {k: v for k, v in watched.items() if v > 0}
    if len(live) >= 2:
        top = max(live.values())
        low = min(live, key=lambda name: live[name])
        if live[low] < LAYER_RATIO * top:
            findings.append(("warn", f"layer {low} gets {live[low] / top:.2g} of the largest "
                             f"layer's gradient norm at init ({live[low]:.3g} vs {top:.3g}): "
                             "vanishing with depth", {"layer": low},
                             "Saturating activations (sigmoid, tanh) stacked deep shrink the "
                             "gradient layer by layer: use ReLU/GELU, residual connections, "
                             "normalisation, or a fan-in init."))
    worst = max(dead, key=lambda name: dead[name]) if dead else None
    if worst is not None and dead[worst] >= DEAD_FRACTION:
        units = next((s.units for i, s in enumerate(relus)
                      if (s.where or f"relu {i}") == worst), 0)
        feeding = _feeding(ctx, _short(worst), units)
        evidence["dead_relu_fed_by"] = feeding
        into = f" (fed by {', '.join(feeding)})" if feeding else ""
        findings.append(("warn", f"{100 * dead[worst]:.0f}% of the ReLU units at {worst}"
                         f"{into} are dead for all "
                         f"{np.shape(jax.tree.leaves(ctx.batch)[0])[0]} examples at init",
                         {"line": _short(worst),
                          "layer": layer_of(feeding[0]) if feeding else ""},
                         "Dead units get no gradient and never recover: a negative bias or a "
                         "too large init. Use zero biases and a fan-in init, or LeakyReLU."))
    if not findings:
        return Finding(NAME, "pass", f"global norm {norm:.3g} at init; layer norms "
                       f"{min(layers.values()):.3g} to {max(layers.values()):.3g}"
                       + (f"; at most {100 * dead[worst]:.0f}% ReLU units dead" if worst
                          else ""), evidence)
    verdict, summary, place, fix = findings[0]
    if "layer" in place and place["layer"]:
        leaf = next((name for name in leaves if name.startswith(place["layer"])), "")
        place = (ctx.place(leaf) if leaf else {}) | {k: v for k, v in place.items() if v}
    else:
        place = {k: v for k, v in place.items() if v}
    if len(findings) > 1:
        summary += "; " + "; ".join(f[1] for f in findings[1:])
    return Finding(NAME, verdict, summary, evidence, place, fix)


def _short(where: str) -> str:
    head = where.split(" ", 1)[0]
    parts = head.split(":")
    return ":".join(parts[:2]) if len(parts) >= 2 else head


def _feeding(ctx: Context, line: str, units: int) -> list[str]:
    """The params leaves feeding a ReLU at ``file.py:LINE``: the leaves first used on that line
    (``relu(x @ w + b)``), else those with an axis of `units` used on the nearest line above it
    in the same file (a dense layer written on the line before its ReLU)."""
    if ":" not in line:
        return []
    file, _, number = line.rpartition(":")
    if not number.isdigit():
        return []
    here = [p for p in ctx.paths if ctx.line_of(p) == line]
    if here:
        return here
    above: dict[int, list[str]] = {}
    for path, leaf in zip(ctx.paths, ctx.leaves()):
        where = ctx.line_of(path)
        f, _, n = where.rpartition(":")
        if f == file and n.isdigit() and int(n) < int(number) and \
                (not units or units in np.shape(leaf)):
            above.setdefault(int(n), []).append(path)
    return above[max(above)] if above else []
