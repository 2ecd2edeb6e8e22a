"""The directional check of `funcgrad.check_directional` (private): random unit tangents per
leaf, or per block of a leaf (`funcgrad.check._directions`), compared with jvp and <grad, v>; a
failing leaf is bisected over element ranges (O(log n) evaluations) to name the element.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.check import _directions, _noise
from funcgrad.check import _objective as obj
from funcgrad.check._shared import (
    _CHUNK_ELEMENTS,
    _FWD_ONLY_CUSTOM_VJP,
    _NO_FWD_NOTE,
    _check_finite_output,
    _masked_kernel,
    _reference_grad,
    _roundoff_scale,
    _see_through_grad,
    _segments,
    _sg_note,
)
from funcgrad.check.options import CheckOptions
from funcgrad.check.report import LeafCheck, classify_elements, coarse_note


class _Tangents(NamedTuple):
    """Unit tangents described, not stored: tangent t is ``raw[row[t]]`` restricted to
    ``[lo[t], hi[t])`` and divided by ``norm[t]``. A dense (tangents x n) matrix would take
    k·(leaves+1)·n floats: 6 GB for 300 leaves and 625k parameters."""
    raw: np.ndarray   # (k, n) standard-normal draws
    lo: np.ndarray    # (T,) int
    hi: np.ndarray    # (T,) int
    row: np.ndarray   # (T,) int, which draw
    norm: np.ndarray  # (T,) float

    def dot(self, g: np.ndarray) -> np.ndarray:
        """``tangents @ g`` (T,), on the host, one segment at a time."""
        return np.array([self.raw[j, a:b] @ g[a:b] / m
                         for a, b, j, m in zip(self.lo, self.hi, self.row, self.norm)])

    def rows(self, sel: slice) -> np.ndarray:
        """The dense tangents ``sel`` (a few, e.g. one leaf's k), (len, n)."""
        out = np.zeros((len(self.lo[sel]), self.raw.shape[1]))
        for r, (a, b, j, m) in enumerate(zip(self.lo[sel], self.hi[sel], self.row[sel],
                                             self.norm[sel])):
            out[r, a:b] = self.raw[j, a:b] / m
        return out


def _tangent(plan, t, n):
    """Tangent t of a `_Tangents` plan (device arrays), built inside a kernel: shape (n,)."""
    raw, lo, hi, row, norm = plan
    index = jnp.arange(n)
    return jnp.where((index >= lo[t]) & (index < hi[t]), raw[row[t]], 0.0) / norm[t]


def _over_tangents(fn, count, chunk):
    """``fn(t)`` for t = 0..count-1, vmapped in chunks of `chunk` (a padded t repeats the
    last tangent; its results are dropped): one loop body, as in `_full_kernel`."""
    c = min(chunk, count)
    if c == 1:  # a large model: one tangent at a time, without a batch axis of one
        return jax.lax.map(fn, jnp.arange(count))
    ids = jnp.minimum(jnp.arange(-(-count // c) * c), count - 1).reshape(-1, c)
    batched = jax.vmap(fn)
    out = batched(ids[0]) if ids.shape[0] == 1 else jax.lax.map(batched, ids)
    return jax.tree.map(lambda a: jnp.ravel(a)[:count], out)


@functools.partial(jax.jit, static_argnames=("spec", "chunk"))
def _jvp_kernel(spec, theta, leaves, cotangents, plan, *, chunk):
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    n = theta.shape[0]
    return _over_tangents(lambda t: jax.jvp(phi, (theta,), (_tangent(plan, t, n),))[1],
                          plan[1].shape[0], chunk)


@functools.partial(jax.jit, static_argnames=("spec", "eps", "chunk", "rev"))
def _directional_kernel(spec, theta, leaves, cotangents, plan, *, eps, chunk, rev=True):
    """phi(theta), phi(theta ± eps·t) for every tangent t of `plan` (vmapped in chunks of
    `chunk` tangents), grad phi(theta) (zeros without `rev`: a fwd-only check does not take
    it) and the output at theta."""
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    n = theta.shape[0]

    def plus_minus(t):
        v = _tangent(plan, t, n)
        return phi(theta + eps * v), phi(theta - eps * v)

    f_plus, f_minus = _over_tangents(plus_minus, plan[1].shape[0], chunk)
    return (phi(theta), f_plus, f_minus, jax.grad(phi)(theta) if rev else jnp.zeros_like(theta),
            obj.output_vector(spec, theta, leaves))


def _random_tangents(seed, n, segments, k):
    """k unit tangents per segment (zero outside it) then k over everything: (k*(L+1), n), and
    the k raw standard-normal draws they were cut from: (k, n)."""
    raw = np.random.default_rng([seed, 1]).standard_normal((k, n))
    out = []
    for lo, hi in [*segments, (0, n)]:
        for j in range(k):
            v = np.zeros(n)
            v[lo:hi] = raw[j, lo:hi]
            out.append(v / np.linalg.norm(v))
    return np.stack(out), raw


def _tangent_plan(seed, n, segments, k) -> _Tangents:
    """The tangents of `_random_tangents` (same draws, same order), described lazily."""
    raw = np.random.default_rng([seed, 1]).standard_normal((k, n))
    bounds = [*segments, (0, n)]
    lo = np.repeat([a for a, _ in bounds], k)
    hi = np.repeat([b for _, b in bounds], k)
    row = np.tile(np.arange(k), len(bounds))
    norm = np.array([np.linalg.norm(raw[j, a:b]) for a, b, j in zip(lo, hi, row)])
    return _Tangents(raw, lo, hi, row, norm)


def _jvps(spec, theta, leaves, cotangents, plan, chunk):
    """jvp of phi along each tangent of `plan` (device arrays), or (None, note) when fn has a
    custom_vjp."""
    try:
        return np.asarray(_jvp_kernel(spec, theta, leaves, cotangents, plan, chunk=chunk)), None
    except TypeError as e:
        if "custom_vjp" in str(e):
            return None, _NO_FWD_NOTE
        raise


def run_directional(prob, tol, options: CheckOptions, allowed, k: int,
                    block_size: int | None):
    """The directional check of `prob` at `tol` = (eps, rtol, atol) with `k` tangents per
    block of at most `block_size` elements (None: per leaf): one `LeafCheck` row per leaf
    (`allowed`: may it differ because of stop_gradient) and the report's notes."""
    spec, theta, leaves, cots = prob["spec"], prob["theta"], prob["leaves"], prob["cotangents"]
    eps, rtol, atol = tol
    modes = options.modes
    n = theta.shape[0]
    blocks, first = _directions.split_blocks(_segments(prob), block_size)
    plan = _tangent_plan(options.seed, n, blocks, k)  # k per block, then k over all leaves
    chunk = int(options.chunk_size or max(1, min(plan.lo.size, _CHUNK_ELEMENTS // max(n, 1))))
    on_device = tuple(jnp.asarray(a) for a in plan)
    f0, fp, fm, grad, out = (np.asarray(a) for a in _directional_kernel(
        spec, theta, leaves, cots, on_device, eps=eps, chunk=chunk, rev="rev" in modes))
    _check_finite_output(prob, out)
    # atol plus the round-off floor of a central difference (the same along a unit tangent);
    # measured instead along the tangents that miss it, as in full mode.
    floor = _noise.floor(prob["dtype_used"], _roundoff_scale(prob, f0, out), eps)
    atol_abs = np.full(fp.shape, atol + floor)
    numeric = (fp - fm) / (2 * eps)
    analytic = {}
    if "rev" in modes:
        analytic["rev"] = plan.dot(grad)
    notes = []
    if "fwd" in modes:
        jvps, note = _jvps(spec, theta, leaves, cots, on_device, chunk)
        if jvps is not None:
            analytic["fwd"] = jvps
        elif not analytic:
            raise ValueError(_FWD_ONLY_CUSTOM_VJP)
        else:
            notes.append(note)

    def mismatched():
        return np.any([np.abs(a - numeric) > atol_abs + rtol * np.abs(numeric)
                       for a in analytic.values()], axis=0)

    # Tangents crossing a kink: as in full mode, their one-sided gap is the kink, not noise
    # (a fit across it would call any rule's value there noise), so they are not measured.
    right, left = (fp - f0) / eps, (f0 - fm) / eps
    kinked = np.any([classify_elements(a, numeric, right, left, None, atol_abs, rtol, eps)["kink"]
                     for a in analytic.values()], axis=0)
    suspects = np.flatnonzero(mismatched() & ~kinked)
    if suspects.size:
        measured = _noise.noise_from_values(_probe_tangents(prob, on_device, suspects, eps), eps)
        atol_abs[suspects] = np.fmax(atol_abs[suspects], atol + measured)
    mismatch = bool(mismatched().any())
    g_st = _see_through_grad(prob, modes) if mismatch else None
    reference = _reference_grad(prob, modes) if mismatch and kinked.any() else None
    see_through = None if g_st is None else plan.dot(g_st)
    reference = None if reference is None else plan.dot(reference)
    # A tangent's numeric value may be off by its noise (atol_abs - atol) in the direction
    # that hides an error, so the floor an error must clear is atol + 2·noise, as in full mode.
    resolutions = _directions.leaf_resolutions(blocks, first, grad if "rev" in modes else None,
                                               numeric, k, 2 * atol_abs - atol, rtol)
    notes.append(_directions.resolution_note(k, len(blocks) > len(first) - 1))
    rows = []
    for li, (lo, _hi) in enumerate(_segments(prob)):
        sel = slice(first[li] * k, first[li + 1] * k)  # this leaf's blocks' tangents
        row = LeafCheck.from_directions(
            prob["paths"][li], prob["shapes"][li], prob["dtype_used"],
            {m: a[sel] for m, a in analytic.items()}, numeric[sel], (fp[sel] - f0) / eps,
            (f0 - fm[sel]) / eps, None if see_through is None else see_through[sel],
            atol_abs[sel], rtol, eps, allowed[li], None if reference is None else reference[sel])
        coarse = coarse_note(resolutions[li], np.concatenate(
            [numeric[sel], *(a[sel] for a in analytic.values())]))
        row = dataclasses.replace(row, resolution=resolutions[li],
                                  notes=row.notes + ((coarse,) if coarse else ()))
        if row.status == "fail":
            m = "rev" if "rev" in analytic else "fwd"
            err = np.abs(analytic[m][sel] - numeric[sel])
            t = sel.start + int(np.argmax(err / (atol_abs[sel] + rtol * np.abs(numeric[sel]))))
            i, a, num, evaluations = _bisect(prob, tol, grad if m == "rev" else None,
                                             plan.raw[plan.row[t]], int(plan.lo[t]),
                                             int(plan.hi[t]))
            row = row.located(i - lo, a, num, evaluations)
        rows.append(row)
    if any(r.status.startswith("stop_gradient") for r in rows):
        notes.append(_sg_note(allowed, rows))
    return rows, notes


@functools.partial(jax.jit, static_argnames=("spec", "eps"))
def _tangent_probe_kernel(spec, theta, leaves, cotangents, plan, ids, *, eps):
    """phi(theta + o·eps·t) for each tangent t in `ids` (of `plan`) and each o in
    `_noise.OFFSETS`: (len(ids), 17); an id of -1 (padding) gives the last tangent."""
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    n = theta.shape[0]
    offsets = jnp.asarray(_noise.OFFSETS, theta.dtype)

    def along(t):
        v = _tangent(plan, t, n)
        return jax.vmap(lambda o: phi(theta + o * eps * v))(offsets)

    return jax.lax.map(along, ids)


def _probe_tangents(prob, plan, ids, eps):
    """`_tangent_probe_kernel` on the host: float64 (len(ids), 17), ids padded to 8, 16, ..."""
    padded = np.full(_noise.padded(len(ids)), -1)
    padded[:len(ids)] = ids
    return np.asarray(_tangent_probe_kernel(prob["spec"], prob["theta"], prob["leaves"],
                                            prob["cotangents"], plan, jnp.asarray(padded),
                                            eps=eps))[:len(ids)]


def _bisect(prob, tol, grad, direction, lo, hi):
    """Halves [lo, hi) towards the larger analytic-vs-numeric discrepancy; returns the element
    found. The analytic side is ``grad · v`` (rev), or without `grad` a jvp along v (fwd)."""
    spec, theta, leaves, cots = prob["spec"], prob["theta"], prob["leaves"], prob["cotangents"]
    eps = tol[0]
    fwd = grad is None

    def analytic_and_numeric(direction, a, b):
        out = _masked_kernel(spec, theta, leaves, cots, direction, a, b, eps=eps, jvp=fwd)
        v, f_plus, f_minus = out[:3]
        value = float(out[3]) if fwd else float(jnp.dot(grad_on_device, v))
        return value, (float(f_plus) - float(f_minus)) / (2 * eps)

    grad_on_device, direction = jax.device_put((grad, direction))  # once, not per evaluation

    def discrepancy(a, b):
        value, numeric = analytic_and_numeric(direction, a, b)
        return abs(value - numeric)

    evaluations = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        left, right = discrepancy(lo, mid), discrepancy(mid, hi)
        evaluations += 2
        lo, hi = (lo, mid) if left >= right else (mid, hi)
    one_hot = np.zeros(theta.shape[0])
    one_hot[lo] = 1.0
    value, numeric = analytic_and_numeric(jnp.asarray(one_hot), lo, lo + 1)
    return lo, value, numeric, evaluations + 1
