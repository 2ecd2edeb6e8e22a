"""fn as the caller runs it (x64 off), built once per function and argument signature.

Private to `funcgrad.check`. The check traces fn with float64 inputs under x64; where fn
depends on the float width (``jax.random.bernoulli(key, 0.5, s)`` draws 32 random bits per
element with x64 off and 64 with it on: another mask), that is another function. `as_run`
traces fn's program in the caller's dtypes and computes its value; `as_the_user_runs_it`
compares it with the check's program and rebuilds the check on the caller's program when they
differ.

The programs (fn's jaxpr in the caller's dtypes, its checked output and its float64-lifted
output, both jitted) are cached, as ``jax.jit`` caches its compilations: per function object
(by identity, held weakly: a closure over other arrays is another object), argument signature
(pytree structure, and each leaf's shape, dtype and weak type) and ``has_aux``, for the
`_MAX_PROGRAMS` most recently used. A repeated check of the same function at arguments of the
same signature then traces and compiles nothing here. As with ``jax.jit``, a global that fn
reads, or a closed-over cell it rebinds, is baked in when it was first traced.
"""
from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import is_float
from funcgrad.check import _cache, _lift
from funcgrad.check import _objective as obj
from funcgrad.check._lift_precision import lift_precision_of

#: Cached programs kept (least recently used first out): each is a few small jaxprs and jitted
#: functions; a pytest suite checks far fewer distinct (function, signature) pairs at once.
_MAX_PROGRAMS = 64


class Programs(NamedTuple):
    """fn's programs as the caller runs it, for one argument signature (`programs_of`).

    program: ``program(*args)``, fn's jaxpr in the dtypes it was traced with (a float64 leaf
      handed over is cast to the traced dtype), outputs in fn's pytree.
    checked: jitted; the checked output (aux dropped), each leaf raveled, in fn's dtypes.
    lifted: jitted, called under x64; the checked output of the same jaxpr with every float
      lifted to float64 (`funcgrad.check._lift`), one float64 vector.
    dtype: the narrowest float the program computes or returns, e.g. "float32".
    """
    program: Callable
    checked: Callable
    lifted: Callable
    dtype: str


class AsRun(NamedTuple):
    """fn as the caller runs it at the check's point: its `Programs` fields and `value`, the
    checked output there (raveled, float64; empty when the output cannot be checked: the
    check's set-up says why)."""
    program: Callable
    value: np.ndarray
    dtype: str
    lifted: Callable


_programs = _cache.LRU(_MAX_PROGRAMS)


def as_run(fn: Callable, args: tuple, has_aux: bool) -> AsRun:
    """`AsRun` of `fn` at `args`, run outside check_grads' float64 scope (x64 off)."""
    programs = programs_of(fn, args, has_aux)
    try:
        with warnings.catch_warnings():  # a second run of fn: what it warns, the check's run warns
            warnings.simplefilter("ignore")
            value = np.concatenate([np.asarray(o, np.float64)
                                    for o in programs.checked(*args)])
    except (TypeError, ValueError):  # an output that cannot be checked: _setup says why
        value = np.zeros(0)
    return AsRun(programs.program, value, programs.dtype, programs.lifted)


def programs_of(fn: Callable, args: tuple, has_aux: bool) -> Programs:
    """fn's `Programs` for the signature of `args`: from the cache, or traced (once) and
    cached. A function that cannot be held weakly, or arguments whose pytree structure cannot
    be hashed, are traced every time."""
    key = (id(fn), bool(has_aux), _cache.signature(tuple(args)))
    if not _cache.hashable(key):
        return _trace(fn, args, has_aux)
    hit = _programs.get(key)
    if hit is not None and hit[0]() is fn:  # (an id is reused only after fn was collected)
        return hit[1]
    programs = _trace(fn, args, has_aux)
    try:
        ref = weakref.ref(fn, functools.partial(_forget, id(fn)))
    except TypeError:  # not weakly referenceable (a builtin): not cached
        return programs
    _programs.put(key, (ref, programs))
    return programs


def _forget(fn_id: int, _ref: weakref.ref) -> None:
    """Drops a collected function's programs (a weakref callback)."""
    _programs.drop(lambda key: key[0] != fn_id)


def _trace(fn: Callable, args: tuple, has_aux: bool) -> Programs:
    """fn's `Programs` at the signature of `args`: one trace of fn, with x64 off."""
    with warnings.catch_warnings():  # a second run of fn: what it warns, the check's run warns
        warnings.simplefilter("ignore")
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr, consts = ji.closed_parts(closed)
    body = ji.as_fun(jaxpr, consts)
    out_tree = jax.tree.structure(out_shape)
    in_dtypes = [v.aval.dtype for v in jaxpr.invars]

    def program(*a):
        # Each floating leaf in the dtype it had when traced: with x64 off a float64 NumPy
        # leaf is float32 there, and the check hands the leaves over in float64.
        leaves = [lax.convert_element_type(x, d) if is_float(d) and jnp.result_type(x) != d
                  else x for x, d in zip(jax.tree.leaves(a), in_dtypes)]
        return jax.tree.unflatten(out_tree, body(*leaves))
    program.__name__ = getattr(fn, "__name__", "fn")
    program.__qualname__ = getattr(fn, "__qualname__", program.__name__)

    def checked(*a):
        out = program(*a)
        out = out[0] if has_aux and isinstance(out, (tuple, list)) else out
        return [jnp.ravel(o) for o in jax.tree.leaves(out)]

    def lifted(*a):  # called under x64: the same program, every float lifted to float64
        outs = _lift.evaluate(jaxpr, consts, jax.tree.leaves(a), _lift.Flags(lift_precision=True))
        out = jax.tree.unflatten(out_tree, outs)
        out = out[0] if has_aux and isinstance(out, (tuple, list)) else out
        return jnp.concatenate([jnp.ravel(o).astype(jnp.float64) for o in jax.tree.leaves(out)])

    floats = [str(v.aval.dtype) for e in jaxpr.eqns for v in e.outvars
              if jnp.issubdtype(getattr(v.aval, "dtype", np.int32), jnp.floating)]
    floats += [str(jnp.result_type(o)) for o in jax.tree.leaves(out_shape)
               if jnp.issubdtype(o.dtype, jnp.floating)]
    dtype = min(floats, key=lambda d: jnp.finfo(d).bits) if floats else "float64"
    return Programs(program, jax.jit(checked), jax.jit(lifted), dtype)


@functools.partial(jax.jit, static_argnames="spec")
def _primal_kernel(spec, theta, leaves):
    flags = _lift.Flags(lift_precision=spec.lift_precision)
    value = _lift.transform(lambda t: obj.output_vector(spec, t, leaves), flags)
    return value(theta).astype(jnp.float64)


def primal(prob) -> np.ndarray:
    """The checked output of the check's own program at its point (lifted or not), float64;
    compiled once per spec (`_primal_kernel`)."""
    return np.asarray(_primal_kernel(prob["spec"], prob["theta"], prob["leaves"]), np.float64)


def _agree(got: np.ndarray, want: np.ndarray, dtype: str) -> tuple[bool, float]:
    """Whether the check's program computes the user's value to `dtype`'s precision (relative
    error of the output vector under sqrt(eps): float32 3.5e-4, bfloat16 0.088, float16
    0.031); the relative error."""
    if got.shape != want.shape or not want.size:
        return got.shape == want.shape, 0.0
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite):  # non-finite elsewhere: another function
        return False, math.inf
    got, want = got[finite], want[finite]  # (a non-finite output is reported by the check)
    scale = float(np.linalg.norm(want))
    err = float(np.linalg.norm(got - want))
    rel = err / scale if scale > 0 else err
    return rel <= math.sqrt(float(jnp.finfo(dtype).eps)) or err <= 1e-12, rel


def as_the_user_runs_it(prob: dict, as_run: AsRun, lift: bool, modes, tolerances: Callable,
                        rebuild: Callable) -> dict:
    """`prob` unchanged when the check's program computes fn's value as the caller runs it;
    otherwise the check rebuilt on the program traced as the caller runs it (its random
    draws, its dtypes), lifted to float64 when the lifted program still computes that value,
    else checked as computed; a note says which and why.

    `tolerances(dtype) -> (rtol, atol)`; `rebuild(program) -> prob` sets the check up again on
    `program`. Raises `funcgrad.JaxInternalsError` when a JAX internal is missing."""
    if not as_run.value.size:
        return prob
    # The check's float64 program against the user's program lifted to float64: the same
    # arithmetic when fn does not depend on the float width (they differ by the user's
    # float32 literals, ~1e-8), another function when it does (a mask drawn from 64 bits):
    # compared in float64, so an ill-conditioned op's float32 rounding cannot trigger this.
    try:
        lifted_user = np.asarray(as_run.lifted(*prob["args"]), np.float64)
        lifted_check = primal(dict(prob, spec=prob["spec"]._replace(lift_precision=True)))
        same, rel = _agree(lifted_check, lifted_user, "float32")
    except ji.JaxInternalsError:
        raise
    except Exception:  # noqa: BLE001 - a program that cannot be lifted: compare as computed
        same, rel = _agree(primal(prob), as_run.value, as_run.dtype)
    if same:
        return prob
    why = (f"traced with float64 inputs (as the check computes), fn's value differs from "
           f"that of fn's program as you run it, lifted to float64, by {rel:.3g} relative: "
           f"fn depends on the float width (a random draw or a dtype default, e.g. "
           "jax.random.bernoulli(key, 0.5, ...) draws another mask)")
    rebuilt = lift_precision_of(rebuild(as_run.program), lift, modes,
                                tolerances(as_run.dtype))
    if rebuilt["lifted_from"]:
        same, rel2 = _agree(primal(rebuilt), as_run.value, as_run.dtype)
        if same:
            return dict(rebuilt, notes=[f"{why}; the check used fn's program as you run it, "
                                        f"lifted to float64 (its value agrees to {rel2:.2g}).",
                                        *rebuilt["notes"]])
        why += (f"; lifted to float64 that program's value moves by {rel2:.3g} relative, so "
                "it was checked as computed")
        rebuilt = lift_precision_of(rebuild(as_run.program), False, modes,
                                    tolerances(as_run.dtype))
    low = rebuilt["dtype_used"]
    rtol, atol = tolerances(low)
    notes = [n for n in rebuilt["notes"] if not n.startswith("fn computes in")]
    return dict(rebuilt, weaker=f"checked in {low}, not float64: {why}" if low != "float64"
                else None, notes=[f"{why}; the check used fn's program as you run it, at "
                                  f"{low}'s tolerances (errors below {atol:g} + "
                                  f"{rtol:g}·|derivative| pass unseen).", *notes])

