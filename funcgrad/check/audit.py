"""The audit of a model's loss gradient: every parameter leaf checked, in full when the model is
small, with random tangents in blocks sized to a budget of evaluations when it is large
(article B §3.3)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._jaxpr import arg_names, check_array_args
from funcgrad._library_objects import left_out_fields, split_equinox_args
from funcgrad.check import _directions
from funcgrad.check._problem import left_out_lines
from funcgrad.check.directional import check_directional
from funcgrad.check.grads import check_grads
from funcgrad.check.options import CheckOptions, _options_of
from funcgrad.check.report import GradCheckReport

#: Random tangents per block when the audit checks directionally.
NUM_DIRECTIONS = 4


def audit(loss_fn: Callable, params: Any, *batch: Any, has_aux: bool = False,
          allow_stop_gradient: bool | str | Sequence[str] = False,
          options: CheckOptions | None = None, max_full_elements: int = 50_000,
          max_evaluations: int | None = None) -> GradCheckReport:
    """Checks every leaf of a model's loss gradient: `funcgrad.check_grads` when the model is
    small, `funcgrad.check_directional` in blocks when it is large.

    One row per parameter leaf (``params[1]['w']``, ...). Directionally, a single wrong element
    of a B-element leaf moves a directional derivative by only about 1/sqrt(B) of its error, so
    audit cuts the leaves into the smallest blocks (each with its own 4 tangents) whose check
    fits in `max_evaluations` function evaluations, and a note in the report says which block
    size, how many evaluations and the resolution reached (each row's ``resolution``: the
    smallest single-element error reported with probability >= 99%;
    `funcgrad.check._directions`).

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar`` (``(scalar, aux)`` with `has_aux`).
      params: the parameter pytree (differentiated).
      *batch: the remaining arguments (not differentiated).
      has_aux: as for `funcgrad.check_grads`.
      allow_stop_gradient: as for `funcgrad.check_grads`.
      options: a `funcgrad.CheckOptions`, passed to the check that runs; None for its
        defaults.
      max_full_elements: up to this many floating parameter elements the check is
        `check_grads` (2n forward passes); above it `check_directional` in blocks. A full
        check of a 50,826-parameter MLP with a small batch took 31 s on a shared 2-core CPU
        (2026-12-02); lower this for a quicker, coarser check.
      max_evaluations: the directional check's budget of function evaluations (2 per tangent,
        3 with the jvp of "fwd"). None: 2·max_full_elements²/n for n parameter elements, about
        the cost of the largest full check (a forward pass costing in proportion to n).
    Returns:
      the `GradCheckReport` of the check that ran (``mode`` "full" or "directional").
    Raises:
      ValueError: for a negative max_full_elements or a max_evaluations that is not a
        positive int; and as `funcgrad.check_grads`.
      TypeError: an argument leaf that is not an array or a number (its path is named); and
        as `funcgrad.check_grads`.
    Example:
      >>> report = fg.audit(loss_fn, params, x, y)   # full below 50,000 elements
      >>> report.raise_if_failed()
    """
    options = _options_of("audit", options)
    if (isinstance(max_full_elements, bool) or not isinstance(max_full_elements, (int, np.integer))
            or max_full_elements < 0):
        raise ValueError(f"audit: max_full_elements must be a non-negative int (floating "
                         f"parameter elements), got {max_full_elements!r}.")
    if max_evaluations is not None and (isinstance(max_evaluations, bool) or not isinstance(
            max_evaluations, (int, np.integer)) or max_evaluations < 1):
        raise ValueError(f"audit: max_evaluations must be a positive int (function "
                         f"evaluations of the directional check) or None, got "
                         f"{max_evaluations!r}.")
    left_out = left_out_lines(left_out_fields(loss_fn, (params, *batch), (0,)))
    loss_fn, split_args = split_equinox_args(loss_fn, (params, *batch))
    params, batch = split_args[0], split_args[1:]
    check_array_args("audit", (params, *batch), arg_names(loss_fn, 1 + len(batch)))
    same: dict[str, Any] = dict(has_aux=has_aux, allow_stop_gradient=allow_stop_gradient,
                                options=options)
    if left_out:  # the checks see the split params (no float left in them): listed here
        report = audit(loss_fn, params, *batch, max_full_elements=max_full_elements,
                       max_evaluations=max_evaluations, **same)
        return dataclasses.replace(report, skipped=[*left_out, *report.skipped])
    sizes = [int(np.size(x)) for x in jax.tree.leaves(params)
             if jnp.issubdtype(jnp.result_type(x), jnp.floating) and np.size(x) > 0]
    n = sum(sizes)
    if n <= max_full_elements:
        return check_grads(loss_fn, params, *batch, argnums=0, **same)
    budget = (_directions.default_budget(n, max_full_elements) if max_evaluations is None
              else int(max_evaluations))
    k = NUM_DIRECTIONS
    per_tangent = 2 + ("fwd" in options.modes)
    block = _directions.choose_block_size(sizes, k, per_tangent, budget)
    report = check_directional(loss_fn, params, *batch, argnums=0, num_directions=k,
                               block_size=block, **same)
    worst = max(report.rows, key=lambda r: cast(float, r.resolution))  # set when directional
    used = 2 + ("fwd" in report.modes)  # fwd is skipped (with a note) for a custom_vjp
    note = _directions.describe(block, sizes, k, used, budget, worst.resolution, worst.path)
    return dataclasses.replace(report, notes=[note, *report.notes])
