"""Coupled examples: whether one example's loss depends on the other examples of its batch.

Accumulation (`funcgrad.accumulate`) equals the full-batch gradient only when each example's
loss depends on that example alone: ``loss_fn(params, batch)[i]`` must equal
``loss_fn(params, batch[i:i+1])[0]``. A loss centred on the batch mean, or BatchNorm in
training mode (mean and variance over the batch axis), breaks that: each micro-batch then uses
its own statistics, and a centred loss over micro-batches of one example has gradient 0.

`find_coupling` tests that condition once, when an accumulating computation is traced: it
evaluates the loss on a probe batch of P rows (P = m clipped to 3 .. 8) and on each row alone
(``jax.vmap`` over batches of one), and reports the first example whose two losses differ by
more than `RTOL` of the largest |loss|. The probe runs on synthetic values of the micro-batch's
and the params' shapes and dtypes (under ``jax.jit`` the real values are not known at trace
time): floating leaves are standard normal, params scaled by 1/sqrt(fan-in) (the leaf's size
over its last axis) so activations stay O(1); integer leaves are 0/1 in a checkerboard (valid
labels and token ids for any 2 classes; with at least 3 rows, some rows share their integers
and some differ, so a coupling through labels shows); booleans are True; PRNG keys are
distinct. It costs two forward passes of at most 8 examples, once per trace, and no host
round-trip in the compiled step. A loss that cannot run on the probe (a batch size hard-coded
in it) or gives non-finite values there is not judged.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

#: Two losses of one example, in the batch and alone, differ when |a - b| > RTOL * max |loss|
#: (or 32 float eps of the loss's dtype, if larger): batched and single-row evaluation only
#: reorder float sums, a few ulps; a coupled loss differs at O(1) relative.
RTOL = 1e-3


class CoupledExamplesWarning(UserWarning):
    """An accumulated loss couples the examples of a micro-batch (see `funcgrad.coupling`)."""


@dataclasses.dataclass(frozen=True)
class Coupling:
    """One example whose loss changes with the other examples of its batch.

    Attributes:
      example: the row i of the probe batch (0-based).
      rows: P, the probe batch's size.
      in_batch: ``loss_fn(params, probe)[i]``, as a float.
      alone: ``loss_fn(params, probe[i:i+1])[0]``, as a float.
    """
    example: int
    rows: int
    in_batch: float
    alone: float


def find_coupling(loss_fn: Callable[[PyTree, PyTree], jax.Array], params: PyTree,
                  microbatch: PyTree) -> Coupling | None:
    """Returns the first example whose loss depends on the other examples of its batch, or None.

    Safe to call while tracing (inside ``jax.jit`` or ``lax.scan``): only the shapes and dtypes
    of `params` and `microbatch` are used, and the probe runs on concrete synthetic values (see
    the module docstring), under ``jax.ensure_compile_time_eval``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> losses`` of shape ``(rows,)``, one per example.
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``s (values are not read).
      microbatch: a pytree whose leaves have shape ``(m, ...)``; values are not read.
    Returns:
      a `Coupling`, or None when every example's loss is the same alone as in the batch, or
      when the probe could not run or gave no finite pair (then nothing is claimed).
    """
    m = jax.tree.leaves(microbatch)[0].shape[0]
    rows = min(max(m, 3), 8)
    rng = np.random.default_rng(0)

    def alone(example):
        return loss_fn(probe_params, jax.tree.map(lambda a: a[None], example))[0]

    try:  # under a trace even constants are staged, unless evaluated at compile time
        with jax.ensure_compile_time_eval(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the user's own warnings come from the real trace
            probe_params = jax.tree.map(lambda a: _synthetic(a, rng, fan_in=True), params)
            probe = jax.tree.map(
                lambda a: _synthetic(jax.ShapeDtypeStruct((rows, *a.shape[1:]),
                                                          jnp.result_type(a)), rng), microbatch)
            together = loss_fn(probe_params, probe)
            single = jax.vmap(alone)(probe)
            dtype = jnp.result_type(together)
            together = np.asarray(jnp.asarray(together, jnp.float32), np.float64)
            single = np.asarray(jnp.asarray(single, jnp.float32), np.float64)
    except Exception:  # noqa: BLE001 -- a loss the probe cannot run is not judged
        return None
    if together.shape != (rows,) or single.shape != (rows,):
        return None
    finite = np.isfinite(together) & np.isfinite(single)
    if not finite.any():
        return None
    eps = float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0
    scale = max(np.abs(together[finite]).max(), np.abs(single[finite]).max(), 1e-30)
    far = finite & (np.abs(together - single) > max(RTOL, 32 * eps) * scale)
    if not far.any():
        return None
    i = int(np.flatnonzero(far)[0])
    return Coupling(i, rows, float(together[i]), float(single[i]))


def warn_if_coupled(loss_fn: Callable, params: PyTree, microbatch: PyTree) -> None:
    """A `CoupledExamplesWarning` naming `loss_fn` when `find_coupling` finds a coupling."""
    found = find_coupling(loss_fn, params, microbatch)
    if found is None:
        return
    warnings.warn(
        f"accumulate: {_name(loss_fn)} couples the examples of a micro-batch: example "
        f"{found.example}'s loss is {found.in_batch:.4g} in a batch of {found.rows} and "
        f"{found.alone:.4g} alone (probed at synthetic inputs of the micro-batch's shapes). "
        "Accumulation averages micro-batches computed separately, so with such a loss (batch "
        "statistics, as BatchNorm in training mode, or a loss centred on the batch mean) its "
        "gradient is not the full-batch gradient: each micro-batch uses its own statistics, "
        "and a centred loss over micro-batches of one example has gradient 0. Make each "
        "example's loss depend on that example alone (LayerNorm/GroupNorm, BatchNorm with "
        "running statistics, a running mean), or train the full batch without accumulate=. If "
        "per-micro-batch statistics are intended (ghost batch norm), silence this with "
        "warnings.filterwarnings('ignore', category=funcgrad.CoupledExamplesWarning).",
        CoupledExamplesWarning, stacklevel=3)


def _synthetic(like, rng: np.random.Generator, *, fan_in: bool = False) -> jax.Array:
    shape, dtype = tuple(like.shape), jnp.result_type(like)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(0), max(math.prod(shape), 1)).reshape(shape)
    if jnp.issubdtype(dtype, jnp.inexact):
        values = rng.standard_normal(shape)
        if fan_in and len(shape) >= 1 and shape[-1]:
            values = values / math.sqrt(max(math.prod(shape) // shape[-1], 1))
        return jnp.asarray(values, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(np.indices(shape).sum(0) % 2 if shape else 0, dtype)
    if dtype == jnp.bool_:
        return jnp.ones(shape, jnp.bool_)
    return jnp.zeros(shape, dtype)


def _name(fn: Callable) -> str:
    """``loss_fn name (file:line)`` from its code object (through functools.partial)."""
    inner = getattr(fn, "func", fn)
    code = getattr(inner, "__code__", None)
    name = getattr(inner, "__qualname__", type(inner).__name__)
    return (f"loss_fn {name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"
            if code is not None else f"loss_fn {name}")
