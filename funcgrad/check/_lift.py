"""The gradient check's jaxpr interpreter: a program evaluated again, changed in ways that
finite differences need (private to `funcgrad.check`).

Three changes, any combination (`Flags`):

* ``see_through_stop_gradient``: stop_gradient becomes the identity (finite differences see
  through it), so "zero because of stop_gradient" can be told from a wrong gradient. A
  stop_gradient inside a custom rule stays in force: the rule is what gets checked.
* ``lift_precision``: every float narrower than float64 becomes float64 (complex64 becomes
  complex128): casts to bfloat16/float16/float32 cast to float64, each equation's floating
  inputs are cast up before it is bound, dtype parameters (``preferred_element_type``,
  ``new_dtype``, ``dtype``) are widened, ``reduce_precision`` is the identity, and the bodies of
  calls, remat, scan, cond and while_loop are rebuilt the same way (their floating outputs cast
  up, so carries keep one dtype). custom_jvp / custom_vjp functions are rebuilt around lifted
  evaluations of their primal, their jvp or fwd jaxpr, and a trace of their bwd at the
  float64 residuals, so a custom rule is checked in float64 too. What cannot be lifted runs at
  its own dtypes: a bitcast, a host callback, a primitive with a jaxpr parameter not listed
  here; the check finds such a value on the differentiated path and falls back.
* ``inline_custom_rules``: custom_jvp / custom_vjp calls are replaced by their primal
  program, which JAX then differentiates with its own rules: the reference for a custom
  rule's value at a tie or kink (JAX's convention there).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import interpret, is_float


class Flags(NamedTuple):
    see_through_stop_gradient: bool = False
    lift_precision: bool = False
    inline_custom_rules: bool = False


def transform(f: Callable, flags: Flags) -> Callable:
    """``f`` (one array in, one scalar out) evaluated through its jaxpr with `flags`."""
    if not any(flags):
        return f

    def wrapped(theta):
        closed = jax.make_jaxpr(f)(theta)
        return evaluate(closed.jaxpr, closed.consts, [theta], flags)[0]
    return wrapped


def has_custom_rule(jaxpr) -> bool:
    """Whether a (closed) jaxpr calls a custom_jvp or custom_vjp function, at any depth."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if ji.kind(eqn) in ji.CUSTOM_KINDS:
            return True
        if any(has_custom_rule(sub) for _, sub, _ in ji.sub_jaxprs(eqn)):
            return True
    return False


# --- dtypes ---------------------------------------------------------------------------------

def _wide(dtype):
    """float64 for a real float, complex128 for a complex one; other dtypes as they are."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(np.complex128)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.float64)
    return dtype


def _dtype(x):
    dtype = getattr(x, "dtype", None)  # (not `or`: a NumPy dtype's truth value is its length)
    return jnp.result_type(x) if dtype is None else dtype


def _up(x):
    """x cast to its wide dtype when it is a narrower float (any value, tracer or literal)."""
    dtype = _dtype(x)
    if not is_float(dtype) or _wide(dtype) == dtype:
        return x
    return jax.lax.convert_element_type(x, _wide(dtype))


def _as(x, dtype):
    """x cast back to `dtype` (an equation's own input dtype) when it is floating."""
    if is_float(_dtype(x)) and _dtype(x) != dtype:
        return jax.lax.convert_element_type(x, dtype)
    return x


# --- the interpreter ------------------------------------------------------------------------

#: Their dtype parameters are widened with their inputs: the output dtype follows.
_DTYPE_PARAMS = ("new_dtype", "dtype", "preferred_element_type")


def evaluate(jaxpr, consts, args, flags: Flags) -> list:
    """The outputs of `jaxpr` at `args` with the changes `flags` asks for (see the module)."""
    def rule(eqn, ins):
        kind = ji.kind(eqn)
        if kind == "stop_gradient" and flags.see_through_stop_gradient:
            return ins
        if kind in ji.CALL_KINDS:
            return evaluate(*ji.call_body(eqn), ins, flags)
        if kind in _LOOPS:
            return _LOOPS[kind](eqn, [_up(x) for x in ins] if flags.lift_precision else ins,
                                flags)
        if kind in _CUSTOM:
            return _CUSTOM[kind](eqn, ins, flags)
        return _lifted_bind(eqn, ins) if flags.lift_precision else None
    outs = interpret(jaxpr, consts, args, rule)
    return [_up(o) for o in outs] if flags.lift_precision else outs


def _lifted_bind(eqn, ins):
    name = ji.name(eqn)
    if name == "reduce_precision":
        return [_up(ins[0])]
    p = ji.params(eqn)
    if name == "bitcast_convert_type" or "callback" in name or (
            any(ji.sub_jaxprs(eqn)) and "update_jaxpr" not in p):
        # Bits and host code see the dtypes they were written for; an unknown higher-order
        # primitive too. Its floating outputs stay narrow: the check sees them and falls back.
        return ji.bind(eqn, [_as(x, v.aval.dtype) for x, v in zip(ins, eqn.invars)])
    changed = {key: _wide(p[key]) for key in _DTYPE_PARAMS
               if p.get(key) is not None and is_float(p[key])}
    if p.get("update_jaxpr") is not None:  # scatter: its combiner, lifted
        combiner, combiner_consts = ji.closed_parts(p["update_jaxpr"])
        combiner_consts = p.get("update_consts", None) or combiner_consts
        scalars = [jax.ShapeDtypeStruct((), _wide(v.aval.dtype)) for v in combiner.invars]
        lifted = jax.make_jaxpr(lambda *a: evaluate(combiner, combiner_consts, list(a),
                                                    Flags(lift_precision=True)))(*scalars)
        changed.update(ji.scatter_combiner(eqn, lifted))
    return ji.bind_with(eqn, [_up(x) for x in ins], **changed)


def _closed_fn(closed, flags):
    """A Python function evaluating a ClosedJaxpr with `flags`."""
    jaxpr, consts = closed
    return lambda *args: evaluate(jaxpr, consts, list(args), flags)


def _scan(eqn, ins, flags):
    s = ji.scan(eqn)
    nc, nk = s.num_consts, s.num_carry
    body = _closed_fn((s.body, s.body_consts), flags)
    consts = ins[:nc]

    def step(carry, xs):
        outs = body(*consts, *carry, *xs)
        return outs[:nk], outs[nk:]
    carry, ys = jax.lax.scan(step, list(ins[nc:nc + nk]), list(ins[nc + nk:]),
                             length=s.length, reverse=s.reverse, unroll=s.unroll)
    return [*carry, *ys]


def _cond(eqn, ins, flags):
    branches = [_closed_fn(b, flags) for b in ji.cond_branches(eqn)]
    return jax.lax.switch(ins[0], branches, *ins[1:])


def _while(eqn, ins, flags):
    w = ji.while_loop(eqn)
    cn, bn = w.cond_nconsts, w.body_nconsts
    cond = _closed_fn((w.cond, w.cond_consts), flags)
    body = _closed_fn((w.body, w.body_consts), flags)
    cond_consts, body_consts = ins[:cn], ins[cn:cn + bn]
    return jax.lax.while_loop(lambda c: cond(*cond_consts, *c)[0],
                              lambda c: body(*body_consts, *c), list(ins[cn + bn:]))


_LOOPS = {"scan": _scan, "cond": _cond, "while": _while}


# --- custom rules: inlined, or rebuilt lifted -----------------------------------------------

def _custom_jvp(eqn, ins, flags):
    call, call_consts = ji.call_body(eqn)
    if flags.inline_custom_rules:
        return evaluate(call, call_consts, ins, flags)
    if not flags.lift_precision:
        return None  # bound as it is
    rule = ji.custom_jvp(eqn)
    rule_flags, ins, nc, consts, floats = _lifted_rule_inputs(eqn, ins, rule.num_consts)

    @jax.custom_jvp
    def fn(*xs):
        return evaluate(call, call_consts, [*consts, *xs], rule_flags)

    def fn_jvp(xs, ts):
        # JAX's own jvp_jaxpr_fun traces the user's rule at the original dtypes; tangents of
        # non-float inputs are symbolic zeros (the rule never sees them).
        jaxpr, jvp_consts, out_zeros = rule.jvp_jaxpr_fun.call_wrapped(*[not f for f in floats])
        jaxpr, jvp_consts = ji.attach_consts(jaxpr, jvp_consts)
        out = evaluate(jaxpr, jvp_consts, [*xs, *(t for t, f in zip(ts, floats) if f)],
                       rule_flags)
        primals, nonzero = out[:len(out_zeros)], iter(out[len(out_zeros):])
        return primals, [_zero_tangent(o) if z else next(nonzero)
                         for o, z in zip(primals, out_zeros)]

    fn.defjvp(fn_jvp)
    return list(fn(*ins[nc:]))


def _lifted_rule_inputs(eqn, ins, nc):
    """What a lifted custom rule needs: its flags (lifting only: a stop_gradient inside the
    rule stays), its inputs in float64, the number of consts, the consts, and which of the
    other inputs are floating (they take tangents/cotangents)."""
    ins = [_up(x) for x in ins]
    floats = [is_float(v.aval.dtype) for v in eqn.invars[nc:]]
    return Flags(lift_precision=True), ins, nc, ins[:nc], floats


def _zero_tangent(x):
    if is_float(_dtype(x)):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _custom_vjp(eqn, ins, flags):
    call, call_consts = ji.call_body(eqn)
    if flags.inline_custom_rules:
        return evaluate(call, call_consts, ins, flags)
    if not flags.lift_precision:
        return None  # bound as it is
    rule = ji.custom_vjp(eqn)
    rule_flags, ins, nc, consts, floats = _lifted_rule_inputs(eqn, ins, rule.num_consts)

    @jax.custom_vjp
    def fn(*xs):
        return evaluate(call, call_consts, [*consts, *xs], rule_flags)

    res_avals: list = []  # the residuals' own (unlifted) shapes and dtypes, set by fn_fwd

    def fn_fwd(*xs):
        jaxpr, fwd_consts = ji.attach_consts(*rule.fwd_jaxpr_thunk.call_wrapped(*floats))
        out = evaluate(jaxpr, fwd_consts, list(xs), rule_flags)
        # Residuals that are inputs were pruned from fwd's outputs: `forwards` says which
        # (indices into the equation's inputs, consts first).
        n_res, forwards = rule.residual_layout()
        pruned, everything = iter(out[:n_res]), [*consts, *xs]
        own = iter(v.aval for v in jaxpr.outvars[:n_res])
        res_avals[:] = [next(own) if f is None else eqn.invars[f].aval for f in forwards]
        return out[n_res:], [next(pruned) if f is None else everything[f] for f in forwards]

    def fn_bwd(res, cts):
        # The user's bwd, traced at the float64 residuals and cotangents (its Python float
        # literals kept in float64) and evaluated lifted, so a cast to bfloat16 inside it is
        # lifted as well. A bwd that only takes its own dtypes (a jax.vjp closure among the
        # residuals, as funcgrad's remat keeps: it checks the cotangent's dtype) is traced at
        # those and evaluated lifted the same way.
        def flat_bwd(*args):
            return [_materialize(c) for c in rule.call_bwd(len(floats), *args)]
        try:
            traced = jax.make_jaxpr(flat_bwd)(*res, *cts)
        except (TypeError, ValueError):
            avals = [*res_avals, *(v.aval for v in eqn.outvars)]
            traced = jax.make_jaxpr(flat_bwd)(*(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                                for a in avals))
        out = evaluate(traced.jaxpr, traced.consts, [*res, *cts], rule_flags)
        return tuple(o if f else None for o, f in zip(out, floats))

    fn.defvjp(fn_fwd, fn_bwd)
    return list(fn(*ins[nc:]))


def _materialize(ct: Any):
    """A cotangent the flattened bwd returned: an array, or JAX's symbolic Zero (for a None)."""
    if isinstance(ct, (jax.Array, np.ndarray, np.generic, float, int)):
        return ct
    aval = ct.aval
    return jnp.zeros(aval.shape, _wide(aval.dtype) if is_float(aval.dtype) else np.float64)


_CUSTOM = {"custom_jvp": _custom_jvp, "custom_vjp": _custom_vjp}
