"""The resolution of a directional gradient check, and the blocks of elements that reach one.

Directional mode compares ``<analytic gradient, v>`` with the central difference along random
unit tangents v. A tangent restricted to a block of B elements is v = z/||z|| for z standard
normal on the block (zero elsewhere), i.e. uniform on the block's unit sphere, so a component
is about z_j/sqrt(B): a wrong derivative at one element j, off by e, moves the directional
derivative by only e·v_j, about e/sqrt(B). This module states how large e must be to be seen
(`block_resolution`), and cuts leaves into blocks so that the check sees smaller errors within
a budget of function evaluations (`split_blocks`, `choose_block_size`).

The derivation (used by `block_resolution`). Let g be the true gradient on the block (what the
central differences measure) and g_a the analytic one, g_a = g + e·e_j (one wrong element).
Along a tangent v the check compares analytic <g, v> + e·v_j with numeric <g, v> + d, where
|d| <= noise (the central difference's own error), against atol + noise + rtol·|numeric|; so
it reports at least when |e·v_j| > floor + rtol·|<g, v>| with floor = atol + 2·noise (the
noise counted twice, as in full mode: d may point the way that hides e; rtol·|d| is
negligible). For v uniform on the unit sphere of R^B, the
squared component along any fixed unit vector w is Beta(1/2, (B-1)/2) distributed
(z_w² / (z_w² + chi²_{B-1})); this holds for w = e_j and for w = g/||g||. Let q(p) be the
p-quantile of that |component| and, for a per-tangent miss probability p, take
c = q(p/2) and s = q(1 - p/2). Then with probability >= 1 - p both |v_j| >= c and
|<g, v>| <= s·||g|| <= s·(||g_a|| + e) hold (union bound), and then the tangent reports e when
    e·c > floor + rtol·s·(||g_a|| + e),   i.e.   e > (floor + rtol·s·||g_a||) / (c - rtol·s).
The k tangents of a block are independent draws, so all k miss with probability <= p^k;
p = (1 - confidence)^(1/k) makes that 1 - confidence (1% by default). For large B, q(p) ->
(normal quantile)/sqrt(B): with k = 4, c ≈ 0.20/sqrt(B) and s ≈ 1.41/sqrt(B), so the
resolution is about 5·sqrt(B)·floor + 7·rtol·||g_a||: it grows as sqrt(B), and smaller blocks
buy it back at k tangents (2k evaluations) per block.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import betaincinv

#: The probability over the random tangents with which an error above the resolution is
#: reported.
CONFIDENCE = 0.99


def component_quantile(size, p):
    """The p-quantile of |v_j| for v uniform on the unit sphere of R^size (v_j² is
    Beta(1/2, (size-1)/2)); size 1 gives 1 (v = ±1). Arrays broadcast; float64 out."""
    size = np.asarray(size, np.float64)
    b = np.maximum(size - 1, 1e-300) / 2
    return np.where(size > 1, np.sqrt(betaincinv(0.5, b, p)), 1.0)


def block_resolution(size, grad_norm, k, floor, rtol, confidence=CONFIDENCE):
    """The smallest single-element error e that a directional check with `k` random unit
    tangents on a block of `size` elements reports with probability >= `confidence`.

    Args:
      size: int or int array, elements in the block (>= 1).
      grad_norm: float or array, ||analytic gradient|| on the block, in the derivative's units.
      k: tangents per block (independent draws).
      floor: what an error along a tangent must clear: atol plus twice the central
        difference's noise (derivative's units); a float or an array.
      rtol: the relative tolerance (dimensionless).
      confidence: in (0, 1).
    Returns:
      float64 array (shape of the broadcast inputs), in the derivative's units; inf where rtol
      is so large that no error is certainly reported. Derivation: this module's docstring.
    """
    p = (1.0 - confidence) ** (1.0 / k)
    c = component_quantile(size, p / 2)
    s = component_quantile(size, 1 - p / 2)
    margin = c - rtol * s
    with np.errstate(divide="ignore"):
        return np.where(margin > 0, (floor + rtol * s * np.asarray(grad_norm, np.float64))
                        / np.where(margin > 0, margin, 1.0), np.inf)


def split_blocks(segments: Sequence[tuple[int, int]], block_size: int | None):
    """Cuts each leaf's range [lo, hi) into ceil(size/block_size) blocks of near-equal size
    (sizes differ by at most 1); None keeps each leaf whole.

    Returns:
      (blocks, first): blocks, a list of (lo, hi) in leaf order; first, an int array of
      len(segments) + 1 where leaf i owns blocks[first[i]:first[i+1]].
    """
    blocks, first = [], [0]
    for lo, hi in segments:
        count = 1 if block_size is None else -(-(hi - lo) // block_size)
        edges = lo + (np.arange(count + 1) * (hi - lo)) // count
        blocks += [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]
        first.append(len(blocks))
    return blocks, np.asarray(first)


def evaluations(sizes: Sequence[int], block_size: int | None, k: int, per_tangent: int) -> int:
    """Function evaluations of a directional check: k tangents per block plus k over all
    leaves together, `per_tangent` evaluations each (2 for the central difference, +1 for
    the jvp when forward mode is checked)."""
    blocks = sum(1 if block_size is None else -(-s // block_size) for s in sizes)
    return k * (blocks + 1) * per_tangent


def choose_block_size(sizes: Sequence[int], k: int, per_tangent: int,
                      budget: int) -> int | None:
    """The smallest block size (finest resolution) whose check fits in `budget` evaluations;
    None (each leaf whole) when even that does not fit or when no leaf needs cutting."""
    largest = max(sizes)
    if evaluations(sizes, largest, k, per_tangent) > budget:
        return None
    lo, hi = 1, largest  # evaluations fall as the block size grows: bisect for the smallest
    while lo < hi:
        mid = (lo + hi) // 2
        if evaluations(sizes, mid, k, per_tangent) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return None if lo >= largest else lo


def leaf_resolutions(blocks, first, grad, numeric, k, floor, rtol):
    """Each leaf's resolution: the largest `block_resolution` over its blocks, with `floor`
    (a float, or one per tangent: the block's largest counts) the absolute amount a
    directional error must clear (atol plus twice the central difference's noise).

    ``||g_a||`` per block comes from the analytic gradient `grad` (n,) when reverse mode ran;
    without it (forward mode only) it is estimated from the block's k central differences
    along unit tangents, E[<g, v>²] = ||g||²/B, so ||g|| ≈ sqrt(B·mean(numeric²)).
    Returns a list of floats, one per leaf.
    """
    lo = np.array([a for a, _ in blocks])
    hi = np.array([b for _, b in blocks])
    size = hi - lo
    if grad is not None:
        sq = np.concatenate([[0.0], np.cumsum(np.square(grad))])
        norm = np.sqrt(np.maximum(sq[hi] - sq[lo], 0.0))
    else:
        per_block = np.square(numeric[:len(blocks) * k]).reshape(len(blocks), k)
        norm = np.sqrt(size * per_block.mean(axis=1))
    floor = np.broadcast_to(np.asarray(floor, np.float64), numeric.shape)
    block_floor = floor[:len(blocks) * k].reshape(len(blocks), k).max(axis=1)
    res = block_resolution(size, norm, k, block_floor, rtol)
    return [float(res[a:b].max()) for a, b in zip(first[:-1], first[1:])]


def describe(block_size, sizes, k, per_tangent, budget, worst, path) -> str:
    """The report's note on how audit chose its directions."""
    count = evaluations(sizes, block_size, k, per_tangent)
    cut = ("each leaf whole (cutting would exceed the budget)" if block_size is None
           else f"leaves cut into blocks of at most {block_size:,} elements")
    return (f"audit: directional mode, {cut}: {k} tangents per block, {count:,} evaluations "
            f"within a budget of {budget:,}; a single-element error above a leaf's resolution "
            f"is reported with probability >= {CONFIDENCE:.0%} (worst {worst:.3g} at {path}; "
            "smaller blocks would see smaller errors at more evaluations).")


def default_budget(n: int, max_full_elements: int) -> int:
    """Evaluations that cost about as much as the largest full check audit runs: 2N forward
    passes of an N-element model (N = max_full_elements), taking a pass's cost as
    proportional to the parameter count n (true of dense layers at a fixed batch)."""
    return max(1, math.floor(2 * max_full_elements ** 2 / max(n, 1)))


def resolution_note(k: int, blocked: bool) -> str:
    """The report's note on what a directional row's resolution means."""
    where = "block" if blocked else "leaf"
    return (f"directional: a leaf's resolution is the smallest single-element error (absolute, "
            f"in the derivative's units) reported with probability >= {CONFIDENCE:.0%} over "
            f"the {k} random tangents per {where}; one wrong element of a {where} of B "
            "elements moves a directional derivative by only about 1/sqrt(B) of its error.")
