"""The one way funcgrad names a leaf of a pytree in its reports (private).

A leaf is named by its key path as JAX writes it (``jax.tree_util.keystr``): ``params[0]['w']``
for lists and dicts, ``params.layers[2].weight`` for an equinox module. One level is left out:
the ``.value`` of a flax nnx Variable (``nnx.Param``, ``nnx.BatchStat``, ...), which wraps
exactly one array and is not a level of the model, so an nnx state's leaf reads
``params['bn1']['scale']`` (as ``nnx.state`` prints it) and its layer, the leaf's parent, is
the module ``params['bn1']``. Every report that names a params leaf (check_grads, audit,
explain_grads, find_nonfinite, trace, taps, masks, the monitor, the train step) goes through
`key_paths`, so the names agree between tools.
"""
from __future__ import annotations

import sys
from typing import Any

import jax

PyTree = Any
KeyPath = tuple


def is_nnx_variable(x: Any) -> bool:
    """Whether `x` is a flax nnx Variable (False without importing flax when it is not loaded)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def _drop_value(path: KeyPath) -> KeyPath:
    """A Variable's inner key path without its leading ``.value`` (or ``.raw_value``) level."""
    if path and isinstance(path[0], jax.tree_util.GetAttrKey) and path[0].name in (
            "value", "raw_value"):
        return path[1:]
    return path


def key_paths(tree: PyTree) -> list[KeyPath]:
    """The key path of every leaf of `tree`, in ``jax.tree.leaves(tree)`` order, with each nnx
    Variable's ``.value`` level left out (see the module docstring)."""
    out: list[KeyPath] = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_nnx_variable)[0]:
        if is_nnx_variable(node):
            out.extend(path + _drop_value(inner)
                       for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0])
        else:
            out.append(path)
    return out


def keystr(path: KeyPath) -> str:
    """``['bn1']['scale']``, ``.layers[2].weight``: the key path as JAX writes it."""
    return jax.tree_util.keystr(tuple(path))


def slash_path(path: KeyPath) -> str:
    """The ``bn1/scale``, ``layers/2/weight`` form of a key path (`funcgrad.train.masks` patterns).
    """
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def leaf_names(tree: PyTree, prefix: str = "params") -> list[str]:
    """``prefix`` + `keystr` of every leaf of `tree`, in leaf order: ``params['bn1']['scale']``."""
    return [prefix + keystr(p) for p in key_paths(tree)]


def arg_leaf_paths(args: tuple) -> list[tuple[int, KeyPath]]:
    """``(argument index, key path inside it)`` for every leaf of the tuple `args`, in
    ``jax.tree.leaves(args)`` order."""
    return [(p[0].idx, tuple(p[1:])) for p in key_paths(tuple(args))]
