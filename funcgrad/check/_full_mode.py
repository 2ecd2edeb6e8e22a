"""The full check (private to `funcgrad.check`): every element of every differentiated leaf
perturbed by ± eps, the 2n forward evaluations run in ``vmap``-ed chunks inside few compiled
calls (`funcgrad.check._full_pass`, which also times a long check and shows its progress), and
the reverse-mode gradient compared element by element; forward mode (``jvp``) is compared
along random tangents restricted to each leaf against the same numerical gradient, or, when it
is the only mode, element by element.
"""
from __future__ import annotations

import functools

import numpy as np

from funcgrad.check import _full_pass, _noise
from funcgrad.check._directional_mode import _random_tangents
from funcgrad.check._shared import (
    _CHUNK_ELEMENTS,
    _FWD_ONLY_CUSTOM_VJP,
    _NO_FWD_NOTE,
    _check_finite_output,
    _reference_grad,
    _roundoff_scale,
    _see_through_grad,
    _segments,
    _sg_note,
)
from funcgrad.check.options import CheckOptions
from funcgrad.check.report import LeafCheck, classify_elements

#: Random tangents per leaf along which forward mode (jvp) is compared with the numerical
#: gradient when rev is checked too (without rev, every element's jvp is compared).
FWD_TANGENTS = 4


def _judge_elements(prob, f0, fp, fm, grad, out, tol):
    """First verdicts on every element, with each one's step and noise (the error bound of its
    central difference) refined where needed: the round-off floor for all; the step eps/8 for
    kink candidates it shows smooth (a jump crossed by eps; `_noise.smaller_step`); measured
    noise for the elements that still fail (`_noise.measured_noise`). Returns the
    `classify_elements` dict (plus noise, jumped, coarse, step, coarse_step) and the vectors
    (numeric, right, left, step, noise, smooth) for further classification."""
    eps, rtol, atol = tol
    n = fp.shape[0]
    numeric = (fp - fm) / (2 * eps)
    right, left = (fp - f0) / eps, (f0 - fm) / eps
    dtype, scale = prob["dtype_used"], _roundoff_scale(prob, f0, out)
    step = np.full(n, eps)
    noise = np.full(n, _noise.floor(dtype, scale, eps))
    cls = classify_elements(grad, numeric, right, left, None, atol + noise, rtol, step)
    coarse, smooth, jumped = numeric, None, np.zeros(n, bool)
    candidates = np.flatnonzero(cls["kink"])
    if candidates.size:
        numeric, right, left, smooth, jumped = _noise.smaller_step(
            prob, f0, candidates, eps, numeric, right, left, _CHUNK_ELEMENTS)
        step = np.where(smooth, eps / _noise.SMALLER, eps)
        noise = np.where(smooth, _noise.floor(dtype, scale, eps / _noise.SMALLER), noise)
        cls = classify_elements(grad, numeric, right, left, None, atol + noise, rtol, step,
                                smooth)
    suspects = np.flatnonzero(cls["fail"] & ~cls["kink"] & np.isfinite(grad)
                              & np.isfinite(numeric))
    if suspects.size:  # the floor may be too tight (cancellation in fn): measure their noise
        noise = noise.copy()
        noise[suspects] = np.fmax(noise[suspects], _noise.measured_noise(
            prob, suspects, step[suspects], _CHUNK_ELEMENTS))
        cls = classify_elements(grad, numeric, right, left, None, atol + noise, rtol, step,
                                smooth)
    cls.update(noise=noise, jumped=jumped, coarse=coarse, step=step, coarse_step=eps)
    return cls, (numeric, right, left, step, noise, smooth)


def run_full(prob, tol, options: CheckOptions, allowed):
    """The full check of `prob` at `tol` = (eps, rtol, atol): one `LeafCheck` row per leaf
    (`allowed`: may it differ because of stop_gradient) and the report's notes."""
    spec, theta, leaves, cots = prob["spec"], prob["theta"], prob["leaves"], prob["cotangents"]
    eps, rtol, atol = tol
    modes, k = options.modes, FWD_TANGENTS
    n = theta.shape[0]
    chunk = int(options.chunk_size or max(1, min(n, _CHUNK_ELEMENTS // max(n, 1))))
    segments = _segments(prob)
    tangents = None
    notes = []
    rev = "rev" in modes
    if "fwd" in modes and rev:  # without rev every element is checked by a jvp of its own
        tangents, _ = _random_tangents(options.seed, n, segments, k)
    passes = functools.partial(_full_pass.run, spec, theta, leaves, cots, eps=eps, chunk=chunk,
                               rev=rev, progress=options.progress)
    try:
        result = passes(tangents)
    except TypeError as e:
        if not rev and "custom_vjp" in str(e):
            raise ValueError(_FWD_ONLY_CUSTOM_VJP) from e
        if tangents is None or "custom_vjp" not in str(e):
            raise
        notes.append(_NO_FWD_NOTE)
        tangents = None
        result = passes(None)
    f0, fp, fm, grad, out = result[:5]
    _check_finite_output(prob, out)
    cls, (numeric, right, left, step, noise, smooth) = _judge_elements(
        prob, float(f0), fp, fm, grad, out, tol)
    reference = _reference_grad(prob, modes) if cls["kink"].any() else None
    if reference is not None:  # custom rules: their kinks are held to JAX's convention
        cls = {**cls, **classify_elements(grad, numeric, right, left, None, atol + noise, rtol,
                                          step, smooth, reference)}
    if (cls["fail"] & ~cls["kink"]).any():  # only then ask whether stop_gradient explains it
        g_st = _see_through_grad(prob, modes)
        if g_st is not None:
            cls = {**cls, **classify_elements(grad, numeric, right, left, g_st, atol + noise,
                                              rtol, step, smooth, reference)}  # keeps noise, ...
    fwd = None
    if tangents is not None:
        accepted = np.where(cls["explained"], grad, numeric)  # JAX's value at kinks
        fwd_noise = np.abs(tangents) @ np.where(cls["explained"], 0.0, noise)
        fwd = (tangents, np.asarray(result[5]), tangents @ accepted, fwd_noise)
    rows = []
    for li, (lo, hi) in enumerate(segments):
        fwd_err = None
        if fwd is not None:
            sel = slice(li * k, (li + 1) * k)
            fwd_err = (fwd[1][sel], fwd[2][sel], fwd[3][sel])
        rows.append(LeafCheck.from_elements(
            prob["paths"][li], prob["shapes"][li], prob["dtype_used"], cls, lo, hi,
            fwd_err, atol, rtol, allowed[li]))
    if cls["sg"].any():
        notes.append(_sg_note(allowed, rows))
    return rows, notes


