"""The scalar objective a gradient check differentiates: a user function seen as R^n -> R.

Private to `funcgrad.check`. The differentiated leaves are flattened into one float64 vector
``theta``; the function's output is reduced to a scalar by a fixed random cotangent when it is
not a scalar (so the check compares uᵀJ, a vector-Jacobian product, with its finite difference);
order k > 1 checks the gradient of ``<u_k, grad of order k-1>`` (Hessian-vector products).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from funcgrad._jaxpr import closed_parts, interpret


class Spec(NamedTuple):
    """Everything static about the objective; hashable, so compiled checks are cached per spec."""
    fn: Callable
    has_aux: bool
    treedef: Any                      # of the whole args tuple
    diff_positions: tuple[int, ...]   # flat positions (in the args' leaves) that theta feeds
    shapes: tuple[tuple[int, ...], ...]
    order: int
    scalar_output: bool
    see_through_stop_gradient: bool = False


def split(spec: Spec, theta: jax.Array) -> list[jax.Array]:
    """theta cut into the differentiated leaves, each reshaped to its leaf's shape."""
    sizes = [math.prod(s) for s in spec.shapes]
    pieces = jnp.split(theta, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [theta]
    return [p.reshape(shape) for p, shape in zip(pieces, spec.shapes)]


def unflatten(spec: Spec, theta: jax.Array, leaves: tuple) -> tuple:
    """The args tuple with theta's pieces put in place of the differentiated leaves."""
    return _args(spec, split(spec, theta), leaves)


def _args(spec: Spec, pieces: list, leaves: tuple) -> tuple:
    leaves = list(leaves)
    for pos, piece in zip(spec.diff_positions, pieces):
        leaves[pos] = piece
    return jax.tree.unflatten(spec.treedef, leaves)


def output_vector(spec: Spec, theta: jax.Array, leaves: tuple) -> jax.Array:
    """The function's output at theta, all output leaves raveled into one vector (its dtype kept)."""
    return _output(spec, _args(spec, split(spec, theta), leaves))


def _output(spec: Spec, args: tuple) -> jax.Array:
    out = spec.fn(*args)
    if spec.has_aux:
        out = out[0]
    flat = [jnp.ravel(o) for o in jax.tree.leaves(out)]
    return jnp.concatenate(flat) if len(flat) > 1 else flat[0]


def objective(spec: Spec, theta: jax.Array, leaves: tuple, cotangents: tuple) -> jax.Array:
    """phi_order(theta): a scalar, float64 (computed in the function's own precision).

    cotangents[0] reduces a non-scalar output (unused for a scalar output); cotangents[k-1]
    (shape (n,)) reduces the order-(k-1) gradient for order k.
    """
    def phi1(t):
        y = output_vector(spec, t, leaves).astype(t.dtype)
        return y[0] if spec.scalar_output else jnp.dot(cotangents[0], y)

    phi = _without_stop_gradient(phi1) if spec.see_through_stop_gradient else phi1
    for k in range(1, spec.order):
        phi = _reduce_grad(phi, cotangents[k])
    return phi(theta)


def _reduce_grad(phi, u):
    return lambda t: jnp.dot(u, jax.grad(phi)(t))


# --- stop_gradient made transparent -------------------------------------------------------
# Finite differences see through stop_gradient; to tell "zero because of stop_gradient" from a
# wrong gradient, the check can differentiate the same program with stop_gradient replaced by
# the identity. Calls (jit) and remat are entered, and scan, cond and while_loop are rebuilt
# around bodies evaluated the same way; custom_jvp/custom_vjp rules are bound as they are, so
# a stop_gradient inside a custom rule stays in force (the rule is what gets checked).

_CALL_PRIMITIVES = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                    "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
                    "remat2": "jaxpr"}


def has_stop_gradient(jaxpr) -> bool:
    """Whether a (closed) jaxpr holds a stop_gradient, entering nested calls."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "stop_gradient":
            return True
        for sub in _param_jaxprs(eqn):
            if has_stop_gradient(sub):
                return True
    return False


def _param_jaxprs(eqn):
    for value in eqn.params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                yield v


def _without_stop_gradient(f):
    def wrapped(theta):
        closed = jax.make_jaxpr(f)(theta)
        return _eval(closed.jaxpr, closed.consts, theta)[0]
    return wrapped


def _eval(jaxpr, consts, *args):
    def rule(eqn, ins):
        name = eqn.primitive.name
        if name == "stop_gradient":
            return ins
        if name in _CALL_PRIMITIVES and _CALL_PRIMITIVES[name] in eqn.params:
            return _eval(*closed_parts(eqn.params[_CALL_PRIMITIVES[name]]), *ins)
        if name in _LOOPS:
            return _LOOPS[name](eqn.params, ins)
        return None
    return interpret(jaxpr, consts, args, rule)


def _closed_fn(closed):
    """A Python function evaluating a ClosedJaxpr with stop_gradient made transparent."""
    jaxpr, consts = closed_parts(closed)
    return lambda *args: _eval(jaxpr, consts, *args)


def _scan(p, ins):
    nc, nk = p["num_consts"], p["num_carry"]
    body = _closed_fn(p["jaxpr"])
    consts = ins[:nc]

    def step(carry, xs):
        outs = body(*consts, *carry, *xs)
        return outs[:nk], outs[nk:]
    carry, ys = jax.lax.scan(step, list(ins[nc:nc + nk]), list(ins[nc + nk:]),
                             length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _cond(p, ins):
    branches = [_closed_fn(b) for b in p["branches"]]
    return jax.lax.switch(ins[0], branches, *ins[1:])


def _while(p, ins):
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = _closed_fn(p["cond_jaxpr"]), _closed_fn(p["body_jaxpr"])
    cond_consts, body_consts = ins[:cn], ins[cn:cn + bn]
    return jax.lax.while_loop(lambda c: cond(*cond_consts, *c)[0],
                              lambda c: body(*body_consts, *c), list(ins[cn + bn:]))


_LOOPS = {"scan": _scan, "cond": _cond, "while": _while}
