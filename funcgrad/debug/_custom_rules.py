"""Custom VJP rules that drop a cotangent, found by probing each rule's pullback (private to
`funcgrad.debug`).

Used by `funcgrad.debug.diagnose`: a ``custom_vjp`` rule whose ``bwd`` returns None (or zeros that
do not depend on the output cotangent) for a floating input that the function's output depends
on cuts every gradient upstream of that input. `explain_grads` names the rule as the blocker.
"""
from __future__ import annotations

import inspect
import os

import jax

from funcgrad import _jax_internals as ji
from funcgrad._dependence import DIFF, Path, flow
from funcgrad._jaxpr import bind, is_float, source_line, sub_jaxprs


def dropped_inputs(jaxpr) -> dict[int, dict[int, str]]:
    """``{id(eqn): {input position: why}}`` for every ``custom_vjp_call`` in `jaxpr` (nested
    ones included) whose pullback gives an input a cotangent that does not depend on the
    output cotangent, although the function's output depends on that input (read with the
    dependence analysis of `funcgrad._dependence`)."""
    found: dict[int, dict[int, str]] = {}
    _walk(jaxpr, found, "")
    return found


def _walk(jaxpr, found, where):
    for eqn in jaxpr.eqns:
        here = source_line(eqn) or where
        if ji.kind(eqn) == "custom_vjp" and id(eqn) not in found:
            drops = _probe(eqn, here)
            if drops:
                found[id(eqn)] = drops
        for _, sub, _ in sub_jaxprs(eqn):
            _walk(sub, found, here)


def _probe(eqn, where) -> dict[int, str]:
    """The inputs of one ``custom_vjp_call`` whose cotangent ignores the output cotangent."""
    ins = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    outs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
    floats = [k for k, v in enumerate(eqn.invars) if is_float(v.aval.dtype)]
    if not floats or not all(is_float(v.aval.dtype) for v in eqn.outvars):
        return {}

    def pullback(xs, gs):
        _, pull = jax.vjp(lambda *a: bind(eqn, list(a)), *xs)
        return pull(list(gs))

    try:
        closed = jax.make_jaxpr(pullback)(ins, outs)
    except Exception:  # noqa: BLE001 - a rule that cannot be traced abstractly: no verdict
        return {}
    n_in = len(ins)
    diff_path = Path(DIFF, "")
    seeds: list[dict] = [{} for _ in range(n_in)] + [{0: diff_path} for _ in outs]
    cts = flow(closed.jaxpr, seeds)
    sub, _ = ji.call_body(eqn)
    primal = flow(sub, [{k: diff_path} for k in range(len(sub.invars))])
    used = set().union(*(set(d) for d in primal))
    offset = n_in - len(sub.invars)  # leading consts, if any
    drops = {}
    for k in floats:
        if 0 not in cts[k] and (k - offset) in used:
            drops[k] = _describe(eqn, k - offset, where)
    return drops


def _describe(eqn, k, where) -> str:
    info = getattr(ji.call_body(eqn)[0], "debug_info", None)
    src = getattr(info, "func_src_info", None) or ""  # "scale at /path/file.py:3"
    name, _, at = src.partition(" at ")
    name = name or str(ji.param(eqn, "name", "")) or "a custom_vjp function"
    if at:
        name += f" ({os.path.basename(at)})"
    bwd = ji.custom_vjp(eqn).user_bwd()
    names = getattr(bwd, "input_names", None) or getattr(info, "arg_names", None) or ()
    arg = names[k] if k < len(names) and names[k] else f"its input {k} (0-based)"
    bwd = inspect.unwrap(bwd) if callable(bwd) else bwd
    bwd_name = getattr(bwd, "__name__", "bwd")
    try:
        file = inspect.getsourcefile(bwd)  # None (or a TypeError) where the source is unknown
        bwd_at = f" ({os.path.basename(file)}:{inspect.getsourcelines(bwd)[1]})" if file else ""
    except (TypeError, OSError):
        bwd_at = ""
    return (f"the custom_vjp rule of {name} called at {where or '?'}: its bwd {bwd_name}"
            f"{bwd_at} returns a zero cotangent (None) for {arg}, which the output depends on")
