"""Backward with a cotangent: PyTorch's ``out.backward(gradient=v)`` as one call on ``jax.vjp``.

Concept 5 (article A §2.2). Reverse mode computes a vector-Jacobian product ``vᵀ J``: the
output-space vector `v` (the cotangent) says which combination of outputs to differentiate.
A scalar output has an obvious one, ``v = 1``, which gives the gradient; any other output
needs `v` from the caller, of the output's shape and dtype, exactly as PyTorch refuses
``out.backward()`` on a non-scalar and asks for ``gradient=``. The errors here name the
output's shape and dtype and are raised before ``jax.vjp``'s own.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from funcgrad._jaxpr import arg_names, check_array_args
from funcgrad._paths import key_paths, keystr
from funcgrad._traced import traced_values

PyTree = Any

#: Why a non-scalar output needs a cotangent, with the failing and the fixed code.
NEEDS_COTANGENT = """\
Reverse mode computes v^T J for an output-space vector v (the cotangent). For a scalar output
v = 1 is implied and the result is the gradient; for any other output there is no single
gradient, so say which combination of outputs you mean:

    backward(lambda x: x ** 2, x)                                  # fails: output shape (3,)
    backward(lambda x: x ** 2, x, cotangent=jnp.ones_like(x))      # d(sum(y))/dx = 2 x
    backward(lambda x: (x ** 2).sum(), x)                          # the same, reduced first
    backward(lambda x: x ** 2, x, cotangent=v)                     # v^T J = 2 x v
"""


def _describe(tree: PyTree) -> str:
    leaves = jax.tree.leaves(tree)
    if jax.tree.structure(tree).num_nodes == 1:  # one array, not a container
        return f"shape {jnp.shape(leaves[0])} and dtype {jnp.result_type(leaves[0])}"
    return "structure {} with leaves {}".format(
        jax.tree.structure(tree),
        ", ".join(f"{jnp.result_type(x)}{list(jnp.shape(x))}" for x in leaves))


def _check_outputs(out: PyTree) -> None:
    flat, _ = jax.tree_util.tree_flatten_with_path(out)
    if not flat:
        raise ValueError(f"backward: fn returned {out!r}, which holds no array: there is "
                         "nothing to differentiate. Return the output array (or pytree).")
    for path, leaf in flat:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            where = f"output{jax.tree_util.keystr(path)}" if path else "the output"
            raise TypeError(
                f"backward: {where} has dtype {dtype}, which has no gradient. Return it as "
                "auxiliary data (fn returns (out, aux) with has_aux=True) or cast it to a "
                "floating dtype.")


def _as_cotangent(cotangent: PyTree, out: PyTree) -> PyTree:
    """`cotangent` checked against `out` leaf by leaf; Python scalars take the output's dtype."""
    if cotangent is None:
        single = jax.tree.structure(out).num_nodes == 1  # one array, not a container
        if single and jnp.shape(out) == () and jnp.iscomplexobj(out):
            raise TypeError("backward: the output is a complex scalar; as with jax.grad, its "
                            "gradient needs a choice: pass cotangent= (1.0 gives the real "
                            "part's), or differentiate jnp.real(out).")
        if single and jnp.shape(out) == ():
            return jnp.ones((), jnp.result_type(out))
        raise ValueError(
            f"backward: the output has {_describe(out)}, so it needs a cotangent of that "
            + ("shape and dtype (the vector v in v^T J). Pass cotangent=jnp.ones_like(out)"
               if single else "structure, shapes and dtypes (the vector v in v^T J). Pass "
               "cotangent=jax.tree.map(jnp.ones_like, out)")
            + ", or reduce the output to a scalar, e.g. out.sum() or out.mean().\n"
            + NEEDS_COTANGENT)
    out_def, ct_def = jax.tree.structure(out), jax.tree.structure(cotangent)
    if out_def != ct_def:
        raise ValueError(
            f"backward: the cotangent's pytree structure {ct_def} does not match the output's "
            f"{out_def}. Pass one cotangent leaf per output leaf, e.g. "
            "cotangent=jax.tree.map(jnp.ones_like, out).")
    flat_out, _ = jax.tree_util.tree_flatten_with_path(out)
    checked = []
    for (path, o), c in zip(flat_out, jax.tree.leaves(cotangent)):
        where = f"output{jax.tree_util.keystr(path)}" if path else "the output"
        if isinstance(c, (int, float, complex)) and not isinstance(c, bool):
            c = jnp.asarray(c, jnp.result_type(o))  # a Python number adopts the output's dtype
        elif not hasattr(c, "shape") or not hasattr(c, "dtype"):
            raise TypeError(f"backward: the cotangent for {where} is a {type(c).__name__}; "
                            "it must be an array (or a Python number for a scalar output).")
        c = jnp.asarray(c)
        if c.shape != jnp.shape(o) or c.dtype != jnp.result_type(o):
            raise ValueError(
                f"backward: {where} has shape {jnp.shape(o)} and dtype {jnp.result_type(o)}, "
                f"but its cotangent has shape {c.shape} and dtype {c.dtype}. The cotangent "
                "must match the output exactly: pass cotangent=jnp.ones_like(out) or an array "
                f"built with shape={jnp.shape(o)}, dtype={jnp.result_type(o)} "
                "(v.astype(out.dtype) fixes a dtype).")
        checked.append(c)
    return jax.tree.unflatten(out_def, checked)


def backward(fn: Callable, *args: Any, cotangent: PyTree | None = None,
             argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Any:
    """Returns ``vᵀ J``: the cotangent `v` pulled back through `fn` to the arguments `argnums`.

    With a scalar output and no cotangent this is ``jax.grad(fn, argnums)(*args)`` (``v = 1``,
    PyTorch's ``loss.backward()``); with a cotangent it is PyTorch's
    ``out.backward(gradient=v)``, computed as ``jax.vjp(fn, *args)[1](v)``. Inputs are checked
    before ``jax.vjp`` sees the cotangent, so a mistake gets an error that names the output.

    Args:
      fn: ``fn(*args) -> out`` (``(out, aux)`` with `has_aux`); `out` is a floating array of
        any shape or a pytree of them.
      *args: the primal point; the arguments at `argnums` are differentiated (floating arrays
        or pytrees of them), the others are held fixed.
      cotangent: the output-space vector `v`: same pytree structure, shapes and dtypes as
        `out`. A Python number is accepted for a leaf and takes that leaf's dtype. None (the
        default) is allowed only for an output of shape ``()`` and means 1.
      argnums: an int or a tuple of ints, as in ``jax.grad``.
      has_aux: if True, `fn` returns ``(out, aux)`` and `aux` is returned unchanged.
    Returns:
      ``vᵀ J`` with the structure, shapes and dtypes of ``args[argnums]`` (a tuple of them when
      `argnums` is a tuple); ``(grads, aux)`` with `has_aux`.
    Raises:
      ValueError: if the output is not a scalar and no cotangent is given, or the cotangent's
        structure, shape or dtype differs from the output's (the message names both), or
        `argnums` is out of range or names an argument twice.
      TypeError: if an argument leaf is not an array or a number (its path is named), a
        differentiated leaf or an output leaf is not floating point, or a cotangent leaf is
        not an array;
        `funcgrad.TracedValueError` (a TypeError) when `fn` uses a traced value as a Python
        value where it is traced (under its own ``jax.jit``): the message names its line.
    Example:
      >>> backward(lambda x: x ** 2, jnp.array([1.0, 2.0]), cotangent=jnp.array([1.0, -1.0]))
      Array([ 2., -4.], dtype=float32)
    """
    single = isinstance(argnums, int) and not isinstance(argnums, bool)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(isinstance(i, bool) or not isinstance(i, int)
                       or not -len(args) <= i < len(args) for i in nums):
        raise ValueError(f"backward: argnums={argnums!r} must name positions of the "
                         f"{len(args)} argument(s) given to fn (0 to {len(args) - 1}).")
    nums = tuple(i % len(args) for i in nums)
    if len(set(nums)) != len(nums):
        raise ValueError(f"backward: argnums={argnums!r} names an argument twice; name each "
                         "differentiated argument once.")

    def of_differentiated(*diff):
        full = list(args)
        for i, x in zip(nums, diff):
            full[i] = x
        return fn(*full)

    check_array_args("backward", args, arg_names(fn, len(args)))
    primals = tuple(args[i] for i in nums)
    for i, x in zip(nums, primals):
        for path, leaf in zip(key_paths(x), jax.tree.leaves(x)):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
                raise TypeError(
                    f"backward: argument {i}{keystr(path)} (argnums) has dtype "
                    f"{jnp.result_type(leaf)}, which has no gradient. Differentiate floating "
                    "arguments only (argnums), or cast it: x.astype(jnp.float32).")
    with traced_values("backward", fn, args, arg_names(fn, len(args)), nums):
        if has_aux:
            out, pullback, aux = jax.vjp(of_differentiated, *primals, has_aux=True)
        else:
            out, pullback = jax.vjp(of_differentiated, *primals)
    _check_outputs(out)
    grads = pullback(_as_cotangent(cotangent, out))
    grads = grads[0] if single else grads
    return (grads, aux) if has_aux else grads
