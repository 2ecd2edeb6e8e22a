"""One gradient check from fn and its arguments to its report, whichever way the derivatives are
compared (private to `funcgrad.check`; `check_grads` compares every element, `check_directional`
random tangents).

The steps: fn's arguments named and validated, an equinox module split into its arrays and
the rest, fn run as the caller runs it (x64 off) for the as-run guard (`_as_run`), the problem
set up in float64 (`_problem`), lifted to float64 when fn computes in a narrower float
(`_lift_precision`), compared, and on a failure the custom rule at fault named (`_rule_blame`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from funcgrad._jaxpr import arg_names, check_array_args
from funcgrad._library_objects import left_out_fields, split_equinox_args
from funcgrad._traced import traced_values
from funcgrad.check import _as_run, _rule_blame
from funcgrad.check._lift_precision import lift_precision_of
from funcgrad.check._problem import (
    allowed_stop_gradient,
    argnums_tuple,
    left_out_lines,
    setup,
)
from funcgrad.check._shared import _NO_FWD_NOTE
from funcgrad.check.options import CheckOptions
from funcgrad.check.report import GradCheckReport

#: compare(prob, (eps, rtol, atol), allowed) -> (rows, notes): how a check compares derivatives.
Compare = Callable[[dict, tuple[float, float, float], tuple[bool, ...]], tuple[list, list]]


def run(who: str, mode: str, fn: Callable, args: tuple, argnums: Any, has_aux: bool,
        allow_stop_gradient: Any, options: CheckOptions, compare: Compare) -> GradCheckReport:
    """The report of checking `fn` at `args` with `compare`; `who` names the public function
    in errors, `mode` ("full" or "directional") is the report's."""
    if not callable(fn):
        raise TypeError(f"{who}: fn must be callable, got {type(fn).__name__}.")
    argnums_t = argnums_tuple(who, argnums)
    # An equinox model: its floating arrays; its Python float fields are listed as skipped.
    left_out = left_out_fields(fn, args, tuple(a % len(args) for a in argnums_t
                                               if -len(args) <= a < len(args)))
    fn, args = split_equinox_args(fn, args)
    names = arg_names(fn, len(args))
    check_array_args(who, args, names)
    modes, order = options.modes, options.order
    with traced_values(who, fn, args, names, argnums_t):
        x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64  # the caller's mode
        as_run = None if x64 else _as_run.as_run(fn, args, has_aux)
    rebuild = lambda program: setup(who, program, args, argnums_t, has_aux, options, names,
                                    force_cast=True)
    with jax.enable_x64(True), traced_values(who, fn, args, names, argnums_t):
        try:
            prob = setup(who, fn, args, argnums_t, has_aux, options, names)
            refused = None
        except (TypeError, ValueError) as error:
            # fn runs as the caller runs it but not traced under x64, where its own integer
            # arithmetic widens too (equinox's BatchNorm adds 1 to an int32 counter held in
            # its state, gets int64 and refuses it): check the program traced as it runs.
            if as_run is None or not as_run.value.size:
                raise
            refused = (str(error).strip().splitlines() or [""])[0]
            prob = rebuild(as_run.program)
            prob["notes"].insert(0, f"fn fails when traced with x64 on ({type(error).__name__}: "
                                    f"{refused[:160]}); the check used fn's program as you "
                                    "run it (traced with x64 off), evaluated in float64.")
        prob = lift_precision_of(prob, options.lift_precision, modes,
                                 options.tolerances(prob["dtype_used"])[1:])
        if as_run is not None and refused is None:
            prob = _as_run.as_the_user_runs_it(
                prob, as_run, options.lift_precision, modes,
                lambda dtype: options.tolerances(dtype)[1:], rebuild)
        allowed = allowed_stop_gradient(who, allow_stop_gradient, prob["paths"])
        tol = options.tolerances(prob["dtype_used"])
        try:
            rows, notes = compare(prob, tol, allowed)
        except ValueError as error:
            if "while_loop" not in str(error) or not ("rev" in modes or order == 2):
                raise
            raise ValueError(_while_loop_message(who, order)) from error
        if any(not r.ok for r in rows):  # a custom rule on the failing path: name it
            blamed = _rule_blame.blame(prob, options.seed)
            wrong = tuple(b.split(" is wrong ")[0] + " is wrong at the check point (see the "
                          "report's notes)" for b in blamed if " is wrong " in b)
            notes = [*blamed, *notes]
            rows = [r if r.ok or not wrong else dataclasses.replace(r, notes=(*r.notes, *wrong))
                    for r in rows]
    notes = prob["notes"] + notes
    checked = tuple(m for m in modes if not (m == "fwd" and _NO_FWD_NOTE in notes))
    return GradCheckReport(rows=rows, mode=mode, modes=checked or tuple(modes), order=order,
                           dtype_used=prob["dtype_used"], eps=tol[0], rtol=tol[1],
                           atol=tol[2], skipped=left_out_lines(left_out) + prob["skipped"],
                           notes=notes,
                           checked_args=prob["checked_args"],
                           unchecked_args=prob["unchecked_args"],
                           lifted_from=prob["lifted_from"], weaker=prob.get("weaker"))


def _while_loop_message(who: str, order: int) -> str:
    fwd_only = "options=funcgrad.CheckOptions(modes=('fwd',))"
    if order == 2:
        return (f"{who}: order=2 checks the gradient of <u, gradient>, which takes a "
                "reverse-mode gradient, and fn runs a lax.while_loop (or a fori_loop with "
                "traced bounds) that depends on the differentiated arguments, which JAX "
                f"cannot reverse. Check order=1 with {fwd_only}, or write the loop as "
                "lax.scan.")
    return (f"{who}: fn runs a lax.while_loop (or a fori_loop with traced bounds) that "
            "depends on the differentiated arguments, and JAX has no reverse-mode derivative "
            f"for it. Check the forward mode alone with {fwd_only}, or write the loop as "
            "lax.scan.")
