"""A `lax.scan` whose backward pass keeps O(levels * T**(1/levels)) carries instead of T.

`lax.scan` differentiated by `jax.grad` keeps the residuals of every one of its T steps for the
backward pass: memory grows like T. `checkpointed_scan` runs the same recurrence as scans nested
`levels` deep, each outer level's body wrapped in `jax.checkpoint`: the outermost scan keeps one
carry per segment, and the backward pass re-runs a segment's forward steps from its stored carry
when that segment's turn comes, one level at a time (Chen et al. 2016, "Training deep nets with
sublinear memory cost", arXiv:1604.06174: sqrt(n) segments; Griewank & Walther 2000, "Algorithm
799: Revolve", ACM TOMS 26(1): binomial checkpointing, of which this is the simple uniform form).

Costs, for T steps and `levels` = L with segment factors k_1 * ... * k_L >= T (k ~ T**(1/L)):
  * memory of the backward pass: at most k_1 + ... + k_L stored carries (L * T**(1/L)), plus
    the residuals of one innermost segment's k_L steps, instead of T steps' residuals;
  * time: each step's forward runs up to L times (once, plus one re-run per checkpointed level
    above it), then its backward once: about L forward passes instead of 1.
`levels=2` gives 2 * sqrt(T) carries for about one extra forward pass; `levels="log"` gives
segments of 2 at ceil(log2 T) levels: about 2 * log2(T) carries for log2(T) extra forward passes.
In the compiled program (XLA:CPU, jax 0.10.2; benchmarks/checkpointed_scan.py) each level also
holds its loop state (carry and cotangent): about 7-9 carries a level in all (8.0 * log2 T
carries at T = 10,000 with `levels="log"`, 4.2 * sqrt(T) with `levels=2`). With `levels="log"`
XLA also materialises the nested slices of `xs` (T/2 + T/4 + ... steps: one copy of `xs`), and
when T is not a power of 2, the slices and concatenated ys of the mixed-radix pieces: 2.6
copies of `xs` in all at T = 10,000; input-sized (T * x bytes), not carry-sized, but growing
like T. With `levels=2` no copy of `xs` was seen.
This is nested uniform segmenting, not the optimal Revolve schedule (which, for a given number of
stored carries, re-runs the fewest steps); it needs nothing but `lax.scan` and `jax.checkpoint`.

A T that is not a product of the factors is split exactly in mixed radix, with no padding steps:
T = d_1 * (k_2 ... k_L) + r_1, the first d_1 * (k_2 ... k_L) steps run as d_1 checkpointed
segments, and the remaining r_1 steps recursively with the factors k_2 ... k_L. Every step runs
`f` exactly once per forward (re-)run, so the results equal `lax.scan`'s up to the rounding of
the same operations.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any


def checkpointed_scan(f: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], init: PyTree,
                      xs: PyTree = None, length: int | None = None, *,
                      levels: int | str = 2, reverse: bool = False) -> tuple[PyTree, PyTree]:
    """`lax.scan(f, init, xs, length, reverse=reverse)`, whose gradient keeps far fewer carries.

    Same signature and results as `jax.lax.scan`: ``f(carry, x) -> (carry, y)`` is applied to
    the T slices of `xs` along their leading axis (from the last when `reverse`), and the result
    is the final carry and the ys stacked along a new leading axis of length T. Under `jax.grad`
    / `jax.vjp` the backward pass stores the carry at segment boundaries and recomputes each
    segment's steps from it (see the module docstring for the schedule and its sources):

      levels     carries stored        compiled, T = 10,000 (measured)   forward passes run
      1          T (this is lax.scan)  3.0 * T (3 residuals a step)     1
      2          about 2 * sqrt(T)     4.2 * sqrt(T)                    2
      L          about L * T**(1/L)                                     L
      "log"      about 2 * log2(T)     8.0 * log2(T)                    ceil(log2 T)

    ("compiled": temp + output bytes over the carry's bytes, for h -> tanh(h @ W) with h of
    shape (64, 256) float32, no xs; the compiled figure adds each level's loop state.)

    The memory that counts is that of the compiled program
    (``jax.jit(jax.grad(loss)).lower(...).compile().memory_analysis()``, temp + output bytes);
    `benchmarks/checkpointed_scan.py` measures it against `lax.scan` at T = 100 ... 10,000.
    Nested uniform segmenting, not the optimal Revolve schedule (Griewank & Walther 2000).

    Args:
      f: the step, ``f(carry, x) -> (new_carry, y)``; `new_carry` must have the structure,
        shapes and dtypes of `carry`. Pure (it is run again during the backward pass; draw
        randomness from keys carried in `carry` or passed in `xs`, never from hidden state).
      init: the initial carry, a pytree of arrays.
      xs: pytree of arrays sharing a leading axis of length T, or None (then `length` is T).
      length: T, required when `xs` is None; must equal the leading axis of `xs` if both given.
      levels: int >= 1, the nesting depth L, or "log" for ceil(log2 T) levels of segments of 2.
      reverse: scan from the last slice to the first, as `lax.scan(..., reverse=True)`; the ys
        are stacked in the order of `xs` either way.
    Returns:
      ``(carry, ys)``: the final carry (structure of `init`) and the ys, each leaf of shape
      ``(T, *y.shape)`` in y's dtype.
    Raises:
      TypeError: `levels` neither an int nor "log"; `f` not returning a pair; `f` returning a
        carry of another pytree structure or dtype than `init` (the message names the leaf).
      ValueError: `levels` < 1; neither `xs` nor `length`; leaves of `xs` with different
        leading axes or disagreeing with `length`; a carry leaf of another shape.
    Example:
      >>> step = lambda h, x: (jnp.tanh(h + x), h.sum())
      >>> h, ys = checkpointed_scan(step, jnp.zeros(3), jnp.ones((100, 3)), levels="log")
      >>> ys.shape
      (100,)
    """
    steps = _length(xs, length)
    depth = _levels(levels, steps)
    init = jax.tree.map(jnp.asarray, init)
    _check_carry(f, init, xs)
    if steps == 0 or depth == 1:
        return lax.scan(f, init, xs, length=steps, reverse=reverse)
    return _nested_scan(f, init, xs, steps, _factors(steps, depth), reverse)


def _nested_scan(f, carry, xs, steps, factors, reverse):
    """`lax.scan(f, carry, xs, length=steps)` as scans nested over `factors` (module docstring):
    `steps` = d * prod(factors[1:]) + r, the d full segments in a scan of checkpointed segments,
    the r remaining steps recursively with factors[1:]."""
    if len(factors) == 1 or steps <= factors[-1]:
        return lax.scan(f, carry, xs, length=steps, reverse=reverse)
    seg = math.prod(factors[1:])
    count, rest = divmod(steps, seg)
    full = count * seg
    # Forward: the full segments are the first `full` steps; reversed: the last `full` steps.
    head, tail = (rest, steps) if reverse else (0, full)

    def segment(c, x):
        return _nested_scan(f, c, x, seg, factors[1:], reverse)

    def run_full(c):
        x = jax.tree.map(lambda a: a[head:tail].reshape(count, seg, *a.shape[1:]), xs)
        # prevent_cse=False (advised by JAX's docs for a checkpoint inside scan) compiled to
        # the same temp + output bytes here (T = 1024, 4096); the default is kept.
        c, y = lax.scan(jax.checkpoint(segment), c, x, length=count, reverse=reverse)
        return c, jax.tree.map(lambda a: a.reshape(full, *a.shape[2:]), y)

    def run_rest(c):
        lo, hi = (0, rest) if reverse else (full, steps)
        x = jax.tree.map(lambda a: a[lo:hi], xs)
        return _nested_scan(f, c, x, rest, factors[1:], reverse)

    parts = []  # ys of the pieces in the order they run (the order of xs when not reverse)
    if count:
        carry, y = run_full(carry)
        parts.append(y)
    if rest:
        carry, y = run_rest(carry)
        parts.append(y)
    if len(parts) == 1:
        return carry, parts[0]
    first, last = parts[::-1] if reverse else parts
    return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, last)


def _factors(steps: int, depth: int) -> tuple[int, ...]:
    """Segment sizes k_1 ... k_L, each about steps**(1/L), with product >= steps: k_i is the
    smallest integer whose (L - i + 1)-th power covers the steps still to be split; factors of
    1 (more levels than steps need) are dropped."""
    factors, remaining = [], steps
    for i in range(depth):
        k = _ceil_root(remaining, depth - i)
        factors.append(k)
        remaining = -(-remaining // k)
    return tuple(k for k in factors if k > 1) or (1,)


def _ceil_root(n: int, p: int) -> int:
    """The smallest integer k >= 1 with k**p >= n, exactly (no float rounding)."""
    k = max(1, int(round(n ** (1.0 / p))))
    while k ** p < n:
        k += 1
    while k > 1 and (k - 1) ** p >= n:
        k -= 1
    return k


def _levels(levels: object, steps: int) -> int:
    if isinstance(levels, str):
        if levels != "log":
            raise TypeError(f"checkpointed_scan: levels={levels!r}; expected an int >= 1 or "
                            "the string 'log'. Pass levels=2 for about 2*sqrt(T) stored "
                            "carries, or levels='log' for about 2*log2(T).")
        return max(1, math.ceil(math.log2(steps))) if steps > 1 else 1
    if isinstance(levels, bool) or not isinstance(levels, int):
        raise TypeError(f"checkpointed_scan: levels={levels!r} of type {type(levels).__name__};"
                        " expected an int >= 1 or the string 'log'. Pass levels=2 (sqrt(T) "
                        "segmenting) or levels='log'.")
    if levels < 1:
        raise ValueError(f"checkpointed_scan: levels={levels}; expected an int >= 1 (1 is "
                         "lax.scan itself, 2 keeps about 2*sqrt(T) carries) or 'log'. Pass "
                         "levels=2.")
    return levels


def _length(xs: PyTree, length: int | None) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(xs)
    if not leaves:
        if length is None:
            raise ValueError("checkpointed_scan: neither xs nor length given, so the number of "
                             "steps is unknown. Pass length=T (as for lax.scan), or xs with a "
                             "leading axis of length T.")
        return _as_steps(length)
    axes: dict[int, str] = {}  # steps -> the first leaf with that many
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        if not shape:
            raise ValueError(f"checkpointed_scan: xs{jax.tree_util.keystr(path)} is a scalar; "
                             "every leaf of xs needs a leading axis of length T (the steps). "
                             "Stack the per-step values, or close over a value every step uses.")
        axes.setdefault(shape[0], jax.tree_util.keystr(path))
    if len(axes) > 1:
        listed = ", ".join(f"xs{p} has {n}" for n, p in axes.items())
        raise ValueError(f"checkpointed_scan: the leaves of xs disagree on the number of steps "
                         f"(leading axis): {listed}. Every leaf of xs needs the same leading "
                         "axis T; slice or pad them to one length.")
    (steps,) = axes
    if length is not None and _as_steps(length) != steps:
        raise ValueError(f"checkpointed_scan: length={length}, but the leaves of xs have a "
                         f"leading axis of {steps}. Drop length, or pass length={steps}.")
    return steps


def _as_steps(length: object) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"checkpointed_scan: length={length!r}; expected a Python int >= 0 "
                         "(the number of steps T, known when the function is traced).")
    return length


def _check_carry(f, init, xs) -> None:
    """Traces one step abstractly and compares the new carry with `init`, leaf by leaf, so a
    mismatch is reported by path before `lax.scan`'s own error from deep inside JAX."""
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), xs)
    out = jax.eval_shape(f, init, x)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"checkpointed_scan: f returned {type(out).__name__} "
                        f"{_describe(out)}; expected a pair (new_carry, y), as lax.scan's f "
                        "does. Return `carry, y` (y may be None).")
    new = out[0]
    want, got = jax.tree.structure(init), jax.tree.structure(new)
    if want != got:
        raise TypeError(f"checkpointed_scan: f returned a carry of structure {got}, but init "
                        f"has structure {want}; the carry must keep init's pytree structure "
                        "from step to step. Return a new carry built like init.")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(init), jax.tree.leaves(new)):
        name = f"carry{jax.tree_util.keystr(path)}"
        if a.shape != b.shape:
            raise ValueError(f"checkpointed_scan: f returned {name} of shape {b.shape}, but "
                             f"init's is {a.shape}; each carry leaf keeps its shape from step "
                             "to step. Reshape the new value, or give init the shape f returns.")
        if a.dtype != b.dtype:
            raise TypeError(f"checkpointed_scan: f returned {name} of dtype {b.dtype}, but "
                            f"init's is {a.dtype}; each carry leaf keeps its dtype from step "
                            f"to step. Cast it (new.astype({a.dtype})) or make init {b.dtype}.")


def _describe(value) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", value))
