"""Custom gradients whose backward rule is checked: ``jax.custom_vjp`` that names a wrong cotangent.

Concept 14 (article A §3.4). PyTorch's ``torch.autograd.Function`` and JAX's ``jax.custom_vjp``
both let you replace the derivative of a function with your own rule, and both trust the rule to
return one cotangent per input, each of its input's shape and dtype. JAX's own check addresses
a wrong one as ``output[1]`` (a position in the tuple, no parameter name or dtype advice),
treats a single array returned for a pytree input as that array for every leaf, and lets
through a cotangent of the wrong floating dtype (float16 for a float32 input) and any value at
all for an integer input (jax 0.10).

`custom_vjp` is a drop-in for ``jax.custom_vjp`` that checks what ``bwd`` returned against the
primal inputs of that call, by parameter name and pytree path, before JAX sees it. Shapes,
dtypes and pytree structure are static, so the check is Python that runs while ``bwd`` is
traced, the first time a backward pass through the function is built (once per ``jit``
compilation, once per call when not jitted); the compiled program is the one JAX would have
built, with nothing added. Under ``vmap`` the check sees per-example shapes, as ``bwd`` does.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util

from funcgrad import _user_line
from funcgrad._dependence import DIFF, Path, flow
from funcgrad.check._cotangents import Spec, check_cotangents, describe

# Lines of this file are never "the user's line": the custom_vjp_call a CustomVJP makes is
# credited to the user's call of the function (explain_grads, find_nonfinite, trace).
source_info_util.register_exclusion(__file__)

PyTree = Any

#: The contract of ``bwd``, from PyTorch's ``Function.backward`` to ``custom_vjp``'s ``bwd``.
BWD_CONTRACT = """\
bwd(*nondiff_args, residuals, g) receives the residuals returned by fwd and the cotangent g of
the output (its shape and dtype), and returns a tuple with one cotangent per differentiable
input, in order, each with the input's pytree structure, shapes and dtypes:

    @custom_vjp
    def scale(x, w):                       # x: float32[3], w: float32[]
        return x * w

    def scale_fwd(x, w):
        return x * w, (x, w)               # ctx.save_for_backward(x, w)

    def scale_bwd(res, g):
        x, w = res
        return g * w                       # wrong: one array, not a tuple of two
        return (g * w, g * x)              # wrong: w is float32[] but g * x is float32[3]
        return (g * w, jnp.sum(g * x))     # right: w was broadcast, so its cotangent is a sum

    scale.defvjp(scale_fwd, scale_bwd)

None stands for a zero cotangent (PyTorch's None for an input that needs no gradient), for a
whole input or any subtree of it. An integer or boolean input has no gradient: return None for
it (or np.zeros(x.shape, jax.dtypes.float0)). Inputs listed in nondiff_argnums get no entry.
A None for a floating input that the output depends on zeroes every gradient upstream of it:
funcgrad warns (DroppedCotangentWarning) unless defvjp declares it, zero_cotangents=("w",).
"""


class DroppedCotangentWarning(UserWarning):
    """A custom VJP rule returned None for a floating input that its output depends on."""


def custom_vjp(fun: Callable | None = None, *,
               nondiff_argnums: Sequence[int] = ()) -> CustomVJP | Callable[[Callable], CustomVJP]:
    """Wraps `fun` like ``jax.custom_vjp``; its ``bwd`` rule is checked before JAX uses it.

    Use it exactly as ``jax.custom_vjp``: decorate the primal function, then attach the rule
    with ``f.defvjp(fwd, bwd)``. In PyTorch terms, `fun` is ``Function.forward`` without the
    ``ctx``, ``fwd`` returns ``(output, residuals)`` where ``forward`` would call
    ``ctx.save_for_backward(*residuals)``, and ``bwd(residuals, g)`` is ``Function.backward``
    (``g`` is ``grad_output``). The result is a function; there is no ``.apply``.

    Each time ``bwd`` is traced, what it returned is compared with the primal inputs of that
    call: a tuple (or list) with one entry per differentiable input; each entry either None
    (zero cotangent, also allowed for any subtree) or a pytree of the input's structure whose
    leaves have the primal leaf's shape and dtype. An integer or boolean leaf takes None or a
    ``jax.dtypes.float0`` array of its shape (JAX itself accepts, and ignores, anything there).
    A Python scalar counts as a JAX value would (``1.0`` is float32 of shape ()). See
    `BWD_CONTRACT` for a worked example.

    A None for a floating input leaf that the output depends on through a differentiable
    path (found by tracing a ``jax.jvp`` of `fun` with a tangent for that leaf alone, and
    following it to the output tangent in the jaxpr) drops its cotangent: every gradient
    upstream of that input is zero. That is warned about (`DroppedCotangentWarning`, naming
    the function, the bwd rule and the input leaf) unless declared with
    ``defvjp(fwd, bwd, zero_cotangents=("w",))``. If `fun` cannot be traced under ``jvp``
    (the reason for some custom rules), no warning is given.

    Not supported (use ``jax.custom_vjp`` directly): ``defvjp``'s ``symbolic_zeros`` and
    ``optimize_remat`` options, and ``nondiff_argnames``.

    Args:
      fun: the primal function, ``fun(*args) -> out`` with array or pytree arguments and
        outputs. When omitted, returns a decorator (``@custom_vjp(nondiff_argnums=(1,))``).
      nondiff_argnums: positions of arguments that are not differentiated and are passed to
        ``bwd`` first, as in ``jax.custom_vjp`` (hashable Python values such as floats or
        functions, never arrays computed inside ``jit``).
    Returns:
      a `CustomVJP`: call it like `fun`; attach the rule with ``.defvjp(fwd, bwd)``.
    Raises:
      TypeError: when a backward pass through the function is traced: ``bwd`` returned
        something other than a tuple or list, a tuple of the wrong length, a cotangent whose
        pytree structure differs from its input's, a leaf that is not an array, or a floating
        array for an integer or boolean input. The message names the input (``params['w']``)
        and gives the expected and the received structure.
      ValueError: when a backward pass is traced: a cotangent leaf's shape or dtype differs
        from its primal's; the message names every such leaf with the expected and received
        ``dtype[shape]``.
    Warns:
      DroppedCotangentWarning: when a backward pass is traced: bwd returned None for an
        input leaf the output depends on, not declared in ``zero_cotangents``.
    Example:
      >>> @custom_vjp
      ... def clipped_identity(x):
      ...     return x
      >>> clipped_identity.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))
      >>> jax.grad(lambda x: 3.0 * clipped_identity(x))(2.0)
      Array(1., dtype=float32, weak_type=True)
    """
    if fun is None:
        return functools.partial(CustomVJP, nondiff_argnums=nondiff_argnums)
    return CustomVJP(fun, nondiff_argnums=nondiff_argnums)


class CustomVJP:
    """A function with a checked custom VJP rule; made by `custom_vjp`.

    Attributes:
      fun: the primal function. fwd, bwd: the rule, None until `defvjp` is called.
      nondiff_argnums: sorted positions of the arguments that are not differentiated.
    """

    def __init__(self, fun: Callable, *, nondiff_argnums: Sequence[int] = ()):
        if not callable(fun):
            raise TypeError(f"custom_vjp: fun must be callable, got {type(fun).__name__}.")
        if isinstance(nondiff_argnums, int) or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in nondiff_argnums):
            raise TypeError("custom_vjp: nondiff_argnums must be a tuple of non-negative ints, "
                            f"e.g. (1,), got {nondiff_argnums!r}.")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.nondiff_argnums = tuple(sorted(set(nondiff_argnums)))
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None
        self.zero_cotangents: tuple[str, ...] = ()
        self._defvjp_at: _user_line.Location | None = None

    def defvjp(self, fwd: Callable, bwd: Callable, *, zero_cotangents: Sequence[str] = (),
               **options: Any) -> None:
        """Attaches the rule, as ``jax.custom_vjp.defvjp``.

        Args:
          fwd: ``fwd(*args) -> (out, residuals)``, with the arguments of `fun` (including the
            ``nondiff_argnums`` ones, in place); residuals are a pytree of arrays.
          bwd: ``bwd(*nondiff_args, residuals, g) -> tuple`` with one cotangent per
            differentiable argument, in order; `g` has the structure, shapes and dtypes of
            ``out``. Checked as described in `custom_vjp`.
          zero_cotangents: inputs (parameter names, ``"w"``) or input leaves / subtrees
            (``"p['b']"``) for which a None cotangent is intended although the output depends
            on them (a straight-through or gradient-blocking rule); no warning for those.
          **options: ``jax.custom_vjp.defvjp``'s ``symbolic_zeros`` and ``optimize_remat``
            are not supported: TypeError, with the advice to use ``jax.custom_vjp``.
        Warns:
          DroppedCotangentWarning: when a backward pass is built (`custom_vjp`), reported at
            the line of this ``defvjp`` call, where the rule is attached and where
            `zero_cotangents` would declare the None intended.
        """
        if options:
            raise TypeError(f"funcgrad's custom_vjp.defvjp does not support "
                            f"{', '.join(sorted(options))}: its check needs concrete zeros and "
                            "the plain rule. Use jax.custom_vjp directly for these options.")
        if not callable(fwd) or not callable(bwd):
            raise TypeError("custom_vjp.defvjp: fwd and bwd must be callables, got "
                            f"{type(fwd).__name__} and {type(bwd).__name__}.")
        if isinstance(zero_cotangents, str) or not all(
                isinstance(z, str) for z in zero_cotangents):
            raise TypeError("custom_vjp.defvjp: zero_cotangents must be a tuple of input "
                            f"names, e.g. ('w',), got {zero_cotangents!r}.")
        self.fwd, self.bwd = fwd, bwd
        self.zero_cotangents = tuple(zero_cotangents)
        self._defvjp_at = _user_line.user_location()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self.fun, "__name__", repr(self.fun))
        if self.fwd is None or self.bwd is None:
            raise TypeError(f"custom_vjp: {name} has no rule yet; call {name}.defvjp(fwd, bwd) "
                            "before calling it.")
        args = _positional(self.fun, name, args, kwargs)
        bad = [i for i in self.nondiff_argnums if i >= len(args)]
        if bad:
            raise ValueError(f"custom_vjp: nondiff_argnums={self.nondiff_argnums} names "
                             f"position(s) {bad}, but {name} was called with {len(args)} "
                             "positional argument(s).")
        names = _param_names(self.fun, len(args))
        diff = [i for i in range(len(args)) if i not in self.nondiff_argnums]
        spec = Spec(name, getattr(self.bwd, "__name__", repr(self.bwd)),
                     tuple(names[i] for i in diff), tuple(args[i] for i in diff),
                     tuple(names[i] for i in self.nondiff_argnums))
        user_bwd, fun, declared, at = self.bwd, self.fun, self.zero_cotangents, self._defvjp_at
        unknown = [z for z in declared
                   if not any(z == n or z.startswith(n + "[") for n in spec.names)]
        if unknown:
            raise ValueError(f"custom_vjp: zero_cotangents={declared} of {name} names "
                             f"{unknown}, which are not differentiable inputs; expected input "
                             f"names ({', '.join(spec.names)}) or their leaves (\"x['w']\").")

        @functools.wraps(user_bwd)  # JAX and explain_grads then name the user's rule
        def checked_bwd(*bwd_args):
            cts = check_cotangents(spec, user_bwd(*bwd_args))
            _warn_dropped(spec, cts, fun, args, self.nondiff_argnums, declared, at)
            return cts
        cast(Any, checked_bwd).input_names = spec.names  # read by explain_grads to name an input

        # A fresh jax.custom_vjp per call: checked_bwd closes over this call's primals, whose
        # shapes and dtypes are static even when they are tracers (inside jit or vmap).
        inner = jax.custom_vjp(self.fun, nondiff_argnums=self.nondiff_argnums)
        inner.defvjp(self.fwd, checked_bwd)
        return inner(*args)

    def __repr__(self) -> str:
        return f"<funcgrad.custom_vjp of {getattr(self.fun, '__name__', repr(self.fun))}>"


# --- dropped cotangents ------------------------------------------------------------------------

def _warn_dropped(spec, cts, fun, args, nondiff_argnums, declared, at) -> None:
    """Warns when a None cotangent stands for a floating leaf the output depends on; the
    warning is reported at `at`, the user's ``defvjp`` line (during the backward pass the
    user's frames on the stack are only the one that asked for the gradient)."""
    dropped = []  # (name of the leaf, position among the differentiable args, leaf index)
    for k, (name, primal, ct) in enumerate(zip(spec.names, spec.primals, cts)):
        flat = jax.tree_util.tree_flatten_with_path(primal)[0]
        if ct is None:
            none_paths = [path for path, _ in flat]
        else:
            ct_flat = jax.tree_util.tree_flatten_with_path(ct, is_leaf=lambda x: x is None)[0]
            covered = [path for path, c in ct_flat if c is None]
            none_paths = [path for path, _ in flat
                          if any(path[:len(c)] == c for c in covered)]
        for j, (path, leaf) in enumerate(flat):
            leaf_name = name + jax.tree_util.keystr(path)
            if (path in none_paths and _is_float_leaf(leaf)
                    and not any(leaf_name == z or leaf_name.startswith((z + "[", z + "."))
                                for z in declared)):
                dropped.append((leaf_name, k, j))
    if not dropped:
        return
    used = _depends(fun, args, nondiff_argnums, [(k, j) for _, k, j in dropped])
    for (leaf_name, _, _), dep in zip(dropped, used):
        if dep:
            primal_leaf = _leaf_of(spec, leaf_name, dropped)
            _user_line.warn(
                f"{spec.where} returned None (a zero cotangent) for {leaf_name} "
                f"({primal_leaf}), but {spec.fun_name}'s output depends on it through a "
                f"differentiable path: every gradient upstream of {leaf_name} will be zero. "
                f"Return its cotangent, or, if blocking it is intended, declare it: "
                f"{spec.fun_name}.defvjp(fwd, "
                f"{'bwd' if spec.bwd_name == '<lambda>' else spec.bwd_name}, "
                f"zero_cotangents=({leaf_name!r},)).",
                DroppedCotangentWarning, at)


def _leaf_of(spec, leaf_name, dropped) -> str:
    for name, k, j in dropped:
        if name == leaf_name:
            return describe(jax.tree.leaves(spec.primals[k])[j])
    return "?"


def _is_float_leaf(x) -> bool:
    try:
        return bool(jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact))
    except TypeError:
        return False


def _depends(fun, args, nondiff_argnums, leaves) -> list[bool]:
    """For each ``(differentiable arg position, leaf index)``: whether ``fun``'s output
    tangent depends on a tangent of that leaf alone, read from the jaxpr of ``jax.jvp``
    (JAX drops symbolic-zero tangents at stop_gradient, round, comparisons, ...). False for
    every leaf when `fun` cannot be traced under jvp: no verdict, no warning."""
    diff = [i for i in range(len(args)) if i not in nondiff_argnums]
    avals = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jax.typeof(x).dtype),
                          args[i]) for i in diff]

    def tangent_out(primals, seeds):
        full = list(args)
        for i, p in zip(diff, primals):
            full[i] = p
        tangents = []
        for k, p in enumerate(primals):
            flat, tree = jax.tree.flatten(p)
            ts = [jnp.zeros_like(x) if _is_float_leaf(x) else
                  np.zeros(jnp.shape(x), jax.dtypes.float0) for x in flat]
            for n, (kk, j) in enumerate(leaves):
                if kk == k:
                    ts[j] = seeds[n]
            tangents.append(jax.tree.unflatten(tree, ts))

        def of_diff(*ps):
            inner = list(full)
            for i, q in zip(diff, ps):
                inner[i] = q
            return fun(*inner)
        return jax.jvp(of_diff, tuple(primals), tuple(tangents))[1]

    seed_avals = [jax.tree.leaves(avals[k])[j] for k, j in leaves]
    try:
        closed = jax.make_jaxpr(tangent_out)(avals, seed_avals)
    except Exception:  # noqa: BLE001 - fun has no jvp (pure_callback, ...): no verdict
        return [False] * len(leaves)
    n_seed = len(seed_avals)
    n_all = len(closed.jaxpr.invars)
    in_deps: list[dict] = ([{} for _ in range(n_all - n_seed)]
                           + [{n: Path(DIFF, "")} for n in range(n_seed)])
    reached = set()
    for deps in flow(closed.jaxpr, in_deps):
        reached |= set(deps)
    return [n in reached for n in range(n_seed)]


# --- helpers --------------------------------------------------------------------------------

def _positional(fun, name, args, kwargs):
    """The call's arguments as positions, defaults filled in (what ``jax.custom_vjp`` does)."""
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):
        if kwargs:
            raise TypeError(f"custom_vjp: {name} has no inspectable signature; pass its "
                            "arguments by position.") from None
        return tuple(args)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    passed = [k for k in bound.kwargs if k in kwargs]
    if passed:
        raise TypeError(f"custom_vjp: keyword-only argument(s) {passed} of {name} cannot be "
                        "differentiated through a custom VJP; make them positional.")
    return tuple(bound.args)


def _param_names(fun, n):
    """Names of the first `n` positional parameters (``args[i]`` past a ``*args``)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [positional[i] if i < len(positional) else f"args[{i}]" for i in range(n)]
