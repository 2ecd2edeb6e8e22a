"""Global norms of gradient pytrees, as the train step reports them.

The global norm of a pytree is the L2 norm of all its elements taken together,
``sqrt(sum over leaves of sum(leaf**2))`` — the quantity ``torch.nn.utils.clip_grad_norm_``
returns and ``optax.clip_by_global_norm`` compares against its maximum.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of every element of `tree` taken together (the "global norm").

    Equal to ``optax.tree.norm(tree)`` up to float rounding (the sum is taken in a different
    order). The leaves of each dtype are flattened and concatenated into one vector and reduced
    once (``sum(v * v)``), so XLA emits one reduction kernel per dtype instead of one per leaf
    plus the adds between them; on CPU that made a small train step ~10% faster (see
    ``benchmarks/train_step.py``; a dot product instead of the reduction measured slower). Half-precision leaves (float16, bfloat16) are summed in
    float32 so that a sum of many small squares does not lose precision or overflow early.

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
        vector = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            vector = jnp.abs(vector)
        if jnp.finfo(vector.dtype).bits < 32:
            vector = vector.astype(jnp.float32)
        sums.append(jnp.sum(vector * vector))
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return jnp.sqrt(total)
