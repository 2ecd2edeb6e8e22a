"""Coupled examples: whether one example's loss depends on the other examples of its batch.

Accumulation (`funcgrad.train.accumulate`) equals the full-batch gradient only when each example's
loss depends on that example alone: ``loss_fn(params, batch)[i]`` must not change when the other
examples of `batch` change (then it is the same in any micro-batch). A loss centred on the batch
mean, or BatchNorm in training mode (mean and variance over the batch axis), breaks that: each
micro-batch then uses its own statistics, and a centred loss over micro-batches of one example has
gradient 0.

`find_coupling` tests that condition once, when an accumulating computation is traced. It
evaluates the loss on a probe batch of P rows (P = m clipped to 3 .. 8), then on the same
batch with every row but i replaced, for i the first and the last row, and reports an example
whose loss moved by more than `RTOL` of the largest |loss|. The batch keeps its size and each
example its position, so a loss that depends on those alone (dropout drawn from one key for the
whole batch) is not flagged. The probe runs on synthetic values of the micro-batch's and the
params' shapes and dtypes (under ``jax.jit`` the real values are not known at trace time):
floating leaves are standard normal, params scaled by 1/sqrt(fan-in) (the leaf's size over its
last axis) so activations stay O(1); integer leaves are 1 where the sum of the element's indices
is a multiple of 3, else 0 (valid labels and token ids for any 2 classes, any integer dtype);
booleans are True (a padding mask with every token valid); PRNG keys are distinct. The
replaced rows differ from the probe's in every element, and in their sums: fresh floats and
keys, integers and booleans flipped (1 - v: a third of the elements are 1 in the probe, two
thirds in the replaced rows; booleans all False), so a dependence on the others' values, on
their count of valid tokens or on which of them equal example i is seen. It costs three
forward passes of at most 8 examples, once per trace, and no host round-trip in the compiled
step. A loss that cannot run on the probe (a batch size hard-coded
in it) or gives non-finite losses there is not judged.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad import _user_line

PyTree = Any

#: Example i's loss "moved" when |a - b| > RTOL * max |loss| (or 32 float eps of the loss's
#: dtype, if larger): with the batch's shape unchanged an uncoupled loss gives the same bits;
#: a coupled one moves at O(1) relative.
RTOL = 1e-3


class CoupledExamplesWarning(UserWarning):
    """An accumulated loss couples the examples of a micro-batch (see `funcgrad.train.coupling`)."""


@dataclasses.dataclass(frozen=True)
class Coupling:
    """One example whose loss changes when only the other examples of its batch change.

    Attributes:
      example: the row i of the probe batch (0-based).
      rows: P, the probe batch's size.
      loss: ``loss_fn(params, probe)[i]``, as a float.
      loss_others_changed: ``loss_fn(params, probe2)[i]``, as a float, where `probe2` equals
        `probe` in row i and differs in every other row.
    """
    example: int
    rows: int
    loss: float
    loss_others_changed: float


def find_coupling(loss_fn: Callable[[PyTree, PyTree], jax.Array], params: PyTree,
                  microbatch: PyTree) -> Coupling | None:
    """Returns an example whose loss changes when the other examples of its batch change, or None.

    Safe to call while tracing (inside ``jax.jit`` or ``lax.scan``): only the shapes and dtypes
    of `params` and `microbatch` are used, and the probe runs on concrete synthetic values (see
    the module docstring), under ``jax.ensure_compile_time_eval``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> losses`` of shape ``(rows,)``, one per example.
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``s (values are not read).
      microbatch: a pytree whose leaves have shape ``(m, ...)``; values are not read.
    Returns:
      a `Coupling`, or None when the first and the last example's losses do not move with the
      other examples, or when the probe could not run or gave non-finite losses (then nothing
      is claimed).
    """
    m = jnp.shape(jax.tree.leaves(microbatch)[0])[0]
    rows = min(max(m, 3), 8)
    rng = np.random.default_rng(0)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows, *jnp.shape(a)[1:]),
                                                         jnp.result_type(a)), microbatch)
    try:  # under a trace even constants are staged, unless evaluated at compile time
        with jax.ensure_compile_time_eval(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the user's own warnings come from the real trace
            probe_params = jax.tree.map(lambda a: _synthetic(a, rng, fan_in=True), params)
            probe = jax.tree.map(lambda a: _synthetic(a, rng), shapes)
            others = jax.tree.map(lambda a: _synthetic(a, rng, other=True), shapes)
            # One compiled program for the three evaluations (op-by-op, each primitive would
            # compile on its own the first time: seconds for a small MLP).
            # jit(loss_fn) is cached on loss_fn: a later probe of the same loss and shapes
            # reuses the program.
            evaluate = jax.jit(loss_fn)
            dtype = jnp.result_type(evaluate(probe_params, probe))
            losses = lambda batch: np.asarray(
                jnp.asarray(evaluate(probe_params, batch), jnp.float32), np.float64)
            base = losses(probe)
            # example i kept, every other example changed
            found = [(i, losses(_keep(probe, others, i))) for i in (0, rows - 1)]
    except Exception:  # noqa: BLE001 -- a loss the probe cannot run is not judged
        return None
    eps = float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0
    for i, moved in found:
        if base.shape != (rows,) or moved.shape != (rows,):
            return None
        a, b = base[i], moved[i]
        if not (np.isfinite(a) and np.isfinite(b)):
            continue
        scale = max(np.abs(base[np.isfinite(base)]).max(), abs(b), 1e-30)
        if abs(a - b) > max(RTOL, 32 * eps) * scale:
            return Coupling(i, rows, float(a), float(b))
    return None


@jax.jit
def _keep(probe: PyTree, others: PyTree, i: jax.Array) -> PyTree:
    """`others` with row i of `probe`."""
    return jax.tree.map(lambda a, b: b.at[i].set(a[i]), probe, others)


def warn_if_coupled(loss_fn: Callable, params: PyTree, microbatch: PyTree) -> None:
    """A `CoupledExamplesWarning` naming `loss_fn` (the user's function, through funcgrad's
    wrappers) when `find_coupling` finds a coupling, reported at the user's line that called
    the accumulation (`funcgrad._user_line`), whatever jit or scan lies in between."""
    found = find_coupling(loss_fn, params, microbatch)
    if found is None:
        return
    _user_line.warn(
        f"accumulate: {_name(loss_fn)} couples the examples of a micro-batch: in a probe batch "
        f"of {found.rows}, example {found.example}'s loss is {found.loss:.4g}, and "
        f"{found.loss_others_changed:.4g} when only the other examples change (probed at "
        "synthetic inputs of the micro-batch's shapes). "
        "Accumulation averages micro-batches computed separately, so with such a loss (batch "
        "statistics, as BatchNorm in training mode, or a loss centred on the batch mean) its "
        "gradient is not the full-batch gradient: each micro-batch uses its own statistics, "
        "and a centred loss over micro-batches of one example has gradient 0. Make each "
        "example's loss depend on that example alone (LayerNorm/GroupNorm, BatchNorm with "
        "running statistics, a running mean), or train the full batch without accumulate=. If "
        "per-micro-batch statistics are intended (ghost batch norm), silence this with "
        "warnings.filterwarnings('ignore', category=funcgrad.CoupledExamplesWarning).",
        CoupledExamplesWarning)


def _synthetic(like, rng: np.random.Generator, *, fan_in: bool = False,
               other: bool = False) -> jax.Array:
    """Probe values of `like`'s shape and dtype (module docstring); `other`: the values of the
    replaced rows, different from the probe's in every element: other floats and keys,
    integers and booleans flipped."""
    shape, dtype = tuple(jnp.shape(like)), jnp.result_type(like)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        impl = getattr(dtype, "_impl", None)  # the key's PRNG implementation (threefry, rbg)
        keys = jax.random.split(jax.random.key(int(other), impl=impl), max(math.prod(shape), 1))
        return keys[:math.prod(shape)].reshape(shape)
    if jnp.issubdtype(dtype, jnp.inexact):
        values = rng.standard_normal(shape)
        if fan_in and len(shape) >= 1 and shape[-1]:
            values = values / math.sqrt(max(math.prod(shape) // shape[-1], 1))
        return jnp.asarray(values, dtype)
    # 0/1 with a third of ones (not a checkerboard: flipping one keeps each row's count of ones)
    ones = (np.indices(shape).sum(0) if shape else np.int64(0)) % 3 == 0
    if dtype == jnp.bool_:
        return jnp.full(shape, not other, jnp.bool_)
    return jnp.asarray(ones != other, dtype)  # integers, and any other dtype that takes 0/1


def _name(fn: Callable) -> str:
    """``loss_fn name (file:line)`` of the user's function: through functools.partial and
    wrappers that set ``__wrapped__`` (functools.wraps: the train step's, jax.jit's)."""
    inner = fn
    while True:
        unwrapped = inspect.unwrap(inner)
        unwrapped = unwrapped.func if isinstance(unwrapped, functools.partial) else unwrapped
        if unwrapped is inner:
            break
        inner = unwrapped
    code = getattr(inner, "__code__", None)
    name = getattr(inner, "__qualname__", type(inner).__name__)
    return (f"loss_fn {name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"
            if code is not None else f"loss_fn {name}")
