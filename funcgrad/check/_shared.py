"""What the full and directional checks share (private): the problem's leaf segments, the
output's finiteness and round-off scale, the stop_gradient see-through gradient and the custom
rules' reference gradient (each a compiled kernel cached on the static spec), the masked
difference kernel, and the report's notes on stop_gradient and custom_vjp.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.check import _lift, _noise
from funcgrad.check import _objective as obj
from funcgrad.check._full_pass import basis_jvp

#: Full mode perturbs one leaf element at a time; a vmapped chunk of c perturbations of an
#: n-element problem touches about c x n floats. 2^20 float64 (8 MiB) stays cache-friendly: on a
#: 2-core CPU, chunks of 64-256 perturbations of a 64-64-10 MLP ran faster than chunks of 3,500.
_CHUNK_ELEMENTS = 1 << 20


def _check_finite_output(prob, out):
    bad = ~np.isfinite(out)
    if bad.any():
        # Map the first bad element of the raveled output back to its output leaf and index.
        first = int(np.argmax(bad))
        for path, shape, start in prob["out_layout"]:
            size = math.prod(shape)
            if first < start + size:
                index = tuple(int(i) for i in np.unravel_index(first - start, shape))
                where = "output" + path
                break
        point = ", ".join(f"{n}: {_describe(a)}" for n, a in zip(prob["names"], prob["args"]))
        raise ValueError(
            f"{prob['who']}: the function's output is not finite at the primal point: "
            f"{int(bad.sum())} non-finite element(s), the first at "
            f"{where}{list(index) if index else ''} = "
            f"{out[first]}. Finite differences need a finite output there; move the point or "
            f"fix the function. Point: {point}.")


def _describe(a):
    leaves = jax.tree.leaves(a)
    if len(leaves) == 1 and leaves[0] is a:
        return f"{jnp.result_type(a)}{list(np.shape(a))}"
    return f"pytree of {len(leaves)} leaves"


def _segments(prob):
    sizes = [math.prod(s) for s in prob["shapes"]]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


@functools.partial(jax.jit, static_argnames=("spec",))
def _rev_kernel(spec, theta, leaves, cotangents):
    return jax.grad(lambda t: obj.objective(spec, t, leaves, cotangents))(theta)


@functools.partial(jax.jit, static_argnames=("spec", "chunk"))
def _fwd_grad_kernel(spec, theta, leaves, cotangents, *, chunk):
    """The gradient of phi in forward mode: one jvp per element, vmapped in chunks."""
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    n = theta.shape[0]
    c = min(chunk, n)
    ids = jnp.arange(-(-n // c) * c).reshape(-1, c)
    index = jnp.arange(n)
    column = jax.vmap(lambda i: basis_jvp(phi, theta, index, i))
    out = column(ids[0]) if ids.shape[0] == 1 else jax.lax.map(column, ids)
    return jnp.ravel(out)[:n]


@functools.partial(jax.jit, static_argnames=("spec", "eps", "jvp"))
def _masked_kernel(spec, theta, leaves, cotangents, direction, lo, hi, *, eps, jvp=False):
    """Central/one-sided differences along `direction` restricted to [lo, hi), unit-normalised;
    with `jvp`, also the jvp of phi along it (the analytic value a fwd-only check compares)."""
    phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cotangents)
    index = jnp.arange(theta.shape[0])
    v = jnp.where((index >= lo) & (index < hi), direction, 0.0)
    v = v / jnp.linalg.norm(v)
    out = v, phi(theta + eps * v), phi(theta - eps * v)
    return (*out, jax.jvp(phi, (theta,), (v,))[1]) if jvp else out


def _roundoff_scale(prob, f0, out):
    """S of `_noise.roundoff_scale` for this problem: |f| for a scalar output, Σ|u_k·y_k| for
    an output reduced by the cotangent u."""
    return _noise.roundoff_scale(f0, np.asarray(out, np.float64),
                                 np.asarray(prob["cotangents"][0]), prob["spec"].scalar_output)


_NO_FWD_NOTE = ("fwd skipped: fn uses a custom_vjp function, which cannot be "
                "forward-differentiated (jvp, jacfwd); rev checked only.")


_FWD_ONLY_CUSTOM_VJP = ("CheckOptions(modes=('fwd',)) but fn uses a custom_vjp function, "
                        "which cannot be forward-differentiated (jvp, jacfwd): nothing is left "
                        "to check. Use CheckOptions(modes=('rev',)) (the default checks rev and "
                        "notes the skip).")


def _sg_note(allowed, rows) -> str:
    """The report's note on stop_gradient: which leaves it cut, and how to declare them."""
    cut = [r.path for r in rows if r.status == "stop_gradient"]
    declared = [r.path for r in rows if r.status == "stop_gradient_declared"]
    text = "fn contains stop_gradient, which finite differences see through."
    if cut:
        text += (f" It changes the gradient of {', '.join(cut)} (cut, or replaced as in a "
                 "straight-through estimator): failed, since the check takes no stop_gradient "
                 "for granted (a weight detached by mistake trains no more). If it is "
                 "intended, declare it: "
                 f"allow_stop_gradient={cut!r}.")
    if declared:
        text += f" Declared cut (allow_stop_gradient): {', '.join(declared)}."
    return text


#: Most elements whose see-through gradient is taken in forward mode (one jvp each).
_FWD_SEE_THROUGH_LIMIT = 1 << 16


def _see_through_grad(prob, modes):
    """Gradient with stop_gradient made transparent, or None if the program has none.

    In reverse mode, or in forward mode (one jvp per element, up to `_FWD_SEE_THROUGH_LIMIT`
    elements) when only "fwd" is checked or reverse mode fails: with stop_gradient gone, a
    while_loop may come to depend on theta, and only forward mode differentiates it."""
    spec, theta, leaves, cots = prob["spec"], prob["theta"], prob["leaves"], prob["cotangents"]
    jaxpr = jax.make_jaxpr(lambda t: obj.objective(spec, t, leaves, cots))(theta)
    if not obj.has_stop_gradient(jaxpr):
        return None
    return _grad_of_variant(prob, spec._replace(see_through_stop_gradient=True), modes)


def _grad_of_variant(prob, variant, modes):
    """The gradient of the objective under `variant` (a Spec with an interpreter flag set), in
    reverse mode, else in forward mode (one jvp per element, up to `_FWD_SEE_THROUGH_LIMIT`);
    None when neither can be taken (a primitive that cannot be re-bound, too many elements)."""
    theta, leaves, cots = prob["theta"], prob["leaves"], prob["cotangents"]
    if "rev" in modes:
        try:
            return np.asarray(_rev_kernel(variant, theta, leaves, cots))
        except Exception:  # noqa: BLE001 - e.g. a while_loop: try forward mode
            pass
    n = theta.shape[0]
    if n > _FWD_SEE_THROUGH_LIMIT:  # one jvp per element would take too long
        return None
    try:
        return np.asarray(_fwd_grad_kernel(variant, theta, leaves, cots,
                                           chunk=max(1, min(n, _CHUNK_ELEMENTS // max(n, 1)))))
    except Exception:  # noqa: BLE001 - a primitive we cannot re-bind
        return None


def _reference_grad(prob, modes):
    """JAX's own convention where fn has custom rules: the gradient of the same program with
    every custom_jvp/custom_vjp replaced by its primal, differentiated by JAX (in reverse mode,
    or forward mode as for the see-through gradient). None when fn has no custom rule (its
    gradient is its own reference); NaNs when that program cannot be differentiated."""
    spec, theta, leaves, cots = prob["spec"], prob["theta"], prob["leaves"], prob["cotangents"]
    first = spec._replace(order=1)  # custom_vjp calls are gone from a differentiated jaxpr
    if not _lift.has_custom_rule(jax.make_jaxpr(
            lambda t: obj.objective(first, t, leaves, cots))(theta)):
        return None
    grad = _grad_of_variant(prob, spec._replace(inline_custom_rules=True), modes)
    return np.full(theta.shape[0], np.nan) if grad is None else grad
