"""Why is this leaf's gradient zero? One status per parameter leaf, with the reason.

PyTorch gives ``None`` for a parameter that never reached the loss; JAX gives zeros, and the same
zeros for a parameter behind ``stop_gradient``, behind ``round``, or behind a dead ReLU layer.
`explain_grads` tells them apart (article A §4.1 and §6, B §5.2; concept 15 of CONCEPTS.md):

  ``connected``                      the gradient is non-zero;
  ``unused``                         the loss does not depend on the leaf at all (PyTorch: None);
  ``blocked_by_stop_gradient``       it depends on it only through ``stop_gradient``;
  ``blocked_by_zero_derivative_op``  only through ops whose derivative is zero everywhere it is
                                     defined: round, floor, ceil, sign, comparisons, argmax /
                                     argmin, casts to integer or bool, ...;
  ``numerically_zero``               connected through differentiable ops, but the gradient is
                                     exactly zero for this input (dead ReLU units, saturation, a
                                     ``where`` branch no example took);
  ``nonfinite``                      the gradient holds a NaN or inf (`funcgrad.find_nonfinite`
                                     locates the primitive and line that made it);
  ``not_differentiable``             an integer or boolean leaf (it has no gradient);
  ``static``                         a Python float field of an equinox module
                                     (``self.scale = 0.5``): equinox treats it as static, so
                                     it is closed over, not differentiated, and never trains
                                     (the detail gives the fix, ``jnp.asarray(0.5)``).

Complex leaves are differentiated like real ones (JAX's convention for a real loss of a
complex parameter, ``jax.grad``'s output).

The structural questions are answered from the program, not from the numbers:
  * *does the loss depend on the leaf at all* — a dependence analysis of the jaxpr of the loss
    (entering jit, custom_jvp/vjp, remat, scan with a fixpoint over the carry, cond, while);
  * *is there a differentiable path* — the same analysis run on the linear jaxpr of
    ``jax.linearize``: JAX's own derivative rules drop a tangent that is a symbolic zero
    (stop_gradient, round, comparisons, custom rules), so a leaf whose tangent input does not
    reach the tangent output has no differentiable path. Custom derivative rules are
    therefore judged by what they do (a straight-through estimator around ``round`` counts as
    connected);
  * *what blocks it* — the dependence analysis again, now tracking for each leaf the best
    kind of path (differentiable > through stop_gradient > through a zero-derivative op) and
    where the path was cut (primitive and source line). A ``custom_vjp`` rule whose pullback
    gives an input a cotangent that ignores the output cotangent (``bwd`` returned None or
    zeros) while the function's output depends on that input cuts the path there: the row
    names the function, its ``bwd`` and their lines (`funcgrad.debug._custom_rules`).
Only ``numerically_zero`` and ``nonfinite`` need the numbers: the gradient itself, and the
ReLU units' activations (a unit is *dead for this batch* when its pre-activation is <= 0 for
every example, so its derivative, relu'(z) = 0 for z <= 0 in JAX, is zero for every example;
units lie along the feature axis of the layer feeding the ReLU, found from the program by
`funcgrad.debug._relu_axes`, and variance clamps in normalisation layers are not ReLUs;
inside ``scan`` a unit is dead when that holds at every iteration, inside ``cond`` the branch
taken is the one looked at).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._dependence import DIFF, STOP, ZERO, Path, flow
from funcgrad._dependence import ZERO_DERIVATIVE_PRIMITIVES as ZERO_DERIVATIVE_PRIMITIVES
from funcgrad._jaxpr import arg_names, check_array_args, leaf_paths
from funcgrad._library_objects import is_inexact_array, left_out_fields, split_equinox_args
from funcgrad._traced import traced_values
from funcgrad.debug._custom_rules import dropped_inputs
from funcgrad.debug._relu_sites import ReluSite as ReluSite
from funcgrad.debug._relu_sites import _relu_sites

STATUSES = ("connected", "unused", "blocked_by_stop_gradient", "blocked_by_zero_derivative_op",
            "numerically_zero", "nonfinite", "not_differentiable", "static")

@dataclasses.dataclass(frozen=True)
class LeafExplanation:
    """One row of `explain_grads`.

    Attributes:
      path: the leaf's name by pytree path, e.g. ``params[0]['w']``.
      shape, dtype: the leaf's.
      status: one of `STATUSES`.
      grad_norm: L2 norm of the leaf's gradient (0.0 for a leaf that is not differentiated).
      detail: the reason in words: the primitive and source line that cut the path, or the
        dead ReLU units, or "".
    """
    path: str
    shape: tuple[int, ...]
    dtype: str
    status: str
    grad_norm: float
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class GradExplanation:
    """What `explain_grads` returns: one `LeafExplanation` per parameter leaf.

    ``print(report)`` shows a table; ``report.to_dict()`` gives plain data; ``report[path]``
    looks a row up by its path; ``report.status(path)`` gives its status.
    """
    rows: tuple[LeafExplanation, ...]
    loss: float
    relus: tuple[ReluSite, ...]

    def __getitem__(self, path: str) -> LeafExplanation:
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(f"no leaf {path!r}; leaves are {[r.path for r in self.rows]}")

    def status(self, path: str) -> str:
        return self[path].status

    def to_dict(self) -> dict:
        return {"loss": self.loss,
                "leaves": [dataclasses.asdict(r) | {"shape": list(r.shape)} for r in self.rows],
                "relus": [dataclasses.asdict(s) | {"dead_fraction": s.dead_fraction}
                          for s in self.relus]}

    def __str__(self) -> str:
        w = max([len("leaf")] + [len(r.path) for r in self.rows])
        ws = max([len("shape")] + [len(str(list(r.shape))) for r in self.rows]) + 2
        lines = [f"explain_grads: loss = {self.loss:.6g}",
                 f"  {'leaf':<{w}}  {'shape':<{ws}}{'status':<31}{'grad norm':>11}  detail"]
        for r in self.rows:
            lines.append(f"  {r.path:<{w}}  {str(list(r.shape)):<{ws}}{r.status:<31}"
                         f"{r.grad_norm:>11.3g}  {r.detail}")
        for s in self.relus:
            line = (f"  ReLU at {s.where or '?'}: {s.dead}/{s.units} units dead for this "
                    f"batch ({100 * s.dead_fraction:.0f}%)")
            if isinstance(s.axis, tuple):  # features split over several axes by a reshape
                line += f", units along axes {s.axis} (row-major)"
            elif s.axis >= 0:
                line += f", units along axis {s.axis}"
            if s.note:
                line += f" [{s.note}]"
            if s.dead_per_iteration:
                line += (f" every one of the {len(s.dead_per_iteration)} times it ran in a "
                         f"scan; dead per run: {_counts(s.dead_per_iteration)}")
            lines.append(line)
        return "\n".join(lines)


def explain_grads(loss_fn: Callable, params: Any, *args: Any,
                  has_aux: bool = False) -> GradExplanation:
    """Explains, leaf by leaf, whether and why ``jax.grad(loss_fn)(params, *args)`` is zero.

    Args:
      loss_fn: ``loss_fn(params, *args) -> scalar`` (or ``(scalar, aux)`` with `has_aux`), a
        pure function; may use jit, vmap, scan, cond, custom_jvp/vjp inside.
      params: the pytree differentiated (argument 0), of arrays of any shapes (an equinox
        module: its floating arrays, the rest closed over).
      *args: the other arguments (a batch, labels...), not differentiated.
      has_aux: whether `loss_fn` returns ``(loss, aux)``.
    Returns:
      A `GradExplanation`: one row per leaf of `params` in ``jax.tree.leaves`` order, with its
      status (see the module docstring), gradient norm and the reason; plus every ReLU found
      in the program with its dead units for this input.
    Raises:
      TypeError: if `loss_fn` is not callable, or an argument is not an array or a number;
        `funcgrad.TracedValueError` (a TypeError) when `loss_fn` uses a traced value as a
        Python value (``if loss > 0:``): the message names its line and the fix.
      ValueError: if the loss is not a real scalar, or its gradient cannot be taken in reverse
        mode (a ``lax.while_loop``, or ``fori_loop`` with traced bounds, that depends on
        `params`; the message says so).
    """
    if not callable(loss_fn):
        raise TypeError(f"explain_grads needs a callable loss_fn, got {type(loss_fn).__name__}.")
    left_out = left_out_fields(loss_fn, (params, *args), (0,))  # rows of status "static"
    kept = [i for i, x in enumerate(jax.tree.leaves(params)) if is_inexact_array(x)]
    loss_fn, split_args = split_equinox_args(loss_fn, (params, *args))
    params, args = split_args[0], split_args[1:]
    names = arg_names(loss_fn, 1 + len(args))
    check_array_args("explain_grads", (params, *args), names)
    paths = leaf_paths((params,), names[:1])
    p_leaves, p_tree = jax.tree.flatten(params)
    with traced_values("explain_grads", loss_fn, (params, *args), names, (0,)):
        closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(params, *args)
    loss_shape = out_shape[0] if has_aux else out_shape
    if not (hasattr(loss_shape, "shape") and loss_shape.shape == ()
            and jnp.issubdtype(loss_shape.dtype, jnp.floating)):
        got = (f"shape {tuple(loss_shape.shape)} dtype {loss_shape.dtype}"
               if hasattr(loss_shape, "shape") else type(loss_shape).__name__)
        integer = [path for path, x in zip(paths, p_leaves)
                   if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
        if integer and getattr(loss_shape, "shape", None) == ():  # an integer scalar loss
            fix = (f"The params leaf {integer[0]} is an integer array (e.g. jnp.arange(3)); "
                   "integer params have no gradient: make them float (jnp.arange(3.0), "
                   "x.astype(jnp.float32)).")
        else:
            fix = "Reduce it (e.g. .mean()) or pass has_aux=True."
        raise ValueError(f"explain_grads needs loss_fn to return a real scalar loss"
                         f"{' as the first element of (loss, aux)' if has_aux else ''}; got "
                         f"{got}. {fix}")
    floating = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in p_leaves]
    n_all = len(closed.jaxpr.invars)
    in_deps = [({i: Path(DIFF, "")} if i < len(p_leaves) and floating[i] else {})
               for i in range(n_all)]
    drops = dropped_inputs(closed.jaxpr)
    primal = flow(closed.jaxpr, in_deps, drops=drops)[0]

    diff_idx = [i for i, f in enumerate(floating) if f]

    def of_floats(float_leaves):
        leaves = list(p_leaves)
        for i, x in zip(diff_idx, float_leaves):
            leaves[i] = x
        out = loss_fn(jax.tree.unflatten(p_tree, leaves), *args)
        return out[0] if has_aux else out

    float_leaves = [p_leaves[i] for i in diff_idx]
    # The linear map's program, staged without evaluating anything: which tangent inputs
    # reach the loss's tangent. (Evaluated eagerly, jax.linearize and jax.grad would compile
    # every primitive of the model on its own: 11 of the 17 s of explain_grads on a small
    # equinox CNN; jitted, the gradient is one compilation.)
    lin = jax.make_jaxpr(lambda primals, tangents: jax.linearize(of_floats, primals)[1](tangents))(
        float_leaves, float_leaves)
    n_diff = len(diff_idx)
    reach = flow(lin.jaxpr, [{} for _ in range(n_diff)]
                  + [{j: Path(DIFF, "")} for j in range(n_diff)])[0]
    try:
        loss, grads = jax.jit(jax.value_and_grad(of_floats))(float_leaves)
    except ValueError as error:
        if "while_loop" not in str(error):
            raise
        raise ValueError(
            "explain_grads takes the gradient in reverse mode (jax.grad), and loss_fn runs a "
            "lax.while_loop (or a fori_loop with traced bounds) that depends on params, which "
            "JAX cannot differentiate in reverse mode. Write the loop as lax.scan, or as "
            "fori_loop with Python int bounds (it then lowers to scan).") from error
    relus = _relu_sites(closed, params, args, len(p_leaves))

    rows = []
    for i, (path, leaf) in enumerate(zip(paths, p_leaves)):
        shape, dtype = tuple(jnp.shape(leaf)), str(jnp.result_type(leaf))
        if not floating[i]:
            rows.append(LeafExplanation(path, shape, dtype, "not_differentiable", 0.0,
                                        f"{dtype} leaf: integer and boolean leaves have no "
                                        "gradient"))
            continue
        j = diff_idx.index(i)
        g = np.asarray(grads[j])
        norm = float(np.sqrt(np.sum(np.square(np.abs(g).astype(np.float64)))))
        bad = ~np.isfinite(g)
        if np.any(bad):
            first = tuple(int(k) for k in np.argwhere(bad)[0])
            status, detail = "nonfinite", (
                f"{int(bad.sum())} of {g.size} gradient elements are NaN or inf (the first at "
                f"index {list(first)}: {g[first]}); funcgrad.find_nonfinite(loss_fn, params, "
                "...) locates the primitive and line that made it")
        elif i not in primal:
            status, detail = "unused", "the loss does not depend on this leaf (PyTorch: grad None)"
        elif j in reach and np.any(g != 0):
            status, detail = "connected", ""
        elif j in reach and primal[i].kind == DIFF:
            status, detail = "numerically_zero", _numeric_detail(relus)
        elif primal[i].kind == STOP:
            status, detail = "blocked_by_stop_gradient", f"cut by {primal[i].where}"
        elif primal[i].kind == ZERO:
            status, detail = "blocked_by_zero_derivative_op", f"cut by {primal[i].where}"
        else:  # our analysis saw a differentiable path, JAX's rules gave a symbolic zero
            status, detail = ("blocked_by_zero_derivative_op",
                              "JAX's derivative rules give a symbolic zero on every path "
                              "(a custom_jvp/custom_vjp rule or a primitive without a tangent)")
        rows.append(LeafExplanation(path, shape, dtype, status, norm, detail))
    if left_out:  # in the module's leaf order: the split params' rows are its floating arrays
        ordered = [*zip(kept, rows), *((f.position, LeafExplanation(
            f.name, (), type(f.value).__name__, "static", 0.0, f.reason)) for f in left_out)]
        rows = [row for _, row in sorted(ordered, key=lambda pair: pair[0])]
    return GradExplanation(tuple(rows), float(loss), tuple(relus))


def _numeric_detail(relus: list[ReluSite]) -> str:
    text = ("differentiable path exists, but the gradient is exactly zero for this input "
            "(dead ReLU units, saturation, or a branch no example took)")
    dead = [s for s in relus if s.dead or any(s.dead_per_iteration)]
    if dead:
        text += "; dead ReLU units: " + ", ".join(
            f"{s.dead}/{s.units} at {s.where or '?'}" + (
                f" (per scan iteration: {_counts(s.dead_per_iteration)})"
                if s.dead_per_iteration else "") for s in dead)
    return text


def _counts(values: tuple[int, ...], most: int = 12) -> str:
    shown = ", ".join(map(str, values[:most]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")
