"""Where a leaf lives: its layer (the leaf's parent in the pytree) and the source line of the
user's code that first reads it (from the loss's jaxpr)."""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import jax

from funcgrad import _jax_internals as ji

#: The last key of a path as funcgrad prints it: ``['w']``, ``[0]`` or ``.weight``.
_LAST_KEY = re.compile(r"(\[[^\[\]]*\]|\.[A-Za-z_][A-Za-z0-9_]*)$")


def layer_of(path: str) -> str:
    """The layer of a leaf path: its parent, ``params['dense2']`` for ``params['dense2']['w']``
    (the monitor's grouping, `funcgrad.train.monitor`); the path itself at the top level."""
    parent = _LAST_KEY.sub("", path)
    return parent if parent and parent != "params" else path


def leaf_lines(loss: Callable, params: Any, batch: Any, source: str | None) -> dict[int, str]:
    """{leaf index (``jax.tree.leaves(params)`` order): ``"model.py:23"``}: the line of the
    user's code of the first equation that reads the leaf, following it into nested jaxprs
    (jit, custom rules, scan, cond). A frame in `source` (the model file) is preferred; else
    the innermost frame outside jax, funcgrad and the installed libraries. Leaves never read,
    or read only where no such frame exists, are left out."""
    closed = jax.make_jaxpr(loss)(params, batch)
    jaxpr, _ = ji.closed_parts(closed)
    n = len(jax.tree.leaves(params))
    found: dict[int, str] = {}
    _walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:n])}, found, source)
    return found


def _walk(jaxpr: Any, watched: dict[Any, int], found: dict[int, str], source: str | None):
    for eqn in jaxpr.eqns:
        if not watched:
            return
        readers = [(pos, watched[v]) for pos, v in enumerate(eqn.invars)
                   if not ji.is_literal(v) and v in watched]
        if not readers:
            continue
        subs = list(ji.sub_jaxprs(eqn))
        if subs:  # follow the leaf inside; a sub-jaxpr's invars end with the eqn's operands
            for _, sub, _ in subs:
                offset = len(sub.invars) - len(eqn.invars)
                inner = {sub.invars[pos + offset]: leaf for pos, leaf in readers
                         if 0 <= pos + offset < len(sub.invars)}
                _walk(sub, inner, found, source)
        line = _user_frame(eqn, source)
        for _, leaf in readers:
            if leaf not in found and line:
                found[leaf] = line
        for _, leaf in readers:
            if leaf in found:
                watched = {v: i for v, i in watched.items() if i != leaf}


def _user_frame(eqn: Any, source: str | None) -> str:
    frames = ji.frames(eqn)
    if source is not None:
        want = os.path.abspath(source)
        for file, line, _ in frames:
            if os.path.abspath(file) == want:
                return f"{os.path.basename(file)}:{line}"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # funcgrad/
    for file, line, _ in frames:
        path = os.path.abspath(file)
        if (path.startswith(here) or "site-packages" in path or "/lib/python" in path
                or path.startswith("<")):
            continue
        return f"{os.path.basename(file)}:{line}"
    return ""
