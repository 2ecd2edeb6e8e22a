"""The scalar objective a gradient check differentiates: a user function seen as R^n -> R.

Private to `funcgrad.check`. The differentiated leaves are flattened into one float64 vector
``theta``; the function's output is reduced to a scalar by a fixed random cotangent when it is
not a scalar (so the check compares uᵀJ, a vector-Jacobian product, with its finite difference);
order k > 1 checks the gradient of ``<u_k, grad of order k-1>`` (Hessian-vector products).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad.check import _lift


class Spec(NamedTuple):
    """Everything static about the objective; hashable, so compiled checks are cached per spec."""
    fn: Callable
    has_aux: bool
    treedef: Any                      # of the whole args tuple
    diff_positions: tuple[int, ...]   # flat positions (in the args' leaves) that theta feeds
    shapes: tuple[tuple[int, ...], ...]
    order: int
    scalar_output: bool
    see_through_stop_gradient: bool = False
    lift_precision: bool = False       # narrow float casts lifted to float64 (funcgrad.check._lift)
    inline_custom_rules: bool = False  # custom_jvp/custom_vjp replaced by their primal
    # The differentiated leaves' own dtypes, when fn only runs with them (a flax nn.RNN's carry
    # is made in its param dtype): theta's float64 pieces are cast back before fn sees them,
    # and lifting then lifts fn's arithmetic to float64 (funcgrad.check._problem.setup).
    cast_to: tuple[str, ...] | None = None


def split(spec: Spec, theta: jax.Array) -> list[jax.Array]:
    """theta cut into the differentiated leaves, each reshaped to its leaf's shape."""
    sizes = [math.prod(s) for s in spec.shapes]
    pieces = jnp.split(theta, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [theta]
    return [p.reshape(shape) for p, shape in zip(pieces, spec.shapes)]


def unflatten(spec: Spec, theta: jax.Array, leaves: tuple) -> tuple:
    """The args tuple with theta's pieces put in place of the differentiated leaves."""
    return _args(spec, split(spec, theta), leaves)


def _args(spec: Spec, pieces: list, leaves: tuple) -> tuple:
    placed = list(leaves)
    if spec.cast_to is not None:
        pieces = [p.astype(d) for p, d in zip(pieces, spec.cast_to)]
    for pos, piece in zip(spec.diff_positions, pieces):
        placed[pos] = piece
    return jax.tree.unflatten(spec.treedef, placed)


def output_vector(spec: Spec, theta: jax.Array, leaves: tuple) -> jax.Array:
    """The function's output at theta, all output leaves raveled into one vector (dtype kept)."""
    return _output(spec, _args(spec, split(spec, theta), leaves))


def _output(spec: Spec, args: tuple) -> jax.Array:
    out = spec.fn(*args)
    if spec.has_aux:
        out = out[0]
    flat = [jnp.ravel(o) for o in jax.tree.leaves(out)]
    return jnp.concatenate(flat) if len(flat) > 1 else flat[0]


def objective(spec: Spec, theta: jax.Array, leaves: tuple, cotangents: tuple) -> jax.Array:
    """phi_order(theta): a scalar, float64 (computed in the function's own precision, or in
    float64 throughout with `spec.lift_precision`).

    cotangents[0] reduces a non-scalar output (unused for a scalar output); cotangents[k-1]
    (shape (n,)) reduces the order-(k-1) gradient for order k.
    """
    def phi1(t):
        y = output_vector(spec, t, leaves).astype(t.dtype)
        return y[0] if spec.scalar_output else jnp.dot(cotangents[0], y)

    phi = _lift.transform(phi1, _lift.Flags(spec.see_through_stop_gradient,
                                            spec.lift_precision, spec.inline_custom_rules))
    for k in range(1, spec.order):
        phi = _reduce_grad(phi, cotangents[k])
    return phi(theta)


def _reduce_grad(phi, u):
    return lambda t: jnp.dot(u, jax.grad(phi)(t))


# --- stop_gradient made transparent -------------------------------------------------------
# Finite differences see through stop_gradient; to tell "zero because of stop_gradient" from a
# wrong gradient, the check can differentiate the same program with stop_gradient replaced by
# the identity (`see_through_stop_gradient`, evaluated by funcgrad.check._lift).


def has_stop_gradient(jaxpr) -> bool:
    """Whether a (closed) jaxpr holds a stop_gradient, entering nested calls."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if ji.kind(eqn) == "stop_gradient":
            return True
        for _, sub, _ in ji.sub_jaxprs(eqn):
            if has_stop_gradient(sub):
                return True
    return False

