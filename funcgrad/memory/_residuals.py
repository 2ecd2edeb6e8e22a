"""The residuals the backward pass keeps, as the jaxpr sees them, each with what kept it: JAX's
default vjp, a ``jax.checkpoint`` policy or a ``checkpoint_name`` (`ResidualRow`; the policies
whose names keep nothing are `_checkpoint_warnings`). `funcgrad.memory.report` sets them next to
the compiled program's bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import leaf_paths, source_line


@dataclasses.dataclass(frozen=True)
class ResidualRow:
    """One value the backward pass keeps (one of ``jax.vjp``'s residuals).

    ``nbytes = prod(shape) * itemsize``. ``origin`` is "argument" (an input leaf, already
    counted in the argument bytes), "output" (made by an equation), "named" (a value named
    with ``checkpoint_name`` and saved by a policy), "constant" or "literal". ``kept_by`` says
    what decided to keep it: JAX's default vjp, a ``jax.checkpoint`` policy, or a name."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    origin: str
    primitive: str      # the primitive that made it ("" for arguments)
    source: str         # the user's line, "file.py:12:8 (fn)", "" if unknown
    leaf: str | None    # the argument's pytree path, e.g. params[0]['w']
    kept_by: str


def _rows(fn, args, nums, names) -> tuple[ResidualRow, ...]:
    """The residuals of a vjp of `fn` w.r.t. `nums`, via `funcgrad.debug.graph` (the same
    rows `funcgrad.trace` lists), with what kept each one."""
    from funcgrad.debug import graph as graph_mod

    diff = tuple(args[i] for i in nums)
    if nums == tuple(range(len(args))):
        g = graph_mod.trace(fn, *args)
        found = g.residuals or ()  # never None: trace lists residuals by default
    else:
        closed = [jax.tree.map(graph_mod._concrete, a) for a in args]  # stand-ins: zeros

        def on_diff(*d):
            full = list(closed)
            for i, x in zip(nums, d):
                full[i] = x
            return fn(*full)
        on_diff.__name__ = _fn_name(fn)
        paths = leaf_paths(diff, [names[i] for i in nums])
        g = graph_mod.trace(on_diff, *diff, residuals=False)
        found = graph_mod._residuals(on_diff, diff, paths, g)
        # The other arguments are closed over: JAX reports them as constants. Name each one
        # whose shape and dtype match exactly one of those arguments' leaves.
        rest = [(p, x) for i in range(len(args)) if i not in nums for p, x in
                zip(leaf_paths((args[i],), [names[i]]), jax.tree.leaves(args[i]))]
        found = tuple(_name_constant(r, rest) for r in found)
    policies = _remat_lines(jax.make_jaxpr(fn)(*args).jaxpr)
    return tuple(ResidualRow(r.shape, r.dtype, r.nbytes, r.origin, r.primitive, r.source,
                             r.leaf, _kept_by(r, policies)) for r in found)


def _name_constant(r, rest):
    if r.origin != "constant":
        return r
    same = [p for p, x in rest if tuple(np.shape(x)) == r.shape
            and str(_dtype(x)) == r.dtype]
    if len(same) != 1:
        return r
    return dataclasses.replace(r, origin="argument", leaf=same[0] + " (not differentiated)")


_PREDICATE = "fg.remat's runtime predicate"


def _kept_by(r, policies: dict) -> str:
    if r.origin in ("argument", "constant", "literal"):
        return "input or constant (held anyway)"
    if "(_runtime_true)" in r.source:
        return (f"{_PREDICATE} (funcgrad's: one element compared with itself, so that XLA "
                "cannot merge the recomputation away)")
    if r.primitive in ("scan", "while") and (_LOOP, r.source) in policies:
        return (f"jax.checkpoint inside the {r.primitive} body "
                f"({policies[(_LOOP, r.source)]}): what it saves, one per iteration")
    if r.origin == "named":
        name = r.description.split("'")[1] if "'" in r.description else "?"
        return f"checkpoint_name {name!r} saved by {policies.get(r.source, 'a policy')}"
    if r.source in policies:
        if (_OUTSIDE, r.source) in policies:
            return (f"jax.checkpoint ({policies[r.source]}) or vjp default: this line runs "
                    "both inside and outside a checkpoint")
        return f"jax.checkpoint, {policies[r.source]}"
    return "vjp default (no checkpoint)"


_OUTSIDE = "outside a checkpoint"


_LOOP = "a loop holding a checkpoint"


def _remat_lines(jaxpr, policy: str | None = None, out=None) -> dict[str, str]:
    """Source line -> the checkpoint policy of the innermost ``jax.checkpoint`` around it;
    ``(_OUTSIDE, line) -> ""`` for lines that also run outside every checkpoint."""
    out = {} if out is None else out
    for eqn in jaxpr.eqns:
        inner = policy
        if ji.kind(eqn) == "checkpoint":
            p = ji.checkpoint(eqn).policy
            inner = ("policy " + ji.policy_name(p)) if p else \
                "no policy (saves only its inputs)"
        if inner is not None:
            out.setdefault(source_line(eqn), inner)
        else:  # the same line may also run outside any checkpoint (a helper called twice)
            out.setdefault((_OUTSIDE, source_line(eqn)), "")
        for _, sub, _ in ji.sub_jaxprs(eqn):
            _remat_lines(sub, inner, out)
        if ji.kind(eqn) in ("scan", "while"):  # its residuals carry the line of the loop
            found = _first_policy(eqn)
            if found is not None:
                out.setdefault((_LOOP, source_line(eqn)), found)
    return out


def _first_policy(eqn) -> str | None:
    """The policy of the first ``jax.checkpoint`` nested in `eqn`'s jaxprs, in words."""
    for _, sub, _ in ji.sub_jaxprs(eqn):
        for inner in sub.eqns:
            if ji.kind(inner) == "checkpoint":
                p = ji.checkpoint(inner).policy
                return ("policy " + ji.policy_name(p)) if p else \
                    "no policy (saves only its inputs)"
            found = _first_policy(inner)
            if found is not None:
                return found
    return None


def _checkpoint_warnings(jaxpr) -> tuple[str, ...]:
    """Checkpoint settings that do not do what they say (`MemoryReport.warnings`)."""
    names: set[str] = set()
    policies: list[tuple[Any, set[str]]] = []
    carries: list[str] = []

    def walk(j):
        for eqn in j.eqns:
            if ji.name(eqn) == "name":
                names.add(str(ji.param(eqn, "name")))
            if ji.kind(eqn) == "checkpoint":
                p = ji.checkpoint(eqn).policy
                wanted = ji.policy_saved_names(p)
                if wanted is not None:
                    policies.append((p, wanted))
            if ji.kind(eqn) == "scan":
                s = ji.scan(eqn)
                carry_out = set(s.body.outvars[:s.num_carry])
                for inner in s.body.eqns:
                    if ji.name(inner) == "name" and inner.outvars[0] in carry_out:
                        carries.append(f"checkpoint_name {ji.param(inner, 'name')!r} at "
                                       f"{source_line(inner) or '?'} tags a scan carry: a "
                                       "scan keeps every iteration's carry for its backward "
                                       "pass anyway, so the name saves nothing more")
            for _, sub, _ in ji.sub_jaxprs(eqn):
                walk(sub)
    walk(jaxpr)
    out = []
    for p, wanted in policies:
        missing = sorted(wanted - names)
        if missing:
            have = ", ".join(repr(n) for n in sorted(names)) or "none"
            out.append(f"jax.checkpoint's policy {ji.policy_name(p)} saves "
                       f"{', '.join(repr(n) for n in missing)}, which no checkpoint_name in "
                       f"fn carries (the names fn has: {have}); a misspelt name saves "
                       "nothing, and the backward pass recomputes everything.")
    return tuple(out + carries)


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.result_type(type(x))


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__
