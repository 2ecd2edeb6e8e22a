"""What a custom VJP rule's ``bwd`` returned, checked against the primal inputs of its call
(private to `funcgrad.check`): one cotangent per differentiable input, each with its input's
pytree structure, shape and dtype (`funcgrad.check.custom.BWD_CONTRACT`), a wrong one named by
input name and pytree path.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util

# Lines of this file are never "the user's line" (as for funcgrad.check.custom).
source_info_util.register_exclusion(__file__)


class Spec:
    """What the check needs about one call: names and the differentiable primal arguments."""

    def __init__(self, fun_name, bwd_name, names, primals, nondiff_names):
        self.fun_name, self.bwd_name = fun_name, bwd_name
        self.names, self.primals, self.nondiff_names = names, primals, nondiff_names

    @property
    def where(self) -> str:
        return f"custom_vjp: the bwd rule {self.bwd_name} of {self.fun_name}"


def _type_str(x) -> str:
    """``float32[2,3]`` for a JAX value (weak types shown as the dtype JAX will use)."""
    aval = jax.typeof(x)
    return f"{aval.dtype}[{','.join(str(d) for d in aval.shape)}]"


def describe(x) -> str:
    """A short description of what bwd returned, for structure errors."""
    if x is None:
        return "None"
    try:
        return _type_str(x)
    except TypeError:
        pass
    leaves = jax.tree.leaves(x)
    if len(leaves) == 1 and leaves[0] is x:
        return f"a {type(x).__name__}"
    return str(jax.tree.structure(x)).replace("PyTreeDef", "pytree ")


def check_cotangents(spec: Spec, cts: Any) -> Any:
    """Returns `cts` unchanged after checking it against `spec.primals`; raises otherwise."""
    n = len(spec.primals)
    expected = ", ".join(f"{name}: {describe(p)}" for name, p in zip(spec.names, spec.primals))
    if isinstance(cts, list):
        cts = tuple(cts)  # jax.custom_vjp accepts a list of the right length too
    if not isinstance(cts, tuple):
        hint = " For one input write `return (ct,)`." if n == 1 else ""
        raise TypeError(
            f"{spec.where} returned {describe(cts)}, not a tuple. It must return a tuple of {n} "
            f"cotangent(s), one per differentiable input of {spec.fun_name} ({expected}).{hint}"
            "\nSee funcgrad.check.custom.BWD_CONTRACT.")
    if len(cts) != n:
        hint = ""
        if spec.nondiff_names and len(cts) == n + len(spec.nondiff_names):
            hint = (f" The nondiff_argnums argument(s) {', '.join(spec.nondiff_names)} get no "
                    "cotangent: leave them out.")
        raise TypeError(
            f"{spec.where} returned {len(cts)} cotangent(s), but {spec.fun_name} has {n} "
            f"differentiable input(s) ({expected}); return one per input, in order, with None "
            f"for an input that gets no gradient.{hint}\nSee funcgrad.check.custom.BWD_CONTRACT.")
    shape_errors: list[str] = []
    kind_errors: list[str] = []
    for name, primal, ct in zip(spec.names, spec.primals, cts):
        if ct is None:
            continue
        pairs = _match_structure(spec, name, primal, ct)
        for path, p, c in pairs:
            _check_leaf(name + path, p, c, shape_errors, kind_errors)
    if kind_errors or shape_errors:
        errors = kind_errors + shape_errors
        lines = "\n".join(f"  {e}" for e in errors)
        raise (TypeError if kind_errors else ValueError)(
            f"{spec.where} returned a wrong cotangent for {len(errors)} input leaf(s):\n{lines}\n"
            "A cotangent has its primal's shape and dtype: sum over the axes the forward pass "
            "broadcast, cast with .astype(x.dtype), or return None for no gradient.")
    return cts


def _match_structure(spec, name, primal, ct):
    """``(path, primal leaf, cotangent)`` for each non-None cotangent leaf; TypeError on a
    structure mismatch. A None in `ct` may stand for any subtree of `primal`."""
    triples = []

    def pair(path, c, p):
        triples.append((path, c, p))

    try:
        jax.tree_util.tree_map_with_path(pair, ct, primal, is_leaf=lambda x: x is None)
        # A leaf of `ct` opposite a subtree of `primal` passes tree_map (a prefix match).
        collapsed = [(path, p) for path, c, p in triples if c is not None and not _is_leaf(p)]
        mismatch = bool(collapsed)
    except (ValueError, TypeError):
        collapsed, mismatch = [], True
    if mismatch:
        missing, extra = _path_differences(primal, ct)
        detail = "".join(
            [f"; missing: {', '.join(name + m for m in missing)}" if missing else "",
             f"; not in the input: {', '.join(name + e for e in extra)}" if extra else "",
             *(f"; one array at {name}{jax.tree_util.keystr(path)}, where the input has "
               f"{jax.tree.structure(p)}" for path, p in collapsed)])
        raise TypeError(
            f"{spec.where} returned a cotangent for {name} with the wrong pytree structure"
            f"{detail}.\n  expected: {jax.tree.structure(primal)} "
            f"(leaves: {_describe_leaves(primal)})\n"
            f"  received: {jax.tree.structure(ct)} (leaves: {_describe_leaves(ct)})\n"
            "Return the cotangent in the input's own containers (the same dict keys, tuple vs "
            "list, lengths), with None for a subtree that gets no gradient."
            "\nSee funcgrad.check.custom.BWD_CONTRACT.")
    return [(jax.tree_util.keystr(path), p, c) for path, c, p in triples if c is not None]


def _is_leaf(x) -> bool:
    """True for an array or scalar; False for a container, including None (no leaves)."""
    leaves = jax.tree.leaves(x)
    return len(leaves) == 1 and leaves[0] is x


def _describe_leaves(tree) -> str:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return ", ".join(f"{jax.tree_util.keystr(path) or '.'}: {describe(x)}"
                     for path, x in flat) or "none"


def _path_differences(primal, ct):
    """Primal leaf paths that no cotangent entry covers, and cotangent entries at no primal path."""
    key = lambda path: tuple(jax.tree_util.keystr((k,)) for k in path)
    primal_paths = [key(p) for p, _ in jax.tree_util.tree_flatten_with_path(primal)[0]]
    ct_flat = jax.tree_util.tree_flatten_with_path(ct, is_leaf=lambda x: x is None)[0]
    ct_paths = [key(p) for p, _ in ct_flat]
    covered = lambda pp: any(pp[:len(cp)] == cp for cp in ct_paths)
    known = lambda cp: any(pp[:len(cp)] == cp for pp in primal_paths)
    missing = ["".join(pp) for pp in primal_paths if not covered(pp)]
    extra = ["".join(cp) for cp, (_, c) in zip(ct_paths, ct_flat)
             if c is not None and not known(cp)]
    return missing, extra


def _check_leaf(where, primal, ct, shape_errors, kind_errors):
    p_aval = jax.typeof(primal)
    try:
        c_aval = jax.typeof(ct)
    except TypeError:
        kind_errors.append(f"{where}: expected an array {_type_str(primal)}, got a "
                           f"{type(ct).__name__}")
        return
    floating = jnp.issubdtype(p_aval.dtype, jnp.inexact)  # extended dtypes (keys) are not
    want = p_aval.dtype if floating else jax.dtypes.float0
    want_str = f"{want}[{','.join(str(d) for d in p_aval.shape)}]"
    if not floating and c_aval.dtype != jax.dtypes.float0:
        kind_errors.append(
            f"{where}: the primal is {_type_str(primal)}, which has no gradient; return None "
            f"for it (or np.zeros({tuple(p_aval.shape)}, jax.dtypes.float0)), got {_type_str(ct)}")
    elif c_aval.shape != p_aval.shape or c_aval.dtype != want:
        shape_errors.append(f"{where}: expected {want_str} (the primal's shape and dtype), "
                            f"got {_type_str(ct)}")
    elif isinstance(ct, (np.ndarray, np.generic)) and floating and np.dtype(ct.dtype) != want:
        # jax.typeof reports the dtype JAX would convert it to; eager jax.grad would hand the
        # NumPy array itself back as the gradient.
        shape_errors.append(f"{where}: expected {want_str} (the primal's shape and dtype), got "
                            f"a NumPy {ct.dtype} array; return jnp arrays, or cast with "
                            f".astype({want})")
