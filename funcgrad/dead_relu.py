"""Dead ReLU units of a program, found by interpreting its jaxpr without touching the model.

`with_dead_relu` traces the function to a jaxpr and evaluates it equation by equation at trace
time, binding the same primitives; at every ``max(x, 0)`` (``jax.nn.relu`` or
``jnp.maximum(x, 0)``, also inside ``jit``, ``custom_jvp`` and ``checkpoint``) it also
returns, as a ``jnp`` value, which units (last axis) have a pre-activation ``x <= 0`` for every
example. Sites are named by order and source line. `funcgrad.monitor` turns the result into
dead fractions and alerts (concept 16 of CONCEPTS.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from funcgrad._jaxpr import closed_parts, interpret, source_line


@dataclasses.dataclass(frozen=True)
class DeadReLU:
    """The dead units of every ReLU in a program, for one batch.

    Attributes:
      dead: one bool array of shape (units,) per site: True where the unit's pre-activation
        (the ReLU's input; units are its last axis) is <= 0 for every example of the batch.
      names: static; one name per site in program order, ``"relu 0 at nn.py:96:16 (mlp_apply)"``.
    """
    dead: tuple[jax.Array, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def fraction(self) -> jax.Array:
        """Shape (sites,), float32, dimensionless in [0, 1]: dead units over all units."""
        return jnp.asarray([jnp.mean(d, dtype=jnp.float32) for d in self.dead], jnp.float32)


jax.tree_util.register_dataclass(DeadReLU, data_fields=["dead"], meta_fields=["names"])

_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
           "core_call": "call_jaxpr"}
# Bound unchanged (their derivative rules or remat policy must survive); ReLUs inside are
# recorded by a second, gradient-free evaluation of the body, which XLA merges with the first.
_OPAQUE = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
           "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr"}


def _is_zero(v) -> bool:
    return isinstance(v, jex_core.Literal) and np.ndim(v.val) == 0 and float(v.val) == 0.0


def _is_relu(eqn) -> bool:
    return (eqn.primitive.name == "max" and len(eqn.invars) == 2
            and any(map(_is_zero, eqn.invars)) and not all(map(_is_zero, eqn.invars)))


def _body(eqn) -> tuple[jex_core.Jaxpr, tuple] | None:
    """``(jaxpr, consts)`` of the call `eqn` makes, if it is in `_INLINE` or `_OPAQUE`."""
    name = eqn.primitive.name
    key = _INLINE.get(name) or _OPAQUE.get(name)
    return closed_parts(eqn.params[key]) if key in eqn.params else None


def _has_relu(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        sub = _body(eqn)
        if _is_relu(eqn) or (sub is not None and _has_relu(sub[0])):
            return True
    return False


def _dead_units(x: jax.Array) -> jax.Array:
    return ~jnp.any(jax.lax.stop_gradient(x) > 0, axis=tuple(range(x.ndim - 1)))


def _eval(jaxpr, consts, args, sites: list, where: str) -> list:
    """Evaluates `jaxpr`; appends ``(name, dead units)`` to `sites` at every ``max(x, 0)``."""
    def rule(eqn, ins):
        here = source_line(eqn) or where
        sub = _body(eqn)
        if sub is not None and eqn.primitive.name in _INLINE and _has_relu(sub[0]):
            return _eval(*sub, ins[len(ins) - len(sub[0].invars):], sites, here)
        if _is_relu(eqn):
            x = ins[1] if _is_zero(eqn.invars[0]) else ins[0]
            if jnp.ndim(x):
                sites.append((f"relu {len(sites)} at {here or '?'}", _dead_units(x)))
        elif sub is not None and _has_relu(sub[0]):
            inner = [jax.lax.stop_gradient(a) for a in ins[len(ins) - len(sub[0].invars):]]
            _eval(*sub, inner, sites, here)
        return None  # bind the primitive as is
    return interpret(jaxpr, consts, args, rule)


def with_dead_relu(fn: Callable) -> Callable[..., tuple[Any, DeadReLU]]:
    """Transforms `fn` to also return the dead units of every ReLU it applies.

    ``loss, dead = with_dead_relu(loss_fn)(params, batch)`` computes the same loss (the same
    primitives, bound in the same order; custom derivative rules such as ``jax.nn.relu``'s are
    kept) plus a `DeadReLU`, so ``jax.value_and_grad(with_dead_relu(loss_fn), has_aux=True)``
    gives gradients and dead units in one compiled pass. A unit is dead for the batch when
    its pre-activation is <= 0 for every example (relu'(z) = 0 there in JAX, so it passes no
    gradient); "units" are the last axis, "examples" all the others.

    ReLUs are found as ``max(x, 0)`` with a literal zero, at top level and inside ``jit``,
    ``custom_jvp`` / ``custom_vjp`` functions and ``checkpoint``; ReLUs inside ``scan``,
    ``cond`` or ``while_loop`` bodies are not reported.

    Args:
      fn: a pure function of arrays and pytrees of arrays.
    Returns:
      a function of the same arguments returning ``(fn(*args), DeadReLU)``; jit-able.
    Raises:
      TypeError: if `fn` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"with_dead_relu needs a callable, got {type(fn).__name__}.")

    def transformed(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        sites: list[tuple[str, jax.Array]] = []
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), sites, "")
        out = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
        return out, DeadReLU(tuple(d for _, d in sites), tuple(n for n, _ in sites))

    return transformed
