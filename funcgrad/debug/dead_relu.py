"""Dead ReLU units of a program, found by interpreting its jaxpr without touching the model.

`with_dead_relu` traces the function to a jaxpr and evaluates it equation by equation at trace
time, binding the same primitives; at every ``max(x, 0)`` (``jax.nn.relu`` or
``jnp.maximum(x, 0)``, also inside ``jit``, ``custom_jvp`` and ``checkpoint``) it also
returns, as a ``jnp`` value, which units have a pre-activation ``x <= 0`` for every example.
Units lie along the feature axis of the layer feeding the ReLU (the channel axis of a
convolution in any layout, the output axis of a dense layer; `funcgrad.debug._relu_axes`), and the
variance clamps of normalisation layers are not ReLUs. Sites are named by order and source
line. `funcgrad.train.monitor` turns the result into
dead fractions and alerts (concept 16 of CONCEPTS.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import arg_names, interpret, source_line
from funcgrad._traced import traced_values
from funcgrad.debug._relu_axes import UNKNOWN_AXIS_NOTE as UNKNOWN_AXIS_NOTE
from funcgrad.debug._relu_axes import ReluAxes


@dataclasses.dataclass(frozen=True)
class DeadReLU:
    """The dead units of every ReLU in a program, for one batch.

    Attributes:
      dead: one bool array of shape (units,) per site: True where the unit's pre-activation
        (the ReLU's input) is <= 0 for every example of the batch and every position (a
        convolution's channel is one unit over all its pixels).
      names: static; one name per site in program order, ``"relu 0 at mlp.py:96:16 (mlp_apply)"``;
        when the feature axis could not be found from the program, the name ends with
        ``" [units on the last axis: feature axis not found ...]"``.
      axes: static; the axis of each site's input that holds its units (a tuple of axes,
        row-major, where a reshape has split the features over several).
    """
    dead: tuple[jax.Array, ...] = ()
    names: tuple[str, ...] = ()
    axes: tuple[int | tuple[int, ...], ...] = ()

    @property
    def fraction(self) -> jax.Array:
        """Shape (sites,), float32, dimensionless in [0, 1]: dead units over all units."""
        return jnp.asarray([jnp.mean(d, dtype=jnp.float32) for d in self.dead], jnp.float32)


jax.tree_util.register_dataclass(DeadReLU, data_fields=["dead"], meta_fields=["names", "axes"])

_INLINE = {"jit", "call"}  # kinds (`funcgrad._jax_internals.kind`) evaluated inline
# Bound unchanged (their derivative rules or remat policy must survive); ReLUs inside are
# recorded by a second, gradient-free evaluation of the body, which XLA merges with the first:
# custom_jvp, custom_vjp and checkpoint.


def _is_zero(v) -> bool:
    return ji.is_literal(v) and np.ndim(v.val) == 0 and float(v.val) == 0.0


def _body(eqn) -> tuple[Any, tuple] | None:
    """``(jaxpr, consts)`` of the call `eqn` makes (jit, call, checkpoint, custom rule)."""
    return ji.body(eqn)


def _has_relu(jaxpr, relus: ReluAxes) -> bool:
    for eqn in jaxpr.eqns:
        sub = _body(eqn)
        if relus.is_relu(eqn) or (sub is not None and _has_relu(sub[0], relus)):
            return True
    return False


def _dead_units(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    others = tuple(d for d in range(x.ndim) if d not in axes)
    return ~jnp.any(jax.lax.stop_gradient(x) > 0, axis=others).reshape(-1)


def _eval(jaxpr, consts, args, sites: list, where: str, relus: ReluAxes) -> list:
    """Evaluates `jaxpr`; appends ``(name, dead units, axis)`` to `sites` at every ReLU."""
    def rule(eqn, ins):
        here = source_line(eqn) or where
        sub = _body(eqn)
        if sub is not None and ji.kind(eqn) in _INLINE and _has_relu(sub[0], relus):
            return _eval(*sub, ins[len(ins) - len(sub[0].invars):], sites, here, relus)
        if relus.is_relu(eqn):
            x = ins[1] if _is_zero(eqn.invars[0]) else ins[0]
            if jnp.ndim(x):
                axes, known = relus.unit_axes(eqn, jnp.shape(x))
                name = f"relu {len(sites)} at {here or '?'}"
                if not known and jnp.ndim(x) > 1:
                    name += f" [{UNKNOWN_AXIS_NOTE}]"
                sites.append((name, _dead_units(x, axes), axes[0] if len(axes) == 1 else axes))
        elif sub is not None and _has_relu(sub[0], relus):
            inner = [jax.lax.stop_gradient(a) for a in ins[len(ins) - len(sub[0].invars):]]
            _eval(*sub, inner, sites, here, relus)
        return None  # bind the primitive as is
    return interpret(jaxpr, consts, args, rule)


def with_dead_relu(fn: Callable) -> Callable[..., tuple[Any, DeadReLU]]:
    """Transforms `fn` to also return the dead units of every ReLU it applies.

    ``loss, dead = with_dead_relu(loss_fn)(params, batch)`` computes the same loss (the same
    primitives, bound in the same order; custom derivative rules such as ``jax.nn.relu``'s are
    kept) plus a `DeadReLU`, so ``jax.value_and_grad(with_dead_relu(loss_fn), has_aux=True)``
    gives gradients and dead units in one compiled pass. A unit is dead for the batch when
    its pre-activation is <= 0 for every example (relu'(z) = 0 there in JAX, so it passes no
    gradient). The units are the feature axis of the layer feeding the ReLU, found from the
    program: the output feature dimension of a convolution (axis 1 for channel-first NCHW as
    in equinox, the last axis for flax's NHWC), the output axis of a dense layer's weight
    (the ``dot_general`` operand that depends on the params and not on the data), followed
    through reshapes that split and merge it (GroupNorm) or named by a per-channel params
    vector (a norm's scale or bias); every other axis (batch, pixels) counts as examples.
    Where the axis cannot be found the last axis is used and the site's name says so (the
    monitor then alerts only when every value is <= 0). The params are argument 0
    (``loss_fn(params, batch)``), the data the other arguments; a dense layer whose weight or
    input is closed over falls back to the last axis. ``max(var, 0)`` clamps on a variance
    (inside flax or equinox LayerNorm / BatchNorm / GroupNorm) are not ReLUs.

    ReLUs are found as ``max(x, 0)`` with a literal zero, at top level and inside ``jit``,
    ``custom_jvp`` / ``custom_vjp`` functions and ``checkpoint``; ReLUs inside ``scan``,
    ``cond`` or ``while_loop`` bodies are not reported.

    Args:
      fn: a pure function of arrays and pytrees of arrays.
    Returns:
      a function of the same arguments returning ``(fn(*args), DeadReLU)``; jit-able.
    Raises:
      TypeError: if `fn` is not callable; when called, `funcgrad.TracedValueError` naming
        fn's line if it uses a traced value as a Python value (``if loss > 0:``), with the fix.
    """
    if not callable(fn):
        raise TypeError(f"with_dead_relu needs a callable, got {type(fn).__name__}.")

    def transformed(*args):
        with traced_values("with_dead_relu", fn, args, arg_names(fn, len(args)), (0,)):
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        sites: list[tuple[str, jax.Array, int]] = []
        relus = ReluAxes(closed.jaxpr, len(jax.tree.leaves(args[:1])))
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), sites, "", relus)
        out = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
        return out, DeadReLU(tuple(s[1] for s in sites), tuple(s[0] for s in sites),
                             tuple(s[2] for s in sites))

    return transformed
