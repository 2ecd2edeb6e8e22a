"""A check's problem, set up from fn and its arguments (private to `funcgrad.check`): the
differentiated leaves raveled into one float64 vector theta, the others kept as they are, the
output's layout, the dtype fn computes in, the seeded output cotangents and the arguments
named; and which leaves may differ from finite differences because of ``stop_gradient``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._library_objects import LeftOut
from funcgrad._paths import arg_leaf_paths, keystr
from funcgrad.check import _objective as obj
from funcgrad.check._lift_precision import narrowest_float
from funcgrad.check.options import CheckOptions


def argnums_tuple(who: str, argnums: Any) -> tuple[int, ...]:
    """`argnums` as a tuple of distinct ints, in the order given (negative ones as given);
    TypeError naming `who` unless it is an int or a non-empty tuple or list of ints."""
    is_int = lambda a: isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))
    if not (is_int(argnums) or (isinstance(argnums, (tuple, list)) and argnums
                                and all(is_int(a) for a in argnums))):
        raise TypeError(f"{who}: argnums must be an int or a non-empty tuple of ints (the "
                        f"positions of the arguments to differentiate, e.g. argnums=(0, 1)), got "
                        f"{argnums!r}.")
    if is_int(argnums):
        return (int(argnums),)
    return tuple(dict.fromkeys(int(a) for a in cast(Sequence[int], argnums)))


def promote(x):
    """Floating leaves to float64 NumPy arrays (host-side: no per-shape compilation); other
    leaves as they are: a typed PRNG key (``jax.random.key(0)``) has no NumPy form, and integer
    tokens or bools are passed through, not differentiated."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return x
    return np.asarray(x).astype(np.float64)


def setup(who, fn, args, argnums, has_aux, options: CheckOptions, names, force_cast=False):
    """The problem of checking `fn` at `args` over the floating leaves of `argnums` (a tuple
    of ints, maybe negative), as a dict: the spec (`funcgrad.check._objective.Spec`), theta,
    the leaves, the seeded cotangents, the differentiated leaves' paths and shapes, the dtype
    fn computes in, notes, the output layout and the argument names. `force_cast` gives fn
    its differentiated leaves in their own dtypes (a program traced as the user runs it).
    ValueError (naming `who`) for an argnum out of range, an integer argument, a complex
    leaf, nothing to differentiate, or an output that cannot be checked."""
    for a in argnums:
        if not -len(args) <= a < len(args):
            raise ValueError(f"{who}: argnums={a} is out of range for {len(args)} "
                             "positional args.")
    argnums = tuple(a % len(args) for a in argnums)
    for a in argnums:
        if isinstance(args[a], (jax.Array, np.ndarray, int, bool)) and not jnp.issubdtype(
                jnp.result_type(args[a]), jnp.inexact):
            raise ValueError(
                f"{who}: argument {names[a]} (argnums={a}) has dtype "
                f"{jnp.result_type(args[a])}, which cannot be differentiated. Select floating "
                "arguments with argnums, or cast it: x.astype(jnp.float32).")
    flat, treedef = jax.tree.flatten(tuple(args))
    diff, paths, skipped = [], [], []
    for pos, ((arg, path), leaf) in enumerate(zip(arg_leaf_paths(tuple(args)), flat)):
        name = names[arg] + keystr(path)
        dtype = jnp.result_type(leaf)
        if arg in argnums:
            if jnp.issubdtype(dtype, jnp.floating) and np.size(leaf) == 0:
                skipped.append(f"{name} (shape {tuple(np.shape(leaf))}: empty, nothing to check)")
            elif jnp.issubdtype(dtype, jnp.floating):
                diff.append(pos)
                paths.append(name)
            elif jnp.issubdtype(dtype, jnp.complexfloating):
                raise ValueError(f"{who}: {name} is complex; complex leaves are not "
                                 "supported.")
            else:
                skipped.append(f"{name} ({dtype}, not differentiated)")
    if not diff:
        raise ValueError(
            f"{who}: no floating leaf to differentiate in argnums={argnums} "
            f"({', '.join(names[a] for a in argnums)})"
            + (f"; skipped: {', '.join(skipped)}." if skipped else "."))
    leaves = tuple(promote(leaf) for leaf in flat)
    shapes = tuple(tuple(leaves[p].shape) for p in diff)
    theta = np.concatenate([np.ravel(leaves[p]) for p in diff])
    probe = obj.Spec(fn, has_aux, treedef, tuple(diff), shapes, 1, True)
    if force_cast:  # fn is a program traced in its own dtypes (`_as_run`): give it those
        probe = probe._replace(cast_to=tuple(str(jnp.result_type(flat[p])) for p in diff))
        leaves = tuple(leaf if pos in diff else flat[pos] for pos, leaf in enumerate(leaves))
    try:
        out_tree = jax.eval_shape(lambda t, lv: _raw_output(who, probe, t, lv), theta, leaves)
    except TypeError as error:
        # fn mixes its own dtype with the float64 inputs where JAX wants one type (a scan
        # carry made in float32, as flax's nn.RNN does): give fn its leaves in their own dtypes
        # and let lifting (funcgrad.check._lift_precision) check its arithmetic in float64.
        if "float64" not in str(error) or not any(
                str(jnp.result_type(flat[p])) != "float64" for p in diff):
            raise
        probe = probe._replace(cast_to=tuple(str(jnp.result_type(flat[p])) for p in diff))
        leaves = tuple(leaf if pos in diff else flat[pos] for pos, leaf in enumerate(leaves))
        out_tree = jax.eval_shape(lambda t, lv: _raw_output(who, probe, t, lv), theta, leaves)
    out_layout, start = [], 0
    for path, o in jax.tree_util.tree_flatten_with_path(out_tree)[0]:
        out_layout.append((jax.tree_util.keystr(path), tuple(o.shape), start))
        start += math.prod(o.shape)
    # One trace gives the output's shape and the jaxpr whose dtypes set the tolerances below.
    traced, out = jax.make_jaxpr(lambda t, lv: obj.output_vector(probe, t, lv),
                                 return_shape=True)(theta, leaves)
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"{who}: fn returned dtype {out.dtype}; it must return floating "
                         "values.")
    spec = probe._replace(order=options.order, scalar_output=out.size == 1)
    rng = np.random.default_rng(options.seed)  # NumPy draws: nothing to compile
    cotangents = (rng.standard_normal(out.shape), rng.standard_normal(theta.shape))
    # The narrowest float the function computes in, not only the one it returns: a float32
    # cast inside a function that returns float64 rounds like float32.
    inner = narrowest_float(traced.jaxpr)
    dtype_used = min([str(out.dtype), *([inner] if inner else [])],
                     key=lambda d: jnp.finfo(d).bits)
    notes = []
    if dtype_used != "float64":
        notes.append(f"fn computes in {dtype_used} even with float64 inputs; eps and tolerances "
                     f"are those of {dtype_used}.")
    if not spec.scalar_output:
        notes.append(f"output has {out.size} elements: checked uᵀJ for a fixed random cotangent u.")
    notes += _aux_hint(out_tree, has_aux)
    # On the device once: the kernels (and the bisection's repeated calls) reuse these buffers
    # instead of copying host arrays in on every call. device_put compiles nothing.
    theta, leaves, cotangents = jax.device_put((theta, leaves, cotangents))
    floating = lambda a: any(jnp.issubdtype(jnp.result_type(x), jnp.floating)
                             for x in jax.tree.leaves(a) if _is_array_like(x))
    checked_args = tuple(f"{names[a]} (argnums={a})" for a in argnums)
    unchecked_args = tuple(
        f"{names[i]} (argnums={i}{'' if floating(args[i]) else ', nothing floating'})"
        for i in range(len(args)) if i not in argnums)
    return dict(who=who, checked_args=checked_args, unchecked_args=unchecked_args,
                spec=spec, theta=theta, leaves=leaves, cotangents=cotangents, paths=paths,
                shapes=shapes, skipped=skipped, dtype_used=dtype_used,
                notes=notes, out_layout=out_layout, names=names, args=args)


def _is_array_like(x) -> bool:
    try:
        jnp.result_type(x)
        return True
    except TypeError:  # a typed PRNG key
        return False


def _raw_output(who, spec, theta, leaves):
    """fn's output (without its aux); ValueError for an output that cannot be checked."""
    out = spec.fn(*obj.unflatten(spec, theta, leaves))
    if spec.has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ValueError(f"{who}: has_aux=True expects fn to return a pair (output, "
                             f"aux), but it returned {_kind(out)}. Return (loss, aux), or drop "
                             "has_aux.")
        out = out[0]
    if not jax.tree.leaves(out):
        raise ValueError(f"{who}: fn returned {_kind(out)}, with no array to check. "
                         "Return the loss (a floating scalar or array), e.g. `return loss`.")
    return out


def _kind(out) -> str:
    if out is None:
        return "None"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}"
    return f"{type(out).__name__} with shape {tuple(np.shape(out))}"


def _aux_hint(out_tree, has_aux) -> list[str]:
    """A note when fn returns a pair (scalar, something) without has_aux: both were checked."""
    if has_aux or not (isinstance(out_tree, (tuple, list)) and len(out_tree) == 2):
        return []
    first = jax.tree.leaves(out_tree[0])
    if len(first) == 1 and first[0].shape == ():
        return ["fn returned a pair (scalar, ...): all of it was checked, as uᵀJ of every "
                "output. If the second part is auxiliary (metrics, new state), pass "
                "has_aux=True to check the scalar alone."]
    return []


def allowed_stop_gradient(who, allow, paths) -> tuple[bool, ...]:
    """One flag per differentiated leaf: may it differ because of stop_gradient? `allow` is a
    bool, a path or paths; a path covers itself and the leaves under it. ValueError for a path
    that names no differentiated leaf (a typo must not silently allow nothing)."""
    if isinstance(allow, (bool, np.bool_)):
        return tuple(bool(allow) for _ in paths)
    names = (allow,) if isinstance(allow, str) else tuple(allow)
    if not all(isinstance(a, str) for a in names):
        raise TypeError(f"{who}: allow_stop_gradient must be a bool, a leaf path or leaf "
                        f"paths (str), got {allow!r}.")
    covers = lambda name, path: path == name or (path.startswith(name) and
                                                 path[len(name)] in "[.")
    for name in names:
        if not any(covers(name, p) for p in paths):
            raise ValueError(f"{who}: allow_stop_gradient names {name!r}, which is not a "
                             f"differentiated leaf or a prefix of one; the leaves are: "
                             f"{', '.join(paths)}.")
    return tuple(any(covers(name, p) for name in names) for p in paths)


def left_out_lines(fields: list[LeftOut]) -> list[str]:
    """A report's ``skipped`` lines for the Python float fields of an equinox module."""
    return [f"{field.name} ({field.reason})" for field in fields]

