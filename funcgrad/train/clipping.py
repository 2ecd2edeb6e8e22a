"""Global norms of gradient pytrees and clipping by global norm, as the train step uses them.

The global norm of a pytree is the L2 norm of all its elements taken together,
``sqrt(sum over leaves of sum(leaf**2))`` — the quantity ``torch.nn.utils.clip_grad_norm_``
returns and ``optax.clip_by_global_norm`` compares against its maximum.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of every element of `tree` taken together (the "global norm").

    Equal to ``optax.tree.norm(tree)`` up to float rounding (the sum is taken in a different
    order). The small leaves of each dtype, up to `_CONCAT_LIMIT` elements in all, are flattened
    and concatenated into one vector and reduced once, so a small model costs one reduction
    kernel per dtype instead of one per leaf plus the adds between them (on CPU that made a
    small train step ~10% faster, ``benchmarks/train_step.py``; a dot product measured slower).
    Larger leaves are reduced one by one: a concatenate past ~40k elements is split across
    threads by XLA:CPU and became pathologically slow (1.1M elements: 26 ms against 0.2 ms for
    per-leaf sums, jax 0.10.2 on 2 cores), and on any backend it copies every gradient once.
    Half-precision leaves (float16, bfloat16) are summed in float32 so that a sum of many
    small squares does not lose precision or overflow early.

    Args:
      tree: a pytree of floating-point arrays of any shapes (e.g. gradients); may be empty.
    Returns:
      A scalar array of shape (): the norm, in the units of the leaves. Its dtype is the
      promoted dtype of the leaves, at least float32 when any leaf is half precision; float32
      for an empty tree. Like any sum of squares it is ``inf`` when an element's square
      overflows (|x| > ~1.8e19 in float32) and ``nan`` when an element is nan.
    Raises:
      TypeError: if a leaf is not a floating-point (or complex) array.
    """
    leaves = jax.tree.leaves(tree)
    groups: dict[np.dtype, list[jax.Array]] = {}
    for leaf in leaves:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(f"global_norm needs floating-point leaves, got a leaf of dtype {dtype} "
                            f"and shape {jnp.shape(leaf)}. Take the norm of the gradients only "
                            "(integer leaves have no gradient).")
        groups.setdefault(dtype, []).append(jnp.ravel(leaf))
    if not groups:
        return jnp.zeros((), jnp.float32)
    sums = []
    for dtype, flat in groups.items():
        for vector in _packed(flat):
            if jnp.issubdtype(dtype, jnp.complexfloating):
                vector = jnp.abs(vector)
            if jnp.finfo(vector.dtype).bits < 32:
                vector = vector.astype(jnp.float32)
            sums.append(jnp.sum(vector * vector))
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return jnp.sqrt(total)


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of the floating-point leaves of `tree` is finite (no NaN, no inf).

    The train step's guard on the new params. It tests the sum of all elements: a NaN or
    inf anywhere makes the sum NaN or inf. The sum is taken on the same vectors as
    `global_norm` (the small leaves of a dtype concatenated; half precision summed in
    float32), so XLA fuses it into the computation of the values and a small model costs one
    float reduction (``jnp.isfinite(x).all()`` became a boolean reduction of three kernels on
    XLA:CPU). The one false alarm: finite elements whose sum overflows, |sum| > ~3.4e38 in
    float32, i.e. params already of that order.

    Args:
      tree: a pytree of arrays of any shapes and dtypes; leaves that are not floating point
        (integers, bools) cannot hold a NaN/inf and are not looked at. May be empty.
    Returns:
      a bool array of shape (): True iff no element is NaN or inf (True for an empty tree).
    """
    groups: dict[np.dtype, list[jax.Array]] = {}
    for leaf in jax.tree.leaves(tree):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.inexact):
            groups.setdefault(dtype, []).append(jnp.ravel(leaf))
    total = jnp.zeros((), jnp.float32)
    for flat in groups.values():
        for vector in _packed(flat):
            if jnp.finfo(vector.dtype).bits < 32:
                vector = vector.astype(jnp.float32)
            total = total + jnp.sum(vector)
    return jnp.isfinite(total)


#: Most elements `global_norm` concatenates into one vector before reducing (see there).
_CONCAT_LIMIT = 2**15


def _packed(flat: list[jax.Array]) -> list[jax.Array]:
    """`flat` (1-D arrays of one dtype) as the vectors to reduce: the smallest, concatenated
    while their total stays within `_CONCAT_LIMIT` elements, then each larger one alone."""
    order = sorted(range(len(flat)), key=lambda i: flat[i].size)
    small, total = [], 0
    for i in order:
        if total + flat[i].size > _CONCAT_LIMIT:
            break
        small.append(i)
        total += flat[i].size
    head = ([flat[small[0]]] if len(small) == 1 else
            [jnp.concatenate([flat[i] for i in sorted(small)])] if small else [])
    return head + [flat[i] for i in order[len(small):]]


class ClipInfo(NamedTuple):
    """What clipping did, for the step's metrics (optax's clipping keeps none of it).

    Attributes:
      grad_norm: shape (), the global norm before clipping (and before zeroing, so a
        non-finite gradient shows as nan/inf here).
      clip_coef: shape (), the factor the gradients were multiplied by:
        ``min(1, max_norm / norm)`` of the norm actually clipped (1.0 when not clipped).
      nonfinite_leaves: shape (), int32; how many leaves held a NaN or inf (and were zeroed
        when ``zero_nonfinite=True``).
    """
    grad_norm: jax.Array
    clip_coef: jax.Array
    nonfinite_leaves: jax.Array


def zero_nonfinite_leaves(tree: PyTree) -> tuple[PyTree, jax.Array]:
    """Replaces every leaf that holds a NaN or inf by zeros; the others are kept as they are.

    Args:
      tree: a pytree of floating-point arrays (e.g. gradients).
    Returns:
      ``(tree, count)``: the same structure, shapes and dtypes; `count` (shape (), int32) is the
      number of leaves that were zeroed.
    """
    leaves, treedef = jax.tree.flatten(tree)
    bad = [~jnp.all(jnp.isfinite(x)) for x in leaves]
    kept = [jnp.where(b, jnp.zeros_like(x), x) for b, x in zip(bad, leaves)]
    count = sum((b.astype(jnp.int32) for b in bad), jnp.zeros((), jnp.int32))
    return jax.tree.unflatten(treedef, kept), count


def clip_grads(grads: PyTree, max_norm: float, *, zero_nonfinite: bool = False,
               grad_norm: jax.Array | None = None) -> tuple[PyTree, ClipInfo]:
    """Scales `grads` so that their global norm is at most `max_norm`, and says what it did.

    The scaling of ``optax.clip_by_global_norm(max_norm)`` and PyTorch's
    ``clip_grad_norm_`` (article A §3.4, B §4.3; Pascanu et al. 2013): gradients whose norm
    ``n`` exceeds `max_norm` are multiplied by ``max_norm / n``, which keeps their direction;
    otherwise they are unchanged (multiplied by exactly 1). Written out here, as PyTorch
    writes it (one coefficient times every leaf; optax divides each element by n, equal up to
    rounding), so that it reuses the norm already computed and fuses into the optimizer: with
    optax's transformation the clipped step of a 1.1M-parameter MLP took longer on CPU (a
    second pass for the norm and a kernel per leaf for the divide). Unlike optax alone it
    returns the pre-clip norm and the coefficient, and can zero the leaves that hold a NaN or
    inf first — optax would divide every leaf by a nan norm and turn the whole tree into NaN.

    Args:
      grads: a pytree of floating-point arrays.
      max_norm: the largest global norm allowed, a finite number > 0 (units of the gradients).
      zero_nonfinite: zero the leaves holding a NaN/inf before clipping (the train step's
        ``nonfinite="zero"`` policy); the norm is then that of the remaining leaves.
      grad_norm: the global norm of `grads` if already computed (saves a reduction).
    Returns:
      ``(clipped, info)``: the clipped pytree (same structure, shapes, dtypes) and a `ClipInfo`.
    Raises:
      ValueError: if `max_norm` is not a finite number > 0.
    """
    if not (isinstance(max_norm, (int, float, np.number)) and np.isfinite(max_norm)
            and max_norm > 0):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}.")
    norm = global_norm(grads) if grad_norm is None else grad_norm
    if zero_nonfinite:
        grads, count = zero_nonfinite_leaves(grads)
        clipped_norm = global_norm(grads)
    else:
        count = jnp.asarray(sum((~jnp.all(jnp.isfinite(x))).astype(jnp.int32)
                                for x in jax.tree.leaves(grads)), jnp.int32)
        clipped_norm = norm
    # One scalar coefficient, multiplied into every leaf on the norm already taken (optax's
    # transformation would take the norm again: one more pass over every gradient). A multiply
    # by a scalar fuses into each consumer of the gradient (the optimizer's moments and the
    # update); optax's per-element divide, (g / n) * max_norm, is one more kernel per leaf
    # that writes the clipped gradient out (XLA does not duplicate a divide into several
    # consumers): together ~3-8% of a 1.1M-parameter CPU step, in noisy measurements.
    coef = jnp.where(clipped_norm < max_norm, 1.0, max_norm / clipped_norm)
    clipped = jax.tree.map(lambda t: t * coef.astype(t.dtype), grads)
    return clipped, ClipInfo(norm, coef.astype(jnp.result_type(norm)), count)
