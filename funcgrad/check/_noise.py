"""The error of a gradient check's central differences: a round-off floor, and probes measuring it.

Private to `funcgrad.check`. The central difference D(h) = (f(x+h) - f(x-h)) / 2h of a
function evaluated with absolute error at most e carries a round-off error at most e/h and a
truncation error h²/6·|f'''| (Nocedal & Wright, Numerical Optimization, 2nd ed., §8.1, eq. 8.5). A
check must not fail an element on that error, and must not excuse a real one by scaling its floor
with |f| (``sin(x) + 1e5`` rounds to 1.5e-11, so D(1e-6) is good to 1e-5, not to 1e5 x atol).

So the check judges element i against ``atol + rtol·|numeric_i| + noise_i`` where noise_i is

1. first, a floor from the dtype's unit round-off u: ``ROUNDOFF_ULPS · u · S / h``, S the
   magnitude of what the last reduction adds up (|f| for a scalar output, Σ|u_k·y_k| for an
   output y reduced by the cotangent u); cheap, and tight for a well-conditioned function;
2. then, only for the elements that fail with the floor, a measurement: f at 17 points in
   [x-h, x+h] (x and 8 jittered points on each side, `OFFSETS`), one batched compiled call
   over all of them. A degree-4 polynomial in t fits f(x + t·h) closely enough (its
   residual, h⁵·f⁽⁵⁾/120, is far below round-off at the default steps); what is left over
   is round-off, whose standard deviation s_f the residuals estimate with 17 - 5 = 12
   degrees of freedom. D(h)'s round-off is (e₊ - e₋)/2h, standard deviation s_f/(√2·h); its
   truncation is the fitted cubic coefficient b₃/h (f(x + t·h) = Σ b_k t^k, and
   D(h) = (b₁ + b₃ + b₅ + ...)/h while f'(x) = b₁/h).
   ``noise_i = T_QUANTILE · s_f/(√2·h) + |b₃|/h`` (see `T_QUANTILE`).

Cancellation inside fn (large terms, small f) makes round-off larger than the floor; the
measurement sees it, and the wrong derivative of a real bug does not enter it (it is computed
from values of f only), so a measurement can lower the check's resolution but never excuse an
error larger than the noise it measured.

A second job shares the batched kernel: `smaller_step` re-probes kink candidates with the step
h/8, so that a step which crossed a jump (of f or of its derivative) a little way off is
replaced by one that does not.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.check import _objective as obj

#: Round-off of one evaluation of f, in units of u·S: the final rounding of the output, of the
#: cotangent reduction and of a cast each add at most u·S/2, so a few of them, 4·u·S per
#: evaluation, bound a well-conditioned function, and D(h)'s round-off is then at most
#: (|e₊| + |e₋|)/2h = 4·u·S/h. An element that misses it is measured (`measured_noise`), not
#: failed, so the floor may be tight (a floor too tight costs 17 evaluations, not a verdict).
ROUNDOFF_ULPS = 4.0

#: Multiple of D(h)'s estimated round-off standard deviation tolerated after a measurement.
#: s_f is estimated on 12 degrees of freedom from points other than x ± h, so the ratio of
#: D(h)'s round-off to its estimate is Student's t(12): P(|t| > 7) = 1.4e-5. Adding the fitted
#: |b₃|/h (its noise is independent of the ±h values' and adds margin) gave 1.5e-6 false
#: failures per measured element over 2·10^6 simulated Gaussian round-offs, 0 for uniform ones.
T_QUANTILE = 7.0

#: Relative offsets (in steps) of the measurement: 0 and ±(j - v_j)/8, j = 1..8, for fixed
#: jitters v_j in [0, 0.9) (fractional parts of j·golden ratio and j·sqrt(2), different on
#: each side). Evenly spaced points let round-off hide: where f moves by nearly a whole number
#: of ulps per grid step (a + sin(x) - a with a = 875000 at one x: 924.06 ulps) the rounding
#: errors drift linearly across the grid, which a polynomial absorbs as slope (observed: 0
#: residual, 5.7e-5 error in D). Jittered points break that up: f moves by hundreds of ulps
#: within one jitter.
OFFSETS = (0.0,) + tuple((j - 0.9 * ((j * 0.6180339887) % 1)) / 8 for j in range(1, 9)) \
    + tuple(-(j - 0.9 * ((j * 1.4142135624) % 1)) / 8 for j in range(1, 9))

#: The refining step is h/SMALLER: a jump of f or f' further than h/8 from the point is no
#: longer crossed, and at a smooth point the one-sided gap (h·|f''|) shrinks 8-fold.
SMALLER = 8


def unit_roundoff(dtype: str) -> float:
    """u = eps/2 of `dtype` (1.1e-16 for float64, 6.0e-8 for float32)."""
    return float(jnp.finfo(dtype).eps) / 2


def roundoff_scale(f0: float, out: np.ndarray, cotangent: np.ndarray, scalar: bool) -> float:
    """S, the magnitude the objective's last reduction adds up: |f| for a scalar output,
    Σ|u_k·y_k| for an output y reduced by the cotangent u (y of shape (m,), float64)."""
    if scalar:
        return abs(float(f0))
    return max(abs(float(f0)), float(np.sum(np.abs(cotangent * out))))


def floor(dtype: str, scale: float, step: float) -> float:
    """The round-off floor of a central difference with step `step`: ROUNDOFF_ULPS·u·S/h."""
    return ROUNDOFF_ULPS * unit_roundoff(dtype) * scale / step


def padded(m: int) -> int:
    """Candidates are padded to a power of two (at least 8): a few shapes to compile, and at
    most twice the evaluations needed."""
    return 1 << max(3, math.ceil(math.log2(max(m, 1))))


@functools.partial(jax.jit, static_argnames=("spec", "offsets", "chunk"))
def _probe_kernel(spec, theta, leaves, cotangents, index, steps, *, offsets, chunk):
    """phi(theta + o·steps[c]·e_index[c]) for every candidate c and offset o, shape
    (len(index), len(offsets)); a padded candidate (index -1) perturbs nothing."""
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    position = jnp.arange(theta.shape[0])
    o = jnp.asarray(offsets, theta.dtype)

    def candidate(i, s):
        return jax.vmap(lambda t: phi(theta + jnp.where(position == i, t * s, 0.0)))(o)

    batched = jax.vmap(candidate)
    m = index.shape[0]
    if chunk >= m:
        return batched(index, steps)
    out = jax.lax.map(lambda a: batched(*a), (index.reshape(-1, chunk), steps.reshape(-1, chunk)))
    return out.reshape(m, len(offsets))


def probe(prob, index: np.ndarray, steps: np.ndarray, offsets: tuple[float, ...],
          chunk_elements: int) -> np.ndarray:
    """f at theta + o·steps[c] along element index[c], for each candidate c and offset o:
    float64 (len(index), len(offsets)), in one compiled call (padded to 8, 16, 32, ...)."""
    m, n = len(index), int(prob["theta"].shape[0])
    size = padded(m)
    per = max(1, chunk_elements // max(1, n * len(offsets)))
    chunk = min(size, 1 << int(math.log2(per)))  # a power of two: divides the padded size
    idx = np.full(size, -1, np.int64)
    idx[:m] = index
    st = np.zeros(size)
    st[:m] = steps
    out = _probe_kernel(prob["spec"], prob["theta"], prob["leaves"], prob["cotangents"],
                        jnp.asarray(idx), jnp.asarray(st), offsets=tuple(offsets), chunk=chunk)
    return np.asarray(out)[:m]


def smaller_step(prob, f0: float, candidates: np.ndarray, eps: float, numeric: np.ndarray,
                 right: np.ndarray, left: np.ndarray, chunk_elements: int):
    """Re-probes kink candidates with the step h = eps/SMALLER; returns (numeric, right, left,
    smooth, jumped), float64 and bool vectors of length n (new arrays).

    At a kink the one-sided differences differ by the jump in the derivative whatever the
    step; at a smooth point by h·|f''|. A gap that shrinks below half its first size is
    `smooth` there: the element is no kink (it must not excuse a wrong derivative) and is
    judged with the smaller step's differences, which no longer cross what the step eps
    crossed. `jumped` marks those whose gap shrank more than twice as fast as curvature
    allows (below 1/(2·SMALLER) of it): the step eps crossed a discontinuity of f or of its
    derivative between eps/SMALLER and eps from the point.
    """
    h = eps / SMALLER
    out = probe(prob, candidates, np.full(len(candidates), h), (1.0, -1.0), chunk_elements)
    r_h, l_h = (out[:, 0] - f0) / h, (f0 - out[:, 1]) / h
    gap, gap_h = np.abs(right - left)[candidates], np.abs(r_h - l_h)
    shrank = gap_h < gap / 2
    numeric, right, left = numeric.copy(), right.copy(), left.copy()
    smooth, jumped = np.zeros(len(numeric), bool), np.zeros(len(numeric), bool)
    at = candidates[shrank]
    smooth[at] = True
    jumped[candidates[shrank & (SMALLER * gap_h < gap / 2)]] = True
    numeric[at] = ((out[:, 0] - out[:, 1]) / (2 * h))[shrank]
    right[at], left[at] = r_h[shrank], l_h[shrank]
    return numeric, right, left, smooth, jumped


def _fit():
    t = np.asarray(OFFSETS)
    design = np.vander(t, 5, increasing=True)  # 1, t, t², t³, t⁴
    pinv = np.linalg.pinv(design)
    return np.eye(len(t)) - design @ pinv, pinv[3], len(t) - design.shape[1]


_RESIDUAL, _CUBIC, _DOF = _fit()


def measured_noise(prob, index: np.ndarray, steps: np.ndarray,
                   chunk_elements: int) -> np.ndarray:
    """The measured error bound of D(steps[c]) at element index[c]: float64 (m,), in the
    derivative's units. See the module docstring for the fit and `T_QUANTILE`."""
    return noise_from_values(probe(prob, index, steps, OFFSETS, chunk_elements), steps)


def noise_from_values(values: np.ndarray, steps) -> np.ndarray:
    """The error bound of D(step) from f at x + OFFSETS·step: `values` float64 (m, 17) (one
    row per element or tangent), `steps` a scalar or (m,); returns float64 (m,), NaN where a
    value is not finite."""
    # f - f(x) is exact for nearby values (Sterbenz) and keeps the fit's own arithmetic far
    # below the round-off it measures when |f| is large.
    centred = values - values[:, :1]
    residual = centred @ _RESIDUAL.T
    sigma = np.sqrt(np.sum(residual ** 2, axis=1) / _DOF)
    cubic = np.abs(centred @ _CUBIC)
    with np.errstate(invalid="ignore"):
        return (T_QUANTILE * sigma / math.sqrt(2) + cubic) / steps
