"""Gradients of intermediate values: PyTorch's ``retain_grad`` as a transformation.

Name a value inside a pure function with ``h = tap("hidden", h)``. On its own, a tap is the
identity: it is a primitive that lowers to nothing, so a jitted function with taps compiles to
the same program as one without (``benchmarks/taps.py`` measures it). `intermediate_grads`
transforms the function so that it also returns d(output)/d(each tapped value).

How: the function is traced to a jaxpr, and every tap site is replaced by ``x + p`` where ``p``
is an extra input, zero in value; the gradient with respect to ``p`` is the cotangent that
reaches the tapped value, i.e. d(loss)/d(value) — the "perturbation" method (as in flax's
``Module.perturb``), applied to the program rather than to a module.

Where taps may sit, and what shape their gradients have:
  * at top level, inside ``jax.jit`` (nested calls are evaluated inline) and inside
    ``jax.checkpoint`` (kept, with its policy): the tapped value's shape;
  * inside ``jax.vmap``: the batched shape, one row per mapped example (the jaxpr sees the
    batched value, with the batch axis where vmap put it: first, unless ``in_axes`` moved
    it). A tapped value that does not depend on the mapped input is not batched: it is one
    value shared by every example, and its gradient is the sum over the examples;
  * inside ``lax.scan`` (nested scans too): stacked over iterations, shape
    ``(length, *value_shape)``; under ``vmap`` around the scan, ``(length, batch, ...)``:
    the scan's axis comes first, as the vmapped program runs it;
  * inside ``lax.cond`` / ``lax.switch`` branches: the branch's value; zero when the branch
    was not taken. One name may sit in several branches (only one runs) when its shape and
    dtype are the same in each: the gradient is that of the branch taken;
  * not inside ``while_loop`` (it cannot be reverse-differentiated) or inside a
    ``custom_jvp`` / ``custom_vjp`` function (their rules cannot see the perturbation):
    both raise ValueError.
Names must be unique within one call of the function: a repeated name raises ValueError naming
both sites (a tap inside a scan body is one site and gives one value per iteration; one tap
line traced twice, as ``lax.map(f, xs, batch_size=b)`` does when b does not divide the length,
is two sites). Keyword arguments are passed through and not differentiated, as in ``jax.grad``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.extend import source_info_util
from jax.interpreters import ad, batching, mlir

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import arg_names, check_array_args, interpret, source_line
from funcgrad._library_objects import split_equinox_args
from funcgrad._traced import traced_values

tap_p = jex_core.Primitive("tap")
tap_p.def_impl(lambda x, *, name: x)
tap_p.def_abstract_eval(lambda aval, *, name: aval)
ad.defjvp(tap_p, lambda tangent, x, *, name: tangent)
batching.primitive_batchers[tap_p] = lambda args, dims, *, name: (tap_p.bind(args[0], name=name),
                                                                   dims[0])
mlir.register_lowering(tap_p, lambda ctx, x, *, name: [x])
# Source lines of tap sites name the caller of `tap`, not this file.
source_info_util.register_exclusion(__file__)


def tap(name: str, x: jax.Array) -> jax.Array:
    """Names the intermediate value `x` so that `intermediate_grads` can return its gradient.

    Args:
      name: a non-empty string, unique within one call of the function being transformed.
      x: a floating-point array of any shape (a tracer inside jit/vmap/scan is fine).
    Returns:
      `x` itself (same shape, dtype and value). Without `intermediate_grads` around the
      function, the tap is the identity and compiles to nothing.
    Raises:
      TypeError: if `name` is not a non-empty string, or `x` is not a floating-point array
        (an integer value has no gradient).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"tap: name must be a non-empty string, got {name!r}.")
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"tap({name!r}, x): x must be a floating-point array, got dtype {dtype}. "
                        "Only floating values have gradients; tap the float value it came from.")
    return tap_p.bind(jnp.asarray(x), name=name)


class _Site(NamedTuple):
    name: str
    shape: tuple[int, ...]   # including the leading scan lengths
    dtype: Any
    where: str


_INLINE = {"jit", "call"}  # kinds, `funcgrad._jax_internals.kind`
_OPAQUE = {"custom_jvp": "a custom_jvp function", "custom_vjp": "a custom_vjp function",
           "while": "a while_loop"}


def _has_tap(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is tap_p:
            return True
        if any(_has_tap(sub) for _, sub, _ in ji.sub_jaxprs(eqn)):
            return True
    return False


def _find_sites(jaxpr, prefix: tuple[int, ...], sites: dict[str, _Site]) -> None:
    for eqn in jaxpr.eqns:
        name = ji.kind(eqn)
        if eqn.primitive is tap_p:
            tap_name = ji.param(eqn, "name")
            aval = eqn.invars[0].aval
            site = _Site(tap_name, prefix + tuple(aval.shape), aval.dtype, source_line(eqn))
            if tap_name in sites:
                _twice(sites[tap_name], site)
            sites[tap_name] = site
        elif name in _INLINE or name == "checkpoint":
            _find_sites(ji.call_body(eqn)[0], prefix, sites)
        elif name == "scan":
            s = ji.scan(eqn)
            _find_sites(s.body, prefix + (s.length,), sites)
        elif name == "cond":  # one branch runs: a name may recur across branches
            merged: dict[str, _Site] = {}
            for branch, _ in ji.cond_branches(eqn):
                local: dict[str, _Site] = {}
                _find_sites(branch, prefix, local)
                for tap_name, site in local.items():
                    if tap_name in sites:
                        _twice(sites[tap_name], site)
                    first = merged.setdefault(tap_name, site)
                    if (first.shape, first.dtype) != (site.shape, site.dtype):
                        raise ValueError(
                            f"tap name {tap_name!r} sits in two branches of one cond with "
                            f"different values: shape {first.shape} {first.dtype} at "
                            f"{first.where or '?'} and {site.shape} {site.dtype} at "
                            f"{site.where or '?'}. One name needs one shape and dtype; use "
                            "distinct names.")
            sites.update(merged)
        elif name in _OPAQUE and any(_has_tap(sub) for _, sub, _ in ji.sub_jaxprs(eqn)):
            raise ValueError(
                f"a tap sits inside {_OPAQUE[name]} (at {source_line(eqn) or '?'}); "
                "intermediate_grads cannot reach it there. Move the tap outside that function.")


def _twice(first: _Site, second: _Site) -> None:
    """ValueError for a tap name used by two sites that can both run in one call."""
    same_line = first.where and first.where == second.where
    why = (" The same line was traced twice: a function called twice, or lax.map with a "
           "batch_size that leaves a remainder (which runs the last examples separately); "
           "pass a batch_size that divides the length, or tap outside lax.map."
           if same_line else " A tap inside a lax.scan body is one site and already gives one "
           "value per iteration.")
    why += (" If the two sites are the branches of one lax.cond under jax.vmap: a predicate "
            "that differs between examples runs both branches (vmap turns it into a select), "
            "so use two names and add their gradients, or put vmap outside "
            "intermediate_grads.")
    raise ValueError(
        f"tap name {second.name!r} is used twice in one call: at {first.where or '?'} (shape "
        f"{first.shape}) and at {second.where or '?'} (shape {second.shape}). Names must be "
        f"unique; use distinct names (e.g. f'{second.name}{{i}}').{why}")


def _eval(jaxpr, consts, args, perts: dict[str, jax.Array]):
    """Evaluates `jaxpr`, replacing each tap site by ``x + perts[name]``."""
    def rule(eqn, ins):
        name = ji.kind(eqn)
        if eqn.primitive is tap_p:
            return [ins[0] + perts[ji.param(eqn, "name")].astype(ins[0].dtype)]
        if not any(_has_tap(sub) for _, sub, _ in ji.sub_jaxprs(eqn)):
            return None
        if name in _INLINE:
            return _eval(*ji.call_body(eqn), ins, perts)
        if name == "checkpoint":  # keep the rematerialisation around the interpreted body
            c = ji.checkpoint(eqn)
            return jax.checkpoint(lambda *a: _eval(c.body, c.body_consts, a, perts),
                                  prevent_cse=c.prevent_cse, policy=c.policy)(*ins)
        if name == "scan":
            return _eval_scan(eqn, ins, perts)
        if name == "cond":
            return _eval_cond(eqn, ins, perts)
        raise AssertionError(f"unexpected tap inside {name}")  # _find_sites rejected the rest
    return interpret(jaxpr, consts, args, rule)


def _eval_scan(eqn, ins, perts):
    s = ji.scan(eqn)
    n_consts, n_carry = s.num_consts, s.num_carry
    consts, init, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    inner: dict[str, _Site] = {}
    _find_sites(s.body, (), inner)
    names = sorted(inner)

    def step(carry, x):
        xs_t, perts_t = x
        outs = _eval(s.body, s.body_consts, [*consts, *carry, *xs_t],
                     {**perts, **dict(zip(names, perts_t))})
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(step, list(init), (list(xs), [perts[n] for n in names]),
                             length=s.length, reverse=s.reverse, unroll=s.unroll)
    return [*carry, *ys]


def _eval_cond(eqn, ins, perts):
    index, ops = ins[0], ins[1:]
    branches = [lambda *o, j=j, c=c: _eval(j, c, o, perts) for j, c in ji.cond_branches(eqn)]
    return list(jax.lax.switch(index, branches, *ops))


def _check_output(out_shape: Any, has_aux: bool) -> None:
    """ValueError unless the output is a real scalar (the first of a pair with `has_aux`)."""
    def scalar(x):
        return (isinstance(x, jax.ShapeDtypeStruct) and x.shape == ()
                and jnp.issubdtype(x.dtype, jnp.floating))

    def describe(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return f"an array of shape {x.shape} and dtype {x.dtype}"
        return (f"a {type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list))
                else f"a pytree {jax.tree.structure(x)}")

    pair = isinstance(out_shape, (tuple, list)) and len(out_shape) == 2
    if has_aux and not (pair and scalar(out_shape[0])):
        got = describe(out_shape[0]) if pair else describe(out_shape)
        raise ValueError(
            "intermediate_grads(has_aux=True) needs fn to return a pair (loss, aux) whose loss "
            f"is a real scalar; the {'loss' if pair else 'output'} is {got}. Return "
            "(loss, aux), or drop has_aux if fn returns the loss alone.")
    if has_aux or scalar(out_shape):
        return
    if pair and scalar(out_shape[0]):
        raise ValueError(
            "intermediate_grads: fn returns a pair whose first element is a scalar, "
            f"{describe(out_shape[0])}: a (loss, aux) output. Pass has_aux=True: "
            "intermediate_grads(fn, has_aux=True) returns ((loss, aux), grads, tap_grads).")
    raise ValueError(
        f"intermediate_grads: fn returns {describe(out_shape)}; gradients (of the arguments "
        "and of the taps) are those of a real scalar. Reduce it inside fn (e.g. .sum() or "
        ".mean()), or return (loss, aux) and pass has_aux=True; for the vᵀJ of a non-scalar "
        "output, return jnp.vdot(v, out).")


def intermediate_grads(fn: Callable, argnums: int | Sequence[int] = 0, *,
                       has_aux: bool = False) -> Callable:
    """Transforms `fn` to return its value, its gradient and the gradients of its taps.

    PyTorch's ``h.retain_grad()`` then ``loss.backward()`` then ``h.grad``, as one function:
    ``loss, grads, tap_grads = intermediate_grads(loss_fn)(params, batch)`` where
    ``tap_grads["hidden"]`` is d(loss)/d(h) for ``h = tap("hidden", h)`` inside `loss_fn`.

    Args:
      fn: ``fn(*args) -> scalar`` (or ``(scalar, aux)`` with `has_aux`), pure, with `tap`
        calls inside (anywhere it calls, including jitted, vmapped and scanned code).
      argnums: which positional arguments to differentiate, as in ``jax.grad``: their
        floating leaves; integer and PRNG-key leaves (an nnx RngCount, RngKey) get JAX's
        ``float0`` zeros, as with ``jax.grad(..., allow_int=True)``. An equinox module is
        taken as ``eqx.filter_grad`` takes it (grads None at its non-floating leaves).
      has_aux: whether `fn` returns ``(value, aux)``.
    Returns:
      A function of the same arguments (keyword arguments are passed to `fn` and not
      differentiated) returning ``(value, grads, tap_grads)`` (value is
      ``(value, aux)`` with `has_aux`): `grads` as ``jax.grad(fn, argnums)`` gives them;
      `tap_grads` a dict from tap name to an array of the tapped value's dtype and shape, with
      the batch axis where the tap sits under vmap and a leading ``length`` axis per enclosing
      scan (see the module docstring). The function can itself be jitted or vmapped.
    Raises:
      ValueError: when called, if a tap name is used twice (but for cond branches with the
        same shape), or a tap sits inside a while_loop or a custom_jvp/custom_vjp function; if
        the output is not a real scalar (a ``(loss, aux)`` pair without `has_aux` gets the
        has_aux hint, a non-scalar the hint to reduce it), or with `has_aux` not a pair whose
        first element is one; if `argnums` names no argument of the call (out of range).
      TypeError: when called, if an argument leaf is not an array or a number (its path is
        named); `funcgrad.TracedValueError` when `fn` uses a traced value as a Python value
        (``if h > 0:``, ``range(n)``): the message names fn's line and the fix.
    """
    if not callable(fn):
        raise TypeError(f"intermediate_grads needs a callable, got {type(fn).__name__}.")
    single = isinstance(argnums, int)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)  # (argnums,) if single

    def transformed(*args, **kwargs):
        of_arrays, args = split_equinox_args(fn, args, "intermediate_grads")  # floating arrays
        names = arg_names(fn, len(args))
        check_array_args("intermediate_grads", args, names)
        if any(isinstance(n, bool) or not isinstance(n, int) or not -len(args) <= n < len(args)
               for n in nums) or not nums:
            raise ValueError(f"intermediate_grads: argnums={argnums!r} must name positions of "
                             f"the {len(args)} argument(s) given (0 to {len(args) - 1}, or "
                             "negative from the end), as in jax.grad.")
        at = tuple(n % len(args) for n in nums)  # -1 is the last argument, as in jax.grad
        bound = functools.partial(of_arrays, **kwargs) if kwargs else of_arrays
        with traced_values("intermediate_grads", bound, args, names, at):
            closed, out_shape = jax.make_jaxpr(bound, return_shape=True)(*args)
        _check_output(out_shape, has_aux)
        sites: dict[str, _Site] = {}
        _find_sites(closed.jaxpr, (), sites)
        out_tree = jax.tree.structure(out_shape)
        zeros = {n: jnp.zeros(s.shape, s.dtype) for n, s in sites.items()}

        def with_perts(perts, *args):
            outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), perts)
            # An output the jaxpr holds as a literal (a constant aux) comes back as an array.
            outs = [o if isinstance(o, jax.Array) else jnp.asarray(o) for o in outs]
            return jax.tree.unflatten(out_tree, outs)

        # allow_int: integer and key leaves (an nnx RngCount, RngKey) are not differentiated
        # and get JAX's float0 zeros, as jax.grad(..., allow_int=True) gives them.
        value, grads = jax.value_and_grad(with_perts, argnums=(0, *(n + 1 for n in at)),
                                          has_aux=has_aux, allow_int=True)(zeros, *args)
        tap_grads, arg_grads = grads[0], grads[1:]
        return value, (arg_grads[0] if single else arg_grads), tap_grads

    return transformed
