"""Full mode's 2n perturbed forward passes, run in blocks so a long check shows its progress.

Private to `funcgrad.check`. The perturbations e_i (one per element of the flat parameter
vector theta) run in vmapped chunks of c; chunks are grouped into at most `_MAX_BLOCKS` equal
blocks, each one call of the same compiled kernel (the block's number is an argument, so nothing is
recompiled per block, and the last block is padded with indices >= n that perturb nothing).
After the second block the time left is extrapolated from it (the first includes compilation);
when the whole check would take longer than `SLOW_SECONDS`, a line on stderr says so and
suggests directional mode, and a tqdm bar shows the blocks done and the time left.

The work is the same 2n evaluations of the function as in one call; a dispatch per block adds
well under a millisecond on CPU (64 blocks at most).
"""
from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.check import _objective as obj

#: A full check expected to run longer than this (seconds) announces itself and shows a bar.
SLOW_SECONDS = 10.0
#: Most blocks (compiled-call dispatches) a full check is cut into.
_MAX_BLOCKS = 64
#: Up to this many chunks, a full check is one compiled call with no progress estimate.
_PROBE_ROWS = 8


@functools.partial(jax.jit, static_argnames=("spec", "eps", "chunk", "rows", "rev"))
def _block_kernel(spec, theta, leaves, cotangents, start, *, eps, chunk, rows, rev=True):
    """phi(theta ± eps·e_i) for the `rows` x `chunk` indices i = start + j (`start` a traced
    int, so every block of a shape shares one compilation; i >= n perturbs nothing). Without
    `rev`, also d phi/d theta_i by a jvp along e_i (the gradient in forward mode). Returns
    arrays of shape (rows·chunk,)."""
    n = theta.shape[0]
    index = jnp.arange(n)
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    ids = start + jnp.arange(rows * chunk).reshape(rows, chunk)

    def plus_minus(i):
        e = jnp.where(index == i, eps, 0.0)
        out = phi(theta + e), phi(theta - e)
        return out if rev else (*out, basis_jvp(phi, theta, index, i))

    batched = jax.vmap(plus_minus)
    cols = batched(ids[0]) if rows == 1 else jax.lax.map(batched, ids)
    return tuple(jnp.ravel(c) for c in cols)


def basis_jvp(phi, theta, index, i):
    """d phi / d theta_i, by a jvp along the i-th unit vector (0 for a padded i >= n)."""
    return jax.jvp(phi, (theta,), (jnp.where(index == i, 1.0, 0.0),))[1]


@functools.partial(jax.jit, static_argnames=("spec", "rev"))
def _point_kernel(spec, theta, leaves, cotangents, tangents, *, rev=True):
    """phi(theta); grad phi(theta) with `rev` (else None); the output at theta; and, when
    `tangents` (T, n) is given, the jvp of phi along each of them."""
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    jvps = (None if tangents is None else
            jax.vmap(lambda v: jax.jvp(phi, (theta,), (v,))[1])(tangents))
    return (phi(theta), jax.grad(phi)(theta) if rev else None,
            obj.output_vector(spec, theta, leaves), jvps)


def run(spec, theta, leaves, cotangents, tangents, *, eps, chunk, rev=True, progress=None):
    """All of full mode's evaluations: ``(f0, f_plus, f_minus, grad, output, jvps)`` as NumPy
    arrays (f_plus, f_minus, grad of shape (n,); jvps None without `tangents`). Without `rev`
    the gradient is taken in forward mode, one jvp per element, alongside the perturbations.

    `progress`: None shows a bar (and the estimate) only for a check expected to take longer
    than `SLOW_SECONDS`; True always; False never (the estimate line is still printed).

    A check of more than `_PROBE_ROWS` chunks first runs two single chunks (the first compiles,
    the second is timed), so the estimate comes after 2c evaluations whatever the model's
    size; the rest runs in at most `_MAX_BLOCKS` equal blocks of one compiled shape."""
    n = theta.shape[0]
    c = min(chunk, n)
    total_rows = -(-n // c)
    point = _point_kernel(spec, theta, leaves, cotangents, tangents, rev=rev)
    kernel = functools.partial(_block_kernel, spec, theta, leaves, cotangents, eps=eps,
                               chunk=c, rev=rev)
    parts, bar, start = [], None, time.perf_counter()
    try:
        if total_rows <= _PROBE_ROWS:  # small: one call, as fast as it gets
            if progress:
                bar = _bar(1)
            parts.append(kernel(np.int32(0), rows=total_rows))
        else:
            for k in range(2):  # two single chunks: compile, then time one
                t0 = time.perf_counter()
                parts.append(jax.block_until_ready(kernel(np.int32(k * c), rows=1)))
            rest = total_rows - 2
            blocks = min(rest, _MAX_BLOCKS)
            rows = -(-rest // blocks)
            blocks = -(-rest // rows)
            left = (time.perf_counter() - t0) * rest
            bar = _announce(n, time.perf_counter() - start, left, blocks, progress)
            for k in range(blocks):
                out = kernel(np.int32((2 + k * rows) * c), rows=rows)
                parts.append(out)
                if bar is not None:
                    jax.block_until_ready(out)
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    cols = [np.concatenate([np.asarray(p[j]) for p in parts])[:n] for j in range(len(parts[0]))]
    f0, grad, output, jvps = point
    if not rev:
        grad = cols[2]
    return (np.asarray(f0), cols[0], cols[1], np.asarray(grad), np.asarray(output),
            None if jvps is None else np.asarray(jvps))


def _announce(n, spent, left, blocks, progress):
    """After the two probe chunks: say how long the check will take when that is long, and
    return a bar over the remaining blocks (or None)."""
    slow = spent + left > SLOW_SECONDS
    if slow:
        print(f"check_grads perturbs each of {n:,} elements twice ({2 * n:,} forward passes): "
              f"roughly {_duration(left)} left. funcgrad.check_directional (or funcgrad.audit, "
              "which picks it for large models) checks random tangents and bisects a failure "
              "to its element in seconds.", file=sys.stderr)
    return _bar(blocks) if progress or (progress is None and slow) else None


def _bar(blocks):
    from tqdm.auto import tqdm
    return tqdm(total=blocks, desc="check_grads (full)", unit="block", leave=False)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
