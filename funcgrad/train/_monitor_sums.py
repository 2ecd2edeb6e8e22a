"""The monitor's sums: per-leaf and per-layer statistics of a gradient in a few kernels
whatever the number of leaves (`funcgrad.train.monitor` packs them into its vector)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def values_dtype(leaves: Sequence[Any]):
    """float32, or float64 when a leaf is float64 (half precision is summed in float32, so a
    sum of many squares neither loses its small terms nor overflows early)."""
    return jnp.result_type(jnp.float32, *(jnp.result_type(g) for g in leaves
                                          if jnp.issubdtype(jnp.result_type(g), jnp.floating)))


#: Elements per row of the padded matrix that `_sums` reduces in one pass.
_CHUNK = 512
#: Most elements of the leaves padded into that matrix, and most elements of the matrix with
#: its zero padding (every leaf pads to at least one row); leaves beyond are reduced alone.
_MATRIX_LIMIT = 2**16
_PADDED_LIMIT = 2**18


def _sums(flat: Sequence[jax.Array], groups: np.ndarray) -> jax.Array:
    """``[sum, sum of squares]`` of each group of the 1-D arrays `flat`: shape (groups, 2).

    ``groups[i, k] = 1`` puts ``flat[i]`` into group k. A few kernels whatever the number of
    small arrays (two reductions per gradient leaf made the monitor cost ~35% of a small CPU
    step): the smallest arrays, up to `_MATRIX_LIMIT` elements (and `_PADDED_LIMIT` after
    padding, so that hundreds of bias vectors still fit), are zero-padded to whole rows of
    `_CHUNK` elements (zeros change neither sum) and all their rows reduced at once; each
    larger array is reduced on its own. A 0/1 matrix then adds the row sums up
    per group. Past ~40k elements XLA:CPU splits a concatenate across threads and it becomes
    far slower than per-array reductions (a 1.1M-element model: 1.2 ms against 0.24 ms for
    the monitor's update), hence the limit; on any backend it also bounds the copy.
    """
    dtype = jnp.result_type(*flat)
    order = sorted(range(len(flat)), key=lambda i: flat[i].size)
    rows = [-(-f.size // _CHUNK) for f in flat]
    small, real, padded = [], 0, 0
    for i in order:
        if (real + flat[i].size > _MATRIX_LIMIT
                or padded + rows[i] * _CHUNK > _PADDED_LIMIT):
            break
        small.append(i)
        real, padded = real + flat[i].size, padded + rows[i] * _CHUNK
    small.sort()
    chosen = set(small)
    large = [i for i in range(len(flat)) if i not in chosen]
    parts, owner = [], []  # blocks of (sum, sum of squares) rows; the array of each row
    if small:
        # The padded rows, written by one fused kernel, then two row reductions. (A matrix with
        # each row of squares stacked beside its row of values, reduced once, took ~10 us more
        # kernel time per step in a CPU profile: that concatenate is slow elementwise code.)
        matrix = jnp.concatenate([
            jnp.pad(flat[i], (0, rows[i] * _CHUNK - flat[i].size)).reshape(rows[i], _CHUNK)
            for i in small])
        parts.append(jnp.stack([jnp.sum(matrix, axis=1), jnp.sum(matrix * matrix, axis=1)],
                               axis=1))
        owner += [i for i in small for _ in range(rows[i])]
    if large:
        parts.append(jnp.stack([jnp.stack([jnp.sum(flat[i]), jnp.sum(flat[i] * flat[i])])
                                for i in large]))
        owner += large
    row_sums = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    to_groups = groups[owner].T  # (groups, rows): row r belongs to the groups of its array
    return jnp.matmul(jnp.asarray(to_groups, dtype), row_sums,
                      precision=jax.lax.Precision.HIGHEST)


def statistics(grads: PyTree, leaf_names: Sequence[str], layer_of: Sequence[int],
                n_layers: int, dtype):
    """``(sum of squares of all leaves, [leaf norms, layer norms], leaf means, leaf stds)``,
    in `dtype`, from one pass over the gradients."""
    leaves = jax.tree.leaves(grads)
    for name, g in zip(leaf_names, leaves):
        if not jnp.issubdtype(jnp.result_type(g), jnp.floating):
            raise TypeError(f"the gradient monitor needs real floating-point gradients; leaf "
                            f"{name} has dtype {jnp.result_type(g)} and shape {jnp.shape(g)}. "
                            "Freeze integer leaves (funcgrad.trainable_mask) or take their "
                            "gradient out.")
    flat = [jnp.ravel(x).astype(dtype) for x in leaves]
    # Groups summed: each leaf, each layer, then all leaves.
    n, total = len(leaves), len(leaves) + n_layers
    groups = np.zeros((n, total + 1))
    for i, layer in enumerate(layer_of):
        groups[i, [i, n + layer, total]] = 1
    sums = _sums(flat, groups)
    sizes = np.array([max(x.size, 1) for x in flat]).astype(dtype)
    mean = sums[:n, 0] / sizes
    # One pass: var = E[g^2] - E[g]^2, clamped at 0. Its rounding error is ~eps * E[g^2], so
    # a std below ~sqrt(eps) * rms (3e-4 of the rms in float32) is noise; a second pass over
    # the gradients would cost more kernels per step.
    std = jnp.sqrt(jnp.maximum(sums[:n, 1] / sizes - mean * mean, 0))
    return sums[total, 1], jnp.sqrt(sums[:total, 1]), mean, std


def vector(*scalars: jax.Array) -> jax.Array:
    """``jnp.stack(scalars)`` as one elementwise select: XLA:CPU fuses a concatenate of at most
    8 operands into one kernel, and each stacked scalar would be an operand of its own."""
    index = jnp.arange(len(scalars))
    out = jnp.broadcast_to(scalars[-1], index.shape)
    for i in range(len(scalars) - 2, -1, -1):
        out = jnp.where(index == i, scalars[i], out)
    return out
