"""The gradient check's verdicts: per-element classification, one row per leaf, and the report.

An element fails when |analytic - numeric| > atol + rtol·|numeric| + noise, noise being the
estimated error of that central difference (round-off and truncation, see `funcgrad.check._noise`);
the caller passes ``atol + noise`` as the absolute part. A failing element is *explained*
rather than failed when
  * it sits at a non-differentiable point: the one-sided differences (f(x+h) - f(x))/h and
    (f(x) - f(x-h))/h disagree by more than the tolerance and JAX's value lies between them
    (JAX picks one side or their mean there: abs'(0) = 1, relu'(0) = 0, maximum(x, 0)'(0) = 0.5);
  * or, when the program has a stop_gradient, the gradient of the same program with
    stop_gradient made transparent matches the finite difference: status "stop_gradient", a
    failure (a weight detached by mistake trains no more), unless the caller declared the cut
    (``allow_stop_gradient=``): "stop_gradient_declared", which passes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

#: "stop_gradient" is a failure whose cause is named; "stop_gradient_declared" passes.
STATUSES = ("ok", "fail", "nondifferentiable_point", "stop_gradient", "stop_gradient_declared")
PASSING = ("ok", "nondifferentiable_point", "stop_gradient_declared")


def classify_elements(grad, numeric, right, left, see_through, atol_abs, rtol, eps,
                      smooth=None, reference=None) -> dict[str, Any]:
    """Element-wise verdicts; every argument is a float64 vector of the same length (or None);
    `atol_abs` (atol + each element's noise) and `eps` (each element's step) may be scalars.

    A kink is told from curvature by the gap between the one-sided differences: for a smooth
    function it is eps·|f''|, so a gap above sqrt(eps)·(1 + |numeric|) means |f''| > 1/sqrt(eps)
    (1,000 in float64) or a jump in the derivative; a gap that large is reported as a kink even
    when the central difference happens to match JAX's value (maximum(x, 0) at 0: both 0.5).
    `smooth` (bool, optional) marks elements a second, smaller step showed to be curvature (the
    gap shrank with the step, which a jump's does not): never kinks. `reference` (optional;
    given when the program has custom rules) is the gradient with those rules inlined, JAX's
    own convention at a kink (NaN where unknown): a kink is then excused only where `grad` is
    JAX's value, a one-sided difference or their mean, not anywhere between them (a custom
    rule giving 0.55 of a maximum's tie is wrong); the others are marked "convention" and
    fail. A NaN or inf derivative (analytic or numeric) that the other does not equal fails:
    ``err > tol`` alone is False for NaN.
    """
    tol = atol_abs + rtol * np.abs(numeric)
    with np.errstate(invalid="ignore"):
        err = np.abs(grad - numeric)
        fail = ~((err <= tol) | (grad == numeric))
    lo, hi = np.minimum(left, right), np.maximum(left, right)
    gap = np.abs(right - left)
    kink = ((gap > np.maximum(tol, np.sqrt(eps) * (1 + np.abs(numeric))))
            & (grad >= lo - tol) & (grad <= hi + tol))
    if smooth is not None:
        kink &= ~smooth
    convention = np.zeros_like(kink)
    if reference is not None:
        # A one-sided difference is off by eps/2·|f''| < sqrt(eps)/2 (the curvature bound above).
        slack = tol + np.sqrt(eps) / 2 * (1 + np.abs(numeric))
        with np.errstate(invalid="ignore"):
            follows = ((np.abs(grad - reference) <= tol) | (np.abs(grad - left) <= slack)
                       | (np.abs(grad - right) <= slack) | (np.abs(grad - numeric) <= slack))
        convention = kink & ~follows
        kink &= follows
    if see_through is None:
        sg = np.zeros_like(fail)
    else:
        sg = (fail & ~kink & (np.abs(see_through - numeric) <= tol)
              & (np.abs(grad - see_through) > tol))
    return dict(grad=grad, numeric=numeric, right=right, left=left, err=err, tol=tol, fail=fail,
                kink=kink, sg=sg, explained=kink | sg, convention=convention,
                reference=reference)


def _convention(a, left, right, tol):
    if abs(a - right) <= tol and abs(a - left) > tol:
        return "the right derivative"
    if abs(a - left) <= tol and abs(a - right) > tol:
        return "the left derivative"
    if abs(a - (left + right) / 2) <= tol:
        return "the mean of the one-sided derivatives"
    return "a subgradient between them"


@dataclasses.dataclass(frozen=True)
class LeafCheck:
    """One differentiated leaf's verdict.

    Attributes:
      path: the leaf's name, argument name plus pytree path, e.g. ``params[1]['w']``.
      shape: the leaf's shape; dtype: the dtype the function computed in.
      status: "ok", "fail", "nondifferentiable_point" (only kinks disagreed; not a failure),
        "stop_gradient" (differs from finite differences only because of stop_gradient: a
        failure, named) or "stop_gradient_declared" (the same, declared with
        ``allow_stop_gradient=``: passes).
      max_abs_error, max_rel_error: over the leaf's elements (full mode) or tangents
        (directional mode), excluding explained elements; rel = abs / max(|analytic|, |numeric|).
      worst_index: index (into `shape`) of the worst element, or None when not located.
      analytic, numeric: the two derivatives at `worst_index` (or along the worst tangent).
      kinks: ``(index, left, right, jax_value, convention)`` for elements at kinks.
      notes: further remarks, e.g. which mode failed or how the element was located.
      resolution: in full mode, ``max_i (atol + 2·noise_i)`` over the leaf's elements, in the
        derivative's units: an error e planted in one element j is certainly reported when
        e > resolution + rtol·|numeric_j| (unless j sits at a non-differentiable point,
        where a value between the one-sided derivatives is excused). noise_i is the error
        bound of element i's central difference: the round-off floor ``4·u·|f|/h`` (u the
        dtype's unit round-off), or where that was not enough, the round-off and truncation
        measured from 17 evaluations around the point (`funcgrad.check._noise`). It counts twice
        because the numeric value may be off by noise_i in the direction that hides e. In
        directional mode, the smallest single-element error reported with probability >= 99%
        over the random tangents (`funcgrad.check._directions.block_resolution`). None when not
        stated.
    """
    path: str
    shape: tuple[int, ...]
    dtype: str
    status: str
    max_abs_error: float
    max_rel_error: float
    worst_index: tuple[int, ...] | None
    analytic: float | None
    numeric: float | None
    kinks: tuple = ()
    notes: tuple[str, ...] = ()
    resolution: float | None = None

    @property
    def ok(self) -> bool:
        return self.status in PASSING

    @classmethod
    def from_elements(cls, path, shape, dtype, c, lo, hi, fwd, atol_abs, rtol,
                      allowed) -> LeafCheck:
        s = slice(lo, hi)
        kink, sg = c["kink"][s], c["sg"][s]
        excused = kink | (sg if allowed else np.zeros_like(sg))
        err, tol, grad, num = c["err"][s], c["tol"][s], c["grad"][s], c["numeric"][s]
        notes, abs_err, rel_err, worst = [], 0.0, 0.0, None
        considered = ~excused
        failed = bool((c["fail"][s] & ~kink & ~sg).any())  # a cause not named: a plain failure
        bad = considered & ~(np.isfinite(grad) & np.isfinite(num)) & c["fail"][s]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            notes.append(f"{int(bad.sum())} element(s) have a non-finite derivative; at "
                         f"{tuple(int(j) for j in np.unravel_index(i, shape))} JAX gives "
                         f"{grad[i]:.6g} and the central difference {num[i]:.6g} (a NaN "
                         "is never a pass)")
        if considered.any():
            ratio = np.where(considered, err / tol, -1.0)
            w = int(np.argmax(ratio))
            worst = (tuple(int(i) for i in np.unravel_index(w, shape)), float(grad[w]),
                     float(num[w]))
            abs_err = float(err[considered].max())
            rel_err = float(_rel(err, grad, num)[considered].max())
        if fwd is not None:
            jvps, projected, f_noise = fwd
            f_err = np.abs(jvps - projected)
            f_tol = atol_abs + rtol * np.abs(projected) + f_noise
            abs_err = max(abs_err, float(f_err.max()))
            rel_err = max(rel_err, float(_rel(f_err, jvps, projected).max()))
            f_bad = ~(f_err <= f_tol)  # NaN fails too
            if f_bad.any():
                failed = True
                notes.append(f"fwd: jvp disagrees with the numerical gradient along "
                             f"{int(f_bad.sum())} of {len(f_err)} random tangents "
                             f"(max error {float(np.max(f_err)):.3g})")
        kinks = tuple(
            (tuple(int(j) for j in np.unravel_index(i, shape)), float(c["left"][s][i]),
             float(c["right"][s][i]), float(grad[i]),
             _convention(grad[i], c["left"][s][i], c["right"][s][i], tol[i]))
            for i in np.flatnonzero(kink))
        if kinks:
            notes.append(f"{len(kinks)} element(s) at a non-differentiable point; at {kinks[0][0]} "
                         f"the one-sided derivatives are {kinks[0][1]:.6g} (left) and "
                         f"{kinks[0][2]:.6g} (right) and JAX's value {kinks[0][3]:.6g} is "
                         f"{kinks[0][4]}")
        wrong = (np.flatnonzero(c["convention"][s]) if "convention" in c
                 else np.zeros(0, np.intp))
        if len(wrong):
            i = wrong[0]
            ref = c["reference"][s][i]
            own = (f"JAX's own rule gives {ref:.6g} there" if np.isfinite(ref) else
                   "JAX's own rule could not be evaluated")
            notes.append(f"{len(wrong)} element(s) at a non-differentiable point where the "
                         f"custom rule's value follows no convention: at "
                         f"{tuple(int(j) for j in np.unravel_index(i, shape))} it gives "
                         f"{grad[i]:.6g}, the one-sided derivatives are {c['left'][s][i]:.6g} "
                         f"(left) and {c['right'][s][i]:.6g} (right), and {own} (the custom "
                         "function's primal differentiated by JAX)")
        jumped = c["jumped"][s] if "jumped" in c else np.zeros_like(kink)
        if jumped.any():
            i = int(np.flatnonzero(jumped)[0])
            h, big = float(c["step"][s][i]), float(c["coarse_step"])
            notes.append(f"{int(jumped.sum())} element(s) with a discontinuity within the step: "
                         f"the step {big:g} crosses a jump of f or of its derivative that the "
                         f"step {h:g} does not, so they were judged with the step {h:g}; at "
                         f"{tuple(int(j) for j in np.unravel_index(i, shape))} the central "
                         f"differences are {float(c['coarse'][s][i]):.6g} (step {big:g}) and "
                         f"{float(num[i]):.6g} (step {h:g}), JAX gives {float(grad[i]):.6g}")
        resolution = (float(atol_abs + 2 * np.max(c["noise"][s])) if "noise" in c else None)
        coarse = coarse_note(resolution, np.concatenate([num, grad]))
        if coarse:
            notes.append(coarse)
        if sg.any():
            notes.append(f"{int(sg.sum())} element(s) differ from the central difference only "
                         "because of stop_gradient (which finite differences see through)")
        status = _status(failed, bool(sg.any()), allowed, bool(kinks))
        worst_index, worst_analytic, worst_numeric = worst if worst else (None, None, None)
        return cls(path, tuple(shape), dtype, status, abs_err, rel_err, worst_index,
                   worst_analytic, worst_numeric, kinks, tuple(notes), resolution)

    @classmethod
    def from_directions(cls, path, shape, dtype, analytic, numeric, right, left, see_through,
                        atol_abs, rtol, eps, allowed, reference=None) -> LeafCheck:
        notes, abs_err, rel_err, failed = [], 0.0, 0.0, False
        any_kink = any_sg = False
        worst: tuple[None, None, None] | tuple[None, float, float] = (None, None, None)
        for m, a in analytic.items():
            c = classify_elements(a, numeric, right, left, see_through, atol_abs, rtol, eps,
                                  reference=reference)
            excused = c["kink"] | (c["sg"] if allowed else np.zeros_like(c["sg"]))
            any_kink |= bool(c["kink"].any())
            any_sg |= bool(c["sg"].any())
            considered = ~excused
            if considered.any():
                abs_err = max(abs_err, float(c["err"][considered].max()))
                rel_err = max(rel_err, float(_rel(c["err"], a, numeric)[considered].max()))
                w = int(np.argmax(np.where(considered, c["err"] / c["tol"], -1.0)))
                if worst[1] is None or c["err"][w] > abs(worst[1] - worst[2]):
                    worst = (None, float(a[w]), float(numeric[w]))
            bad = c["fail"] & considered & ~c["sg"]
            if bad.any():
                failed = True
                notes.append(f"{m}: disagrees with the central difference along {int(bad.sum())} "
                             f"of {len(bad)} random unit tangents on this leaf")
            if c["convention"].any():
                j = int(np.flatnonzero(c["convention"])[0])
                own = (f"JAX's own rule gives {reference[j]:.6g} there"
                       if np.isfinite(reference[j]) else "JAX's own rule could not be evaluated")
                notes.append(f"{m}: a tangent crosses a non-differentiable point where the "
                             f"custom rule gives {a[j]:.6g}, neither one-sided derivative "
                             f"({left[j]:.6g}, {right[j]:.6g}) nor their mean, and {own}")
        if any_sg:
            notes.append("differs from the central difference along some tangents only because "
                         "of stop_gradient (which finite differences see through)")
        if any_kink:
            notes.append("a tangent crosses a non-differentiable point (one-sided differences "
                         "disagree)")
        status = _status(failed, any_sg, allowed, any_kink)
        _, worst_analytic, worst_numeric = worst
        return cls(path, tuple(shape), dtype, status, abs_err, rel_err, None, worst_analytic,
                   worst_numeric, (), tuple(notes))

    def located(self, flat_index: int, analytic: float, numeric: float,
                evaluations: int) -> LeafCheck:
        """This row with its worst element set to the one found by bisection."""
        index = tuple(int(i) for i in np.unravel_index(flat_index, self.shape))
        return dataclasses.replace(
            self, worst_index=index, analytic=analytic, numeric=numeric,
            notes=self.notes + (f"element {index} located by bisection over element ranges "
                                f"({evaluations} masked evaluations)",))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ok": self.ok}


#: A leaf whose resolution exceeds this fraction of its largest derivative gets a note.
COARSE_FRACTION = 1e-2


def coarse_note(resolution: float | None, derivatives: np.ndarray) -> str | None:
    """A note when `resolution` is over `COARSE_FRACTION` of the largest finite |derivative|
    (analytic and numeric, of elements in full mode or tangents in directional mode): the
    check passed, but errors of that size could not be seen."""
    finite = np.abs(derivatives[np.isfinite(derivatives)])
    scale = float(finite.max()) if finite.size else 0.0
    if resolution is None or scale <= 0 or resolution <= COARSE_FRACTION * scale:
        return None
    return (f"low resolution: {resolution:.3g} is {100 * resolution / scale:.0f}% of this "
            f"leaf's largest derivative ({scale:.3g}), so errors up to that size cannot be seen "
            "here (a large constant added to f, or cancellation inside fn, raises the noise of "
            "the finite differences; check_directional also dilutes one element's error)")


def _status(failed: bool, cut: bool, allowed: bool, kink: bool) -> str:
    """A leaf's status: a failure not explained by stop_gradient first, then the cut (failed
    unless declared), then kinks."""
    if failed:
        return "fail"
    if cut:
        return "stop_gradient_declared" if allowed else "stop_gradient"
    return "nondifferentiable_point" if kink else "ok"


def _rel(err, a, b):
    denom = np.maximum(np.abs(a), np.abs(b))
    return np.where(denom > 0, err / np.where(denom > 0, denom, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class GradCheckReport:
    """The result of `funcgrad.check_grads`: a row per leaf plus how the check was made.

    Attributes:
      rows: one `LeafCheck` per differentiated leaf, in pytree order.
      mode, modes, order: what was checked: "full" (`funcgrad.check_grads`) or "directional"
        (`funcgrad.check_directional`), ("rev", "fwd"), 1 or 2;
        `modes` lists the modes actually checked (no "fwd" when it was skipped, see notes).
      dtype_used: the dtype the check's arithmetic ran in: float64, or the narrower float fn
        computes in when its casts were not lifted (see `lifted_from` and the notes).
      eps, rtol, atol: the step and tolerances used (see `funcgrad.check.TOLERANCES`).
      skipped: integer/boolean leaves that were not differentiated, and the Python float
        fields of an equinox module that equinox treats as static (with the reason and fix).
      checked_args, unchecked_args: the positional arguments differentiated (`argnums`) and
        those passed through unchecked, as ``"name (argnums=i)"``; an unchecked argument with
        floating leaves is one a caller may have meant to check (``argnums=(0, 1)``).
      notes: remarks (fwd skipped for custom_vjp, lower precision, stop_gradient, ...).
      lifted_from: the dtype narrower than float64 that fn computes in and whose casts the
        check lifted to float64 (e.g. "bfloat16"; `dtype_used` is then "float64"), or None.
      weaker: None, or why the check was weaker than asked: fn computes in a narrower float
        and could not be lifted (a bitcast, a host callback on the differentiated path), so
        it was checked at that float's tolerances. ``ok`` is about the rows alone;
        ``raise_if_failed(strict=True)`` also fails a weaker check.
    """
    rows: list[LeafCheck]
    mode: str
    modes: tuple[str, ...]
    order: int
    dtype_used: str
    eps: float
    rtol: float
    atol: float
    skipped: list[str]
    notes: list[str]
    checked_args: tuple[str, ...] = ()
    unchecked_args: tuple[str, ...] = ()
    lifted_from: str | None = None
    weaker: str | None = None

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list[LeafCheck]:
        return [r for r in self.rows if not r.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "mode": self.mode, "modes": list(self.modes), "order": self.order,
                "dtype_used": self.dtype_used, "eps": self.eps, "rtol": self.rtol,
                "atol": self.atol, "skipped": list(self.skipped), "notes": list(self.notes),
                "checked_args": list(self.checked_args),
                "unchecked_args": list(self.unchecked_args),
                "lifted_from": self.lifted_from, "weaker": self.weaker,
                "rows": [r.to_dict() for r in self.rows]}

    def raise_if_failed(self, strict: bool = False) -> None:
        """Raises AssertionError with the table if any leaf failed; with ``strict=True``, also
        when the check was weaker than asked (`weaker`: checked at a narrow float's
        tolerances because fn could not be lifted to float64)."""
        if not self.ok:
            raise AssertionError(f"gradient check failed for {len(self.failures)} "
                                 f"leaf/leaves:\n{self}")
        if strict and self.weaker:
            raise AssertionError(f"gradient check was weaker than asked ({self.weaker}); "
                                 f"strict=True treats that as a failure:\n{self}")

    def __str__(self) -> str:
        lifted = f" (lifted from {self.lifted_from})" if self.lifted_from else ""
        head = (f"gradient check ({self.mode}, {'+'.join(self.modes)}, order {self.order}, "
                f"{self.dtype_used}{lifted}, eps={self.eps:g}, rtol={self.rtol:g}, "
                f"atol={self.atol:g}): "
                f"{'OK' if self.ok else 'FAILED'}"
                f"{' (WEAKER THAN ASKED: ' + self.weaker + ')' if self.weaker else ''}")
        cols = ("leaf", "shape", "max abs err", "max rel err", "resolution", "worst element",
                "analytic", "numeric", "status")
        table = [cols]
        for r in self.rows:
            table.append((r.path, str(r.shape), f"{r.max_abs_error:.3g}", f"{r.max_rel_error:.3g}",
                          "-" if r.resolution is None else f"{r.resolution:.2g}",
                          "-" if r.worst_index is None else str(r.worst_index),
                          "-" if r.analytic is None else f"{r.analytic:.6g}",
                          "-" if r.numeric is None else f"{r.numeric:.6g}", r.status))
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        lines = [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                          for row in table]
        for r in self.rows:
            lines += [f"  {r.path}: {n}" for n in r.notes]
        lines += [f"  skipped: {s}" for s in self.skipped]
        if self.checked_args:
            lines.append(f"  checked arguments: {', '.join(self.checked_args)}")
        if self.unchecked_args:
            floating = [a.split(" ")[0] for a in self.unchecked_args if "nothing floating" not in a]
            hint = (f" -- their gradients were not checked; to check {', '.join(floating)} too, "
                    "pass argnums with its position" if floating else "")
            lines.append(f"  not checked: {', '.join(self.unchecked_args)}{hint}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
