"""Small, shared readers of jaxprs and argument pytrees (private).

Used by `funcgrad.check`, `funcgrad.debug.graph` and `funcgrad.debug.diagnose` to name leaves
by pytree path (``params[0]['w']``), to say where an equation came from (``file.py:12``) and to find
the jaxprs nested in an equation's parameters (jit, custom_jvp/vjp, scan, cond, remat, while).
Everything here that reads JAX's internals calls `funcgrad._jax_internals`.
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._jax_internals import bind, is_literal, source_summary
from funcgrad._jax_internals import closed_parts as closed_parts  # re-exported
from funcgrad._jax_internals import sub_jaxprs as sub_jaxprs  # re-exported
from funcgrad._paths import arg_leaf_paths, keystr


def arg_names(fn: Callable, nargs: int) -> list[str]:
    """Names of the first `nargs` positional parameters of `fn` (``args[i]`` where unknown)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(nargs):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY,
                                                   params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"args[{i}]")
    return names


def leaf_paths(args: tuple, names: list[str]) -> list[str]:
    """One name per leaf of the tuple `args`, in ``jax.tree.leaves(args)`` order:
    the argument's name followed by the leaf's key path, e.g. ``params[0]['w']``."""
    return [names[i] + keystr(path) for i, path in arg_leaf_paths(tuple(args))]


def check_array_args(where: str, args: tuple, names: list[str]) -> None:
    """TypeError naming the first leaf of `args` that is not an array or a number: funcgrad
    traces every argument as an array, so a str, a callable or an object must be closed over
    (``functools.partial(fn, mode="sq")``) rather than passed. (An equinox module never gets
    here: the tools split it first, `funcgrad._library_objects.split_equinox_args`.)"""
    for (i, path), leaf in zip(arg_leaf_paths(tuple(args)), jax.tree.leaves(tuple(args))):
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
            continue
        raise TypeError(f"{where}: argument {names[i] + keystr(path)} is a "
                        f"{type(leaf).__name__}, not an array or a number; every argument is "
                        "traced as an array. Close over it instead, e.g. "
                        "functools.partial(fn, name=value), and pass the arrays.")


def source_line(eqn: Any) -> str:
    """Where the user's code created `eqn`, as ``file.py:LINE (function)``; "" if unknown.

    The file is shown by its base name; JAX's own frames are skipped by JAX."""
    text = source_summary(eqn)
    if not text or text.startswith("unknown"):
        return ""
    head, sep, rest = text.partition(":")
    return os.path.basename(head) + sep + rest if sep else text


def is_float(dtype: Any) -> bool:
    """Whether values of this dtype take a cotangent (float, bfloat16, float8, complex)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def interpret(jaxpr: Any, consts: Any, args: Any,
              rule: Callable[[Any, list], list | None]) -> list:
    """Evaluates `jaxpr` equation by equation on `args` (values or tracers).

    ``rule(eqn, ins)`` may return the equation's outputs (to replace, record or recurse);
    when it returns None the primitive is applied as is (`bind`). Returns the outputs, a list.
    """
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if is_literal(v) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = rule(eqn, ins)
        env.update(zip(eqn.outvars, bind(eqn, ins) if outs is None else outs))
    return [read(v) for v in jaxpr.outvars]
