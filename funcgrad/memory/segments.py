"""How a stack of n layers is cut into segments for `remat_sequential`: the sizes, nested
plans, and the share of the layers recomputed in the backward pass.

Pure arithmetic on layer counts (no JAX): ``"sqrt"`` is Chen et al. 2016's sqrt(n) segments,
``"log"`` their recursive halving (section 4).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def segment_sizes(n: int, segments: Any) -> tuple[int, ...]:
    """The sizes of the segments `n` layers are cut into (one level; see `segment_plan`).

    `segments`: "sqrt" (segments of ceil(sqrt n) layers: Chen et al. 2016), an int k (segments
    of k layers, the last one shorter), or explicit sizes summing to n.
    Raises ValueError naming the fix for a size outside [1, n] or sizes not summing to n."""
    if n < 1:
        raise ValueError("remat_sequential needs at least one layer, got none.")
    if isinstance(segments, str):
        if segments != "sqrt":
            raise ValueError(f"remat_sequential: segments must be 'sqrt', 'log', an int or a "
                             f"tuple of sizes, got {segments!r}.")
        k = math.ceil(math.sqrt(n))
    elif isinstance(segments, (bool, float)) or not (
            isinstance(segments, int) or isinstance(segments, Sequence)):
        raise TypeError(f"remat_sequential: segments must be 'sqrt', 'log', an int or a tuple "
                        f"of sizes, got {segments!r}.")
    elif isinstance(segments, int):
        k = segments
        if not 1 <= k <= n:
            raise ValueError(f"remat_sequential: a segment of {k} layers does not fit a stack "
                             f"of {n}; pass a size in [1, {n}] (or 'sqrt').")
    else:
        sizes = tuple(int(s) for s in segments)
        if any(s < 1 for s in sizes) or sum(sizes) != n:
            raise ValueError(f"remat_sequential: segment sizes {sizes} must be positive and "
                             f"sum to the {n} layers.")
        return sizes
    return (k,) * (n // k) + ((n % k,) if n % k else ())


def _layers_in(entry: Any) -> int:
    return entry if isinstance(entry, int) else sum(_layers_in(e) for e in entry)


def _bisection(n: int) -> tuple:
    # Halve recursively down to single layers: O(log n) segment inputs held at once, each
    # layer recomputed at most log2(n) times (Chen et al. 2016, section 4's recursion).
    if n == 1:
        return (1,)
    first = (n + 1) // 2
    return tuple(_bisection(m) if m > 1 else 1 for m in (first, n - first))


def segment_plan(n: int, segments: Any) -> tuple:
    """The (possibly nested) segmentation of `n` layers that `remat_sequential` runs.

    `segments`: "sqrt", an int k or flat sizes (one level, as `segment_sizes`); "log" (halved
    recursively down to single layers: memory O(log n) activations, each layer recomputed up
    to log2 n times); or a nested tuple whose entries are sizes (a segment of that many layers)
    or tuples (a segment cut again by that tuple), e.g. ``((3, 2, 1), (2, 1), 1)`` for 10
    layers.
    Returns: a tuple of ints and tuples whose layer counts sum to n.
    Raises: ValueError / TypeError as `segment_sizes`, or for a nested tuple not summing to n."""
    if isinstance(segments, str) and segments == "log":
        if n < 1:
            raise ValueError("remat_sequential needs at least one layer, got none.")
        return _bisection(n)
    if (isinstance(segments, Sequence) and not isinstance(segments, str)
            and any(isinstance(e, Sequence) for e in segments)):
        def check(entry):
            if isinstance(entry, Sequence) and not isinstance(entry, str):
                if not entry:
                    raise ValueError("remat_sequential: an empty nested segment; every tuple in "
                                     "segments needs at least one size.")
                return tuple(check(e) for e in entry)
            if isinstance(entry, bool) or not isinstance(entry, int) or entry < 1:
                raise ValueError(f"remat_sequential: nested segment sizes must be positive "
                                 f"ints or tuples of them, got {entry!r}.")
            return int(entry)
        plan = check(segments)
        if _layers_in(plan) != n:
            raise ValueError(f"remat_sequential: the nested segments {plan} cover "
                             f"{_layers_in(plan)} layers, not the {n} of the stack.")
        return plan
    return segment_sizes(n, segments)


def recompute_fraction(plan: tuple, keep_last: bool = True) -> float:
    """Layers recomputed in the backward pass per layer of the forward pass, for a plan of
    `segment_plan`: each layer is recomputed once per rematerialised segment containing it
    (0.75: three quarters of the layers run twice; 2.0: every layer runs three times)."""
    def extra(entries):
        total = 0
        for j, e in enumerate(entries):
            if not (keep_last and j == len(entries) - 1):
                total += _layers_in(e)
            if not isinstance(e, int):
                total += extra(e)
        return total
    return extra(plan) / _layers_in(plan)
