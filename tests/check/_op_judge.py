"""Judges funcgrad.check_grads on the op table of `_op_table`: false failures on correct ops,
planted bugs caught (or not) against the resolution the report states.

The verdict rules (issue 12's "Done when", with the shared design's `LeafCheck.resolution`):
  * a correct op must give ``report.ok``; anything else is a false failure;
  * a planted single-element error e in input i, element j, must fail
      full mode:        when e > resolution + rtol * |g_j|  (g_j: the exact gradient there),
                        and the failing row's `worst_index` must be j;
      directional mode: when e > resolution (the design promises >= 99% over the random
                        tangents, so a miss above it is counted, and expected in <= 1%);
    and no other input's row may fail.

Fallbacks while `LeafCheck.resolution` does not exist (today's code): in full mode today's
absolute tolerance atol * max(1, |f|), the only absolute term of today's element test; in
directional mode the same tolerance plus rtol * ||g_leaf|| (an upper bound on rtol * |<g, v>|),
divided by q, the 1st percentile over the leaf's k random unit tangents v of max_t |v_t,j|
(|v_j|^2 ~ Beta(1/2, (n-1)/2) for a uniform unit vector in n dimensions). Each verdict
records which it used (`resolution_source`).
"""
from __future__ import annotations

import math

import jax
import numpy as np
from _op_table import Op, Plant, objective, plant_site, planted
from jax.test_util import check_grads as jax_check_grads
from scipy import stats

import funcgrad as fg

DTYPES = {"float64": np.float64, "float32": np.float32}


def directional_quantile(n: int, k: int, p: float = 0.01) -> float:
    """q with P(max over k uniform unit tangents in R^n of |v_j| <= q) = p (one fixed j)."""
    if n == 1:
        return 1.0
    return math.sqrt(stats.beta.ppf(p ** (1.0 / k), 0.5, (n - 1) / 2.0))


def resolution(report, row, plant: Plant, n: int, k: int) -> tuple[float, str]:
    """The resolution the report states for `row`, or today's fallback (module docstring)."""
    stated = getattr(row, "resolution", None)
    if stated is not None:
        return float(stated), "stated"
    floor = report.atol * max(1.0, abs(plant.value))
    if report.mode == "full":
        return floor, "fallback atol*max(1,|f|)"
    bound = floor + report.rtol * plant.grad_norms[plant.arg]
    return bound / directional_quantile(n, k), "fallback (atol*max(1,|f|)+rtol*|g|)/q99"


#: The check each mode names.
CHECKS = {"full": fg.check_grads, "directional": fg.check_directional}


def check_correct(op: Op, dtype: str, mode: str, order: int = 1) -> dict:
    """check_grads (or check_directional) on the unmodified op: the report must be ok."""
    xs = op.inputs(DTYPES[dtype])
    report = CHECKS[mode](objective(op, DTYPES[dtype]), *xs, argnums=tuple(range(len(xs))),
                          options=fg.CheckOptions(order=order))
    bad = [r for r in report.rows if not r.ok]
    return {"op": op.name, "dtype": dtype, "mode": mode, "order": order, "ok": report.ok,
            "statuses": [r.status for r in report.rows],
            "dtype_used": report.dtype_used,
            "lifted_from": getattr(report, "lifted_from", None),
            "resolutions": [getattr(r, "resolution", None) for r in report.rows],
            "detail": [f"{r.path}{r.worst_index}: analytic {r.analytic:.6g} numeric "
                       f"{r.numeric:.6g} abs err {r.max_abs_error:.3g}" for r in bad
                       if r.analytic is not None],
            "report": None if report.ok else str(report)}


def check_planted(op: Op, dtype: str, mode: str, deltas=(0.0, 1e-2, 1e-4),
                  num_directions: int = 4, with_jax: bool = False) -> list[dict]:
    """One verdict per delta for the bug planted at the op's largest |gradient| element.

    delta 0 runs the same custom_vjp with all-ones scales: JAX's own gradient, so the report
    must be ok (a false failure otherwise); it shares the compiled check with the bugs."""
    xs = op.inputs(DTYPES[dtype])
    plant = plant_site(op, xs)
    if plant is None:
        return []
    phi = planted(op, DTYPES[dtype])
    phi_jit = jax.jit(phi)  # for jax.test_util: one compilation for every delta
    argnums = tuple(range(len(xs)))
    n = int(np.prod(op.shapes[plant.arg], dtype=int))
    out = []
    for delta in deltas:
        scales = plant.scales(op, delta)
        report = (fg.check_grads(phi, *xs, scales, argnums=argnums) if mode == "full" else
                  fg.check_directional(phi, *xs, scales, argnums=argnums,
                                       num_directions=num_directions))
        row = report.rows[plant.arg]
        res, source = resolution(report, row, plant, n, num_directions)
        e = plant.error(delta)
        threshold = res + (report.rtol * abs(plant.grad) if mode == "full" else 0.0)
        others = [r.path for i, r in enumerate(report.rows) if i != plant.arg and not r.ok]
        verdict = {
            "op": op.name, "dtype": dtype, "mode": mode, "delta": delta,
            "leaf": row.path, "planted_index": list(plant.index), "n": n,
            "grad": plant.grad, "error": e, "resolution": res, "resolution_source": source,
            "threshold": threshold, "ratio": e / threshold if threshold > 0 else math.inf,
            "must_catch": bool(delta) and e > threshold, "caught": not row.ok,
            "status": row.status,
            "worst_index": None if row.worst_index is None else list(row.worst_index),
            "worst_ok": row.worst_index == plant.index,
            "other_leaves_failed": others,
            "lifted_from": getattr(report, "lifted_from", None),
            "dtype_used": report.dtype_used,
        }
        if with_jax and delta:
            verdict["jax_caught"] = jax_caught(phi_jit, xs, scales, dtype)
        out.append(verdict)
    return out


def jax_caught(phi, xs, scales, dtype: str) -> bool:
    """Whether ``jax.test_util.check_grads`` (order 1, rev, its default eps and tolerances for
    the inputs' dtype) fails the planted op; float32 runs without x64, as JAX's tests do.
    `phi` is jitted with the scales as an argument, so each delta reuses one compilation."""
    with jax.enable_x64(dtype == "float64"):
        try:
            jax_check_grads(lambda *a: phi(*a, scales), tuple(xs), order=1, modes=["rev"])
        except AssertionError:
            return True
    return False


def problems(verdicts: list[dict]) -> list[str]:
    """The verdicts the rules above reject, one line each (empty when all hold)."""
    lines = []
    for v in verdicts:
        where = f"{v['op']} [{v['dtype']}, {v['mode']}"
        if "delta" not in v:
            if not v["ok"]:
                lines.append(f"{where}, order {v['order']}] false failure: {v['detail']}")
            continue
        where += f", delta {v['delta']:g}]"
        if v["other_leaves_failed"] or (v["delta"] == 0 and v["caught"]):
            lines.append(f"{where} false failure ({v['status']}, others failing: "
                         f"{v['other_leaves_failed']}); worst {v['worst_index']}")
        if v["must_catch"] and not v["caught"]:
            lines.append(f"{where} missed: error {v['error']:.3g} > threshold "
                         f"{v['threshold']:.3g} ({v['resolution_source']})")
        if v["mode"] == "full" and v["delta"] and v["caught"] and not v["worst_ok"]:
            lines.append(f"{where} worst_index {v['worst_index']} != planted "
                         f"{v['planted_index']}")
    return lines
