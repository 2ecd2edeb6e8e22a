"""Which differentiated leaves each value of a program depends on, and through what kind of path:
differentiable, cut by ``stop_gradient``, or cut by an op whose derivative is zero (shared by
`funcgrad.explain_grads` and the checked `funcgrad.custom_vjp`; private).

A forward dependence analysis of a jaxpr: each input carries ``{leaf: Path}``, the best kind of
path from that leaf (DIFF > STOP > ZERO) and where it was cut (the primitive and its source
line); calls (jit, checkpoint, custom rules' primal programs) are entered, ``scan`` runs to a
fixpoint over its carry, ``cond`` merges its branches and cuts at its index.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import source_line

#: Primitives with a floating output whose derivative is zero wherever it is defined. Any
#: primitive with an integer or boolean output (comparisons, argmax, casts to int, ...) cuts the
#: derivative as well, by its dtype.
ZERO_DERIVATIVE_PRIMITIVES = frozenset({"round", "floor", "ceil", "sign", "is_finite",
                                        "nextafter", "stop_gradient"})

DIFF, STOP, ZERO = 3, 2, 1  # kinds of path from a leaf, best first


class Path(NamedTuple):
    kind: int
    where: str  # the primitive and line that cut the path ("" for a differentiable path)


def merge(*deps: dict[int, Path]) -> dict[int, Path]:
    out: dict[int, Path] = {}
    for d in deps:
        for leaf, path in d.items():
            if leaf not in out or path.kind > out[leaf].kind:
                out[leaf] = path
    return out


def cut(deps: dict[int, Path], kind: int, where: str) -> dict[int, Path]:
    return {leaf: (p if p.kind <= kind else Path(kind, where)) for leaf, p in deps.items()}


def flow(jaxpr, in_deps: list[dict[int, Path]], where: str = "",
          drops: dict | None = None) -> list[dict[int, Path]]:
    """For each output of `jaxpr`, the leaves it depends on and the best kind of path.

    `drops` (from `funcgrad.debug._custom_rules.dropped_inputs`): custom_vjp calls whose rule drops
    the cotangent of some inputs; a path through such an input is cut there (ZERO)."""
    env: dict[Any, dict[int, Path]] = {}
    for var, deps in zip(jaxpr.invars, in_deps):
        env[var] = deps

    def read(v):
        return {} if ji.is_literal(v) else env.get(v, {})

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if drops and id(eqn) in drops:
            ins = [cut(d, ZERO, drops[id(eqn)][k]) if k in drops[id(eqn)] else d
                   for k, d in enumerate(ins)]
        for var, deps in zip(eqn.outvars, transfer(eqn, ins, source_line(eqn) or where,
                                                    drops)):
            env[var] = deps
    return [read(v) for v in jaxpr.outvars]


def transfer(eqn, ins, where, drops=None):
    name, kind = ji.name(eqn), ji.kind(eqn)
    at = f"{name} at {where}" if where else name
    called = ji.body(eqn)  # jit, checkpoint, and a custom rule's primal program
    if called is not None:
        sub, consts = called
        n = len(sub.invars)
        return flow(sub, ins[len(ins) - n:], where, drops)
    if kind == "scan":
        s = ji.scan(eqn)
        nc, nk = s.num_consts, s.num_carry
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        while True:  # fixpoint over the carry; kinds only grow, so this ends
            outs = flow(s.body, [*consts, *carry, *xs], where, drops)
            new = [merge(c, o) for c, o in zip(carry, outs[:nk])]
            if new == carry:
                return outs[:nk] + outs[nk:]
            carry = new
    if kind == "cond":
        index = cut(ins[0], ZERO, f"the branch index of cond at {where}")
        branches = [flow(b, ins[1:], where, drops) for b, _ in ji.cond_branches(eqn)]
        return [merge(index, *outs) for outs in zip(*branches)]
    merged = merge(*ins)
    if kind == "stop_gradient":
        return [cut(merged, STOP, at)]
    outs = []
    for var in eqn.outvars:
        dtype = getattr(var.aval, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            detail = f"{name} (to {dtype}) at {where}" if name == "convert_element_type" else at
            outs.append(cut(merged, ZERO, f"{detail}, whose output is {dtype}"))
        elif name in ZERO_DERIVATIVE_PRIMITIVES:
            outs.append(cut(merged, ZERO, at))
        else:
            outs.append(merged)
    return outs
