"""Gradient checking by central finite differences in float64, naming the wrong leaf and element.

Concept 19 (article A §4.5, B §3.2-3.3). Two modes:

* ``mode="full"`` perturbs every element of every differentiated leaf: the 2n forward
  evaluations run in ``vmap``-ed chunks inside few compiled calls (`funcgrad.check._full_pass`,
  which also times a long check and shows its progress), and the reverse-mode gradient is compared
  element by element; forward mode (``jvp``) is compared along random tangents restricted to
  each leaf against the same numerical gradient.
* ``mode="directional"`` (`funcgrad.check._directional_mode`) checks random unit tangents v: the
  central difference of phi(theta + h v) against ``jvp`` (fwd) and ``<grad, v>`` (rev), for
  all leaves together and for each leaf (or block of a leaf, `funcgrad.check._directions`) alone; a
  failing leaf is then bisected over element ranges (O(log n) evaluations) to name the element
  responsible. Each row states its resolution.

Non-scalar outputs are reduced by a fixed random cotangent u (seeded), so what is checked is
the vector-Jacobian product uᵀJ. ``order=2`` checks the gradient of <u2, grad f>, i.e.
Hessian-vector products, the same way.

Step size and tolerances come from the floating dtype the function actually computed in
(`TOLERANCES`). Central differences have truncation error h²/6·|f'''| and round-off error
about u·|f|/h for unit round-off u, so the best h is near (3u)^(1/3) and the attainable
error near u^(2/3)·|f| (Nocedal & Wright, Numerical Optimization, §8.1). A function that
computes in a narrower float on the differentiated path is checked with those casts lifted to
float64 (`funcgrad.check._lift_precision`, `funcgrad.check._lift`), so float64's step and tolerances
apply. At a kink inside a custom rule, the rule's value is compared with JAX's own convention there
(the gradient with the custom rules inlined).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._jaxpr import arg_names, check_array_args
from funcgrad._library_objects import LeftOut, left_out_fields, split_equinox_args
from funcgrad._paths import arg_leaf_paths, keystr
from funcgrad._traced import traced_values
from funcgrad.check import _as_run, _directions, _full_pass, _noise, _rule_blame
from funcgrad.check import _objective as obj
from funcgrad.check._directional_mode import _random_tangents, _run_directional
from funcgrad.check._lift_precision import lift_precision_of, narrowest_float
from funcgrad.check._shared import (
    _CHUNK_ELEMENTS,
    _FWD_ONLY_CUSTOM_VJP,
    _NO_FWD_NOTE,
    _check_finite_output,
    _reference_grad,
    _roundoff_scale,
    _see_through_grad,
    _segments,
    _sg_note,
)
from funcgrad.check.report import GradCheckReport, LeafCheck, classify_elements

#: dtype the function computed in -> (eps, rtol, atol). An element passes when
#: |analytic - numeric| <= atol + rtol * |numeric| + noise, noise being the error bound of that
#: central difference (`funcgrad.check._noise`): the round-off floor 4·u·S/h (S = |f|, or Σ|u_k y_k|
#: for a cotangent-reduced output), or where an element misses it, the round-off and
#: truncation measured around it. atol is a plain absolute tolerance in the derivative's units
#: (not scaled by |f|: a constant added to f must not widen it) for what neither term models:
#: float64: u = 1.1e-16, h = 1e-6 -> round-off ~1e-10·|f|, truncation ~2e-13·|f'''|; atol 1e-7
#:   leaves a 100x margin over both for |f| up to 10 (beyond it the floor grows with |f|).
#: float32: u = 6.0e-8, h = 1e-3 -> round-off ~6e-5·|f|, truncation ~2e-7·|f'''|.
#: float16: u = 4.9e-4, h = 3e-2 -> round-off ~1.6e-2·|f|, truncation ~1.5e-4·|f'''|.
#: bfloat16: u = 3.9e-3, h = 1e-1 -> round-off ~3.9e-2·|f|, truncation ~1.7e-3·|f'''|.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float64": (1e-6, 1e-6, 1e-7),
    "float32": (1e-3, 1e-2, 1e-3),
    "float16": (3e-2, 1e-1, 1e-1),
    "bfloat16": (1e-1, 2e-1, 2e-1),
}


def check_grads(fn: Callable, *args: Any, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                mode: str = "full", modes: Sequence[str] = ("rev", "fwd"), order: int = 1,
                eps: float | None = None, rtol: float | None = None, atol: float | None = None,
                num_directions: int = 4, seed: int = 0, chunk_size: int | None = None,
                allow_stop_gradient: bool | str | Sequence[str] = False,
                respect_stop_gradient: bool | None = None,
                progress: bool | None = None, lift_precision: bool = True,
                block_size: int | None = None) -> GradCheckReport:
    """Compares the gradients of `fn` at `args` with central finite differences.

    Args:
      fn: ``fn(*args)`` returning a floating array or pytree of arrays (any shape); with
        `has_aux`, a pair ``(output, aux)`` whose aux is ignored.
      *args: the primal point. Floating leaves of every argument are promoted to float64 for
        the check (inside ``jax.enable_x64``; the global flag is never changed). An equinox
        module is taken as ``eqx.filter_grad`` takes it: its floating arrays are checked
        (rows ``m.layers[0].weight``), its other leaves closed over.
      argnums: which positional argument(s) to differentiate. Integer and boolean leaves inside
        them are skipped and listed in the report.
      mode: "full" (every element) or "directional" (random tangents; for large models).
      modes: which analytic derivatives to check: "rev" (``grad``/``vjp``), "fwd" (``jvp``).
        "fwd" is skipped with a note when `fn` uses ``custom_vjp``. In full mode "fwd" checks
        jvps along random tangents per leaf next to rev, and every element's jvp on its own
        when it is the only mode (a ``while_loop`` that only forward mode can differentiate).
      order: 1 checks the gradient; 2 checks the gradient of ``<u, gradient>`` (Hessian-vector
        products) against finite differences of the gradient, not the gradient itself: a
        wrong first-order rule can pass order 2, so check order=1 too.
      eps: overrides `TOLERANCES`' step for the dtype used: a finite number > 0, in the
        units of the differentiated leaves.
      rtol: overrides `TOLERANCES`' relative tolerance: a finite number >= 0 (each element's
        tolerance is atol + rtol·|numeric| + the estimated error of its central difference).
      atol: overrides `TOLERANCES`' absolute tolerance: a finite number >= 0, in the
        derivative's units, not scaled by |f|.
      num_directions: random tangents per check in directional mode (per block, and k over
        all leaves together), and per leaf for the fwd check in full mode.
      seed: a non-negative int; seeds the tangents and the output cotangents.
      chunk_size: perturbations (full mode) or tangents (directional mode) evaluated per
        vmapped batch; by default about 2^20 / n (8 MiB of perturbed float64 inputs).
      allow_stop_gradient: which leaves may differ from finite differences because of
        ``stop_gradient``. By default none: a leaf whose gradient is cut (or changed) by a
        ``stop_gradient`` that finite differences see through fails with status
        "stop_gradient", as ``torch.autograd.gradcheck`` fails a detached input -- an accidental
        ``stop_gradient`` on a weight is a bug the check must not pass. Declare intended cuts
        with True (every leaf), a leaf path, or paths (``["params['frozen']"]``; a path also
        covers the leaves under it): those leaves get "stop_gradient_declared" and pass.
      respect_stop_gradient: deprecated spelling (funcgrad 0.1); True means
        ``allow_stop_gradient=True``.
      progress: full mode first runs two chunks of its 2n forward passes (the first compiles,
        the second is timed), so it knows how long the rest takes. A check expected to run over 10 s
        prints that estimate on stderr with a suggestion of directional mode, and (progress None or
        True) shows a tqdm bar; True shows the bar for any check, False never.
      lift_precision: when fn computes in a float narrower than float64 on the differentiated
        path (a bfloat16 layer, an ``astype(jnp.float32)``), check the same program with those
        casts lifted to float64, custom_jvp/custom_vjp rules included (`funcgrad.check._lift`), at
        float64's eps and tolerances (``report.lifted_from`` names the dtype). Where lifting
        cannot reach (a bitcast, a host callback), fn is checked as computed, at its dtype's
        tolerances: ``report.weaker`` says so and a note gives the smallest error it could
        see (atol + rtol·|derivative|); with False, the same without `weaker` (as asked).
      block_size: directional mode only: cut each leaf into blocks of at most this many
        elements, with `num_directions` tangents restricted to each block; None (default)
        draws them over each whole leaf. A single-element error is diluted about
        sqrt(block size)-fold along a tangent; each row's ``resolution`` says what the check
        could see (`funcgrad.check._directions`). `audit` picks it within an evaluation budget.
    Returns:
      a `GradCheckReport`: one `LeafCheck` row per differentiated leaf, ``.ok``,
      ``.raise_if_failed()``, ``.to_dict()``; ``print(report)`` shows the table.
    Raises:
      ValueError: for an unknown mode, a block_size that is not a positive int or None (or
        one given in full mode), an eps that is not a finite number > 0, an rtol or atol
        that is not a finite number >= 0, a negative seed, an argnum out of range, a selected
        argument that is an integer or boolean array, nothing floating to differentiate, a
        non-finite output at the primal point (the message names the output leaf and the argument
        shapes), "rev" with a ``while_loop`` that depends on the arguments (JAX cannot reverse it),
        or ``modes=("fwd",)`` with a ``custom_vjp`` (JAX cannot forward-differentiate it).
      funcgrad.check.LiftError: lifting fn to float64 failed inside funcgrad (never a silent
        check at the narrow dtype instead); `funcgrad.JaxInternalsError`: a JAX internal
        funcgrad reads is missing in the installed JAX.
      TypeError: if `fn` is not callable, or argnums is not an int or a tuple of ints;
        `funcgrad.TracedValueError` (a TypeError)
        when fn uses a traced value as a Python value (``if x > 0:``, ``range(n)``,
        ``float(x)``, NumPy): the message names fn's line and the fix (``jnp.where`` /
        ``lax.cond`` for a differentiated value, ``functools.partial`` for a setting).
    """
    if not callable(fn):
        raise TypeError(f"check_grads: fn must be callable, got {type(fn).__name__}.")
    if mode not in ("full", "directional"):
        raise ValueError(f"check_grads: mode must be 'full' or 'directional', got {mode!r}.")
    if not set(modes) <= {"rev", "fwd"} or not modes:
        raise ValueError(f"check_grads: modes must be a non-empty subset of ('rev', 'fwd'), got "
                         f"{modes!r}.")
    if order not in (1, 2):
        raise ValueError(f"check_grads: order must be 1 or 2, got {order!r}.")
    if (isinstance(num_directions, bool) or not isinstance(num_directions, int)
            or num_directions < 1):
        raise ValueError(f"check_grads: num_directions must be a positive int, got "
                         f"{num_directions!r}.")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"check_grads: chunk_size must be a positive int or None, got "
                         f"{chunk_size!r}.")
    if not isinstance(lift_precision, (bool, np.bool_)):
        raise TypeError(f"check_grads: lift_precision must be True or False, got "
                        f"{lift_precision!r}.")
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise TypeError(f"check_grads: progress must be True, False or None, got {progress!r}.")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(
            block_size, (int, np.integer)) or block_size < 1 or mode != "directional"):
        raise ValueError(f"check_grads: block_size must be a positive int (elements per block "
                         f"of directional tangents) or None, and only with "
                         f"mode='directional'; got {block_size!r} with mode={mode!r}.")
    _check_number("eps", eps, positive=True)
    _check_number("rtol", rtol)
    _check_number("atol", atol)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"check_grads: seed must be a non-negative int (it seeds NumPy's "
                         f"generator), got {seed!r}.")
    is_int = lambda a: isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))
    if not (is_int(argnums) or (isinstance(argnums, (tuple, list)) and argnums
                                and all(is_int(a) for a in argnums))):
        raise TypeError(f"check_grads: argnums must be an int or a non-empty tuple of ints (the "
                        f"positions of the arguments to differentiate, e.g. argnums=(0, 1)), got "
                        f"{argnums!r}.")
    argnums_t = ((int(argnums),) if isinstance(argnums, (int, np.integer))  # is_int: checked
                 else tuple(dict.fromkeys(int(a) for a in argnums)))
    # An equinox model: its floating arrays; its Python float fields are listed as skipped.
    left_out = left_out_fields(fn, args, tuple(a % len(args) for a in argnums_t
                                               if -len(args) <= a < len(args)))
    fn, args = split_equinox_args(fn, args)
    names = arg_names(fn, len(args))
    check_array_args("check_grads", args, names)
    if respect_stop_gradient is not None:
        warnings.warn("check_grads: respect_stop_gradient is deprecated; pass "
                      "allow_stop_gradient=True (or the paths of the leaves meant to be "
                      "detached) instead.", DeprecationWarning, stacklevel=2)
        allow_stop_gradient = bool(respect_stop_gradient)
    with traced_values("check_grads", fn, args, names, argnums_t):
        x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64  # the caller's mode
        as_run = None if x64 else _as_run.as_run(fn, args, has_aux)
    with jax.enable_x64(True), traced_values("check_grads", fn, args, names, argnums_t):
        try:
            prob = _setup(fn, args, argnums_t, has_aux, order, names, seed)
            refused = None
        except (TypeError, ValueError) as error:
            # fn runs as the caller runs it but not traced under x64, where its own integer
            # arithmetic widens too (equinox's BatchNorm adds 1 to an int32 counter held in
            # its state, gets int64 and refuses it): check the program traced as it runs.
            if as_run is None or not as_run.value.size:
                raise
            refused = (str(error).strip().splitlines() or [""])[0]
            prob = _setup(as_run.program, args, argnums_t, has_aux, order, names, seed,
                          force_cast=True)
            prob["notes"].insert(0, f"fn fails when traced with x64 on ({type(error).__name__}: "
                                    f"{refused[:160]}); the check used fn's program as you "
                                    "run it (traced with x64 off), evaluated in float64.")
        prob = lift_precision_of(prob, lift_precision, modes,
                                 _tolerances(prob["dtype_used"], eps, rtol, atol)[1:])
        if as_run is not None and refused is None:
            prob = _as_run.as_the_user_runs_it(
                prob, as_run, lift_precision, modes,
                lambda dtype: _tolerances(dtype, eps, rtol, atol)[1:],
                lambda program: _setup(program, args, argnums_t, has_aux, order, names, seed,
                                       force_cast=True))
        allowed = _allowed_stop_gradient(allow_stop_gradient, prob["paths"])
        cfg_tol = _tolerances(prob["dtype_used"], eps, rtol, atol)
        run = (_run_full if mode == "full" else
               functools.partial(_run_directional, block_size=block_size))
        try:
            rows, notes = run(prob, cfg_tol, modes, num_directions, seed, chunk_size, allowed,
                              progress)
        except ValueError as error:
            if "while_loop" not in str(error) or not ("rev" in modes or order == 2):
                raise
            if order == 2:
                raise ValueError(
                    "check_grads: order=2 checks the gradient of <u, gradient>, which takes a "
                    "reverse-mode gradient, and fn runs a lax.while_loop (or a fori_loop with "
                    "traced bounds) that depends on the differentiated arguments, which JAX "
                    "cannot reverse. Check order=1 with modes=('fwd',), or write the loop as "
                    "lax.scan.") from error
            raise ValueError(
                "check_grads: fn runs a lax.while_loop (or a fori_loop with traced bounds) that "
                "depends on the differentiated arguments, and JAX has no reverse-mode derivative "
                "for it. Check the forward mode alone with modes=('fwd',), or write the loop "
                "as lax.scan.") from error
        if any(not r.ok for r in rows):  # a custom rule on the failing path: name it
            blamed = _rule_blame.blame(prob, seed)
            wrong = tuple(b.split(" is wrong ")[0] + " is wrong at the check point (see the "
                          "report's notes)" for b in blamed if " is wrong " in b)
            notes = [*blamed, *notes]
            rows = [r if r.ok or not wrong else dataclasses.replace(r, notes=(*r.notes, *wrong))
                    for r in rows]
    notes = prob["notes"] + notes
    checked = tuple(m for m in modes if not (m == "fwd" and _NO_FWD_NOTE in notes))
    return GradCheckReport(rows=rows, mode=mode, modes=checked or tuple(modes), order=order,
                           dtype_used=prob["dtype_used"], eps=cfg_tol[0], rtol=cfg_tol[1],
                           atol=cfg_tol[2], skipped=_left_out(left_out) + prob["skipped"],
                           notes=notes,
                           checked_args=prob["checked_args"],
                           unchecked_args=prob["unchecked_args"],
                           lifted_from=prob["lifted_from"], weaker=prob.get("weaker"))


def audit(loss_fn: Callable, params: Any, *batch: Any, max_full_elements: int = 50_000,
          max_evaluations: int | None = None, **kwargs: Any) -> GradCheckReport:
    """Checks every leaf of a model's loss gradient: full mode when small, directional when large.

    The article's audit (B §3.3): one row per parameter leaf (``params[1]['w']``, ...). In
    directional mode a single wrong element of a B-element leaf moves a directional derivative
    by only about 1/sqrt(B) of its error, so audit cuts the leaves into the smallest blocks
    (each with its own `num_directions` tangents) whose check fits in `max_evaluations`
    function evaluations, and a note in the report says which block size, how many
    evaluations and the resolution reached (each row's ``resolution``: the smallest
    single-element error reported with probability >= 99%; `funcgrad.check._directions`).

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``.
      params: the parameter pytree (differentiated).
      *batch: the remaining arguments (not differentiated).
      max_full_elements: up to this many floating parameter elements the check is "full"
        (2n forward passes); above it "directional" in blocks. A full check of a
        50,826-parameter MLP with a small batch took 31 s on a shared 2-core CPU (2026-12-02);
        lower this for a quicker, coarser check.
      max_evaluations: directional mode's budget of function evaluations (2 per tangent, 3
        with the jvp of "fwd"). None: 2·max_full_elements²/n for n parameter elements, about
        the cost of the largest full check (a forward pass costing in proportion to n).
      **kwargs: passed to `check_grads`; a ``block_size`` given here is used as it is in
        directional mode (and ignored in full mode).
    Raises:
      ValueError: for a negative max_full_elements or a max_evaluations that is not a
        positive int; and as `check_grads`.
      TypeError: an argument leaf that is not an array or a number (its path is named); and
        as `check_grads`.
    """
    if (isinstance(max_full_elements, bool) or not isinstance(max_full_elements, (int, np.integer))
            or max_full_elements < 0):
        raise ValueError(f"audit: max_full_elements must be a non-negative int (floating "
                         f"parameter elements), got {max_full_elements!r}.")
    if max_evaluations is not None and (isinstance(max_evaluations, bool) or not isinstance(
            max_evaluations, (int, np.integer)) or max_evaluations < 1):
        raise ValueError(f"audit: max_evaluations must be a positive int (function "
                         f"evaluations of the directional check) or None, got "
                         f"{max_evaluations!r}.")
    left_out = _left_out(left_out_fields(loss_fn, (params, *batch), (0,)))
    loss_fn, split_args = split_equinox_args(loss_fn, (params, *batch))
    params, batch = split_args[0], split_args[1:]
    check_array_args("audit", (params, *batch), arg_names(loss_fn, 1 + len(batch)))
    if left_out:  # check_grads sees the split params (no float left in them): listed here
        report = audit(loss_fn, params, *batch, max_full_elements=max_full_elements,
                       max_evaluations=max_evaluations, **kwargs)
        return dataclasses.replace(report, skipped=[*left_out, *report.skipped])
    sizes = [int(np.size(x)) for x in jax.tree.leaves(params)
             if jnp.issubdtype(jnp.result_type(x), jnp.floating) and np.size(x) > 0]
    n = sum(sizes)
    if n <= max_full_elements:  # a block_size is for the directional case only
        kwargs = {key: v for key, v in kwargs.items() if key != "block_size"}
        return check_grads(loss_fn, params, *batch, argnums=0, mode="full", **kwargs)
    if "block_size" in kwargs:
        return check_grads(loss_fn, params, *batch, argnums=0, mode="directional", **kwargs)
    budget = (_directions.default_budget(n, max_full_elements) if max_evaluations is None
              else int(max_evaluations))
    k = kwargs.get("num_directions", 4)
    per_tangent = 2 + ("fwd" in kwargs.get("modes", ("rev", "fwd")))
    valid_k = isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 1
    block = _directions.choose_block_size(sizes, k, per_tangent, budget) if valid_k else None
    report = check_grads(loss_fn, params, *batch, argnums=0, mode="directional",
                         block_size=block, **kwargs)
    worst = max(report.rows, key=lambda r: cast(float, r.resolution))  # set in directional mode
    used = 2 + ("fwd" in report.modes)  # fwd is skipped (with a note) for a custom_vjp
    note = _directions.describe(block, sizes, k, used, budget, worst.resolution, worst.path)
    return dataclasses.replace(report, notes=[note, *report.notes])


def _left_out(fields: list[LeftOut]) -> list[str]:
    """A report's ``skipped`` lines for the Python float fields of an equinox module."""
    return [f"{field.name} ({field.reason})" for field in fields]


# --- set-up -------------------------------------------------------------------------------

def _promote(x):
    """Floating leaves to float64 NumPy arrays (host-side: no per-shape compilation); other
    leaves as they are: a typed PRNG key (``jax.random.key(0)``) has no NumPy form, and integer
    tokens or bools are passed through, not differentiated."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return x
    return np.asarray(x).astype(np.float64)


def _setup(fn, args, argnums, has_aux, order, names, seed, force_cast=False):
    for a in argnums:
        if not -len(args) <= a < len(args):
            raise ValueError(f"check_grads: argnums={a} is out of range for {len(args)} "
                             "positional args.")
    argnums = tuple(a % len(args) for a in argnums)
    for a in argnums:
        if isinstance(args[a], (jax.Array, np.ndarray, int, bool)) and not jnp.issubdtype(
                jnp.result_type(args[a]), jnp.inexact):
            raise ValueError(
                f"check_grads: argument {names[a]} (argnums={a}) has dtype "
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
                raise ValueError(f"check_grads: {name} is complex; complex leaves are not "
                                 "supported.")
            else:
                skipped.append(f"{name} ({dtype}, not differentiated)")
    if not diff:
        raise ValueError(
            f"check_grads: no floating leaf to differentiate in argnums={argnums} "
            f"({', '.join(names[a] for a in argnums)})"
            + (f"; skipped: {', '.join(skipped)}." if skipped else "."))
    leaves = tuple(_promote(leaf) for leaf in flat)
    shapes = tuple(tuple(leaves[p].shape) for p in diff)
    theta = np.concatenate([np.ravel(leaves[p]) for p in diff])
    probe = obj.Spec(fn, has_aux, treedef, tuple(diff), shapes, 1, True)
    if force_cast:  # fn is a program traced in its own dtypes (`_as_run`): give it those
        probe = probe._replace(cast_to=tuple(str(jnp.result_type(flat[p])) for p in diff))
        leaves = tuple(leaf if pos in diff else flat[pos] for pos, leaf in enumerate(leaves))
    try:
        out_tree = jax.eval_shape(lambda t, lv: _raw_output(probe, t, lv), theta, leaves)
    except TypeError as error:
        # fn mixes its own dtype with the float64 inputs where JAX wants one type (a scan
        # carry made in float32, as flax's nn.RNN does): give fn its leaves in their own dtypes
        # and let lifting (funcgrad.check._lift_precision) check its arithmetic in float64.
        if "float64" not in str(error) or not any(
                str(jnp.result_type(flat[p])) != "float64" for p in diff):
            raise
        probe = probe._replace(cast_to=tuple(str(jnp.result_type(flat[p])) for p in diff))
        leaves = tuple(leaf if pos in diff else flat[pos] for pos, leaf in enumerate(leaves))
        out_tree = jax.eval_shape(lambda t, lv: _raw_output(probe, t, lv), theta, leaves)
    out_layout, start = [], 0
    for path, o in jax.tree_util.tree_flatten_with_path(out_tree)[0]:
        out_layout.append((jax.tree_util.keystr(path), tuple(o.shape), start))
        start += math.prod(o.shape)
    # One trace gives the output's shape and the jaxpr whose dtypes set the tolerances below.
    traced, out = jax.make_jaxpr(lambda t, lv: obj.output_vector(probe, t, lv),
                                 return_shape=True)(theta, leaves)
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"check_grads: fn returned dtype {out.dtype}; it must return floating "
                         "values.")
    spec = probe._replace(order=order, scalar_output=out.size == 1)
    rng = np.random.default_rng(seed)  # NumPy draws: nothing to compile
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
    return dict(checked_args=checked_args, unchecked_args=unchecked_args,
                spec=spec, theta=theta, leaves=leaves, cotangents=cotangents, paths=paths,
                shapes=shapes, skipped=skipped, dtype_used=dtype_used,
                notes=notes, out_layout=out_layout, names=names, args=args)


def _is_array_like(x) -> bool:
    try:
        jnp.result_type(x)
        return True
    except TypeError:  # a typed PRNG key
        return False


def _raw_output(spec, theta, leaves):
    """fn's output (without its aux); ValueError for an output that cannot be checked."""
    out = spec.fn(*obj.unflatten(spec, theta, leaves))
    if spec.has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ValueError(f"check_grads: has_aux=True expects fn to return a pair (output, "
                             f"aux), but it returned {_kind(out)}. Return (loss, aux), or drop "
                             "has_aux.")
        out = out[0]
    if not jax.tree.leaves(out):
        raise ValueError(f"check_grads: fn returned {_kind(out)}, with no array to check. "
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


def _check_number(name: str, value: Any, positive: bool = False) -> None:
    """TypeError unless `value` is None or a real number; ValueError unless it is finite and
    > 0 (`positive`) or >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"check_grads: {name} must be a number or None, got "
                        f"{type(value).__name__} {value!r}.")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        meaning = {"eps": "the finite-difference step, in the units of the differentiated "
                          "leaves; None picks one for the dtype (TOLERANCES), e.g. 1e-3 in "
                          "float32",
                   "rtol": "a relative tolerance; None uses TOLERANCES, e.g. 1e-2 in float32",
                   "atol": "an absolute tolerance, in the derivative's units; None uses "
                           "TOLERANCES, e.g. 1e-3 in float32"}[name]
        raise ValueError(f"check_grads: {name} must be a finite number "
                         f"{'> 0' if positive else '>= 0'} or None, got {value!r}: it is "
                         f"{meaning}.")


def _allowed_stop_gradient(allow, paths) -> tuple[bool, ...]:
    """One flag per differentiated leaf: may it differ because of stop_gradient? `allow` is a
    bool, a path or paths; a path covers itself and the leaves under it. ValueError for a path
    that names no differentiated leaf (a typo must not silently allow nothing)."""
    if isinstance(allow, (bool, np.bool_)):
        return tuple(bool(allow) for _ in paths)
    names = (allow,) if isinstance(allow, str) else tuple(allow)
    if not all(isinstance(a, str) for a in names):
        raise TypeError(f"check_grads: allow_stop_gradient must be a bool, a leaf path or leaf "
                        f"paths (str), got {allow!r}.")
    covers = lambda name, path: path == name or (path.startswith(name) and
                                                 path[len(name)] in "[.")
    for name in names:
        if not any(covers(name, p) for p in paths):
            raise ValueError(f"check_grads: allow_stop_gradient names {name!r}, which is not a "
                             f"differentiated leaf or a prefix of one; the leaves are: "
                             f"{', '.join(paths)}.")
    return tuple(any(covers(name, p) for name in names) for p in paths)


def _tolerances(dtype_used, eps, rtol, atol):
    d_eps, d_rtol, d_atol = TOLERANCES.get(dtype_used, TOLERANCES["float32"])
    return (d_eps if eps is None else float(eps), d_rtol if rtol is None else float(rtol),
            d_atol if atol is None else float(atol))


# --- full mode (directional mode: funcgrad.check._directional_mode) ----------------------------


def _judge_elements(prob, f0, fp, fm, grad, out, tol):
    """First verdicts on every element, with each one's step and noise (the error bound of its
    central difference) refined where needed: the round-off floor for all; the step eps/8 for
    kink candidates it shows smooth (a jump crossed by eps; `_noise.smaller_step`); measured
    noise for the elements that still fail (`_noise.measured_noise`). Returns the
    `classify_elements` dict (plus noise, jumped, coarse, step, coarse_step) and the vectors
    (numeric, right, left, step, noise, smooth) for further classification."""
    eps, rtol, atol = tol
    n = fp.shape[0]
    numeric = (fp - fm) / (2 * eps)
    right, left = (fp - f0) / eps, (f0 - fm) / eps
    dtype, scale = prob["dtype_used"], _roundoff_scale(prob, f0, out)
    step = np.full(n, eps)
    noise = np.full(n, _noise.floor(dtype, scale, eps))
    cls = classify_elements(grad, numeric, right, left, None, atol + noise, rtol, step)
    coarse, smooth, jumped = numeric, None, np.zeros(n, bool)
    candidates = np.flatnonzero(cls["kink"])
    if candidates.size:
        numeric, right, left, smooth, jumped = _noise.smaller_step(
            prob, f0, candidates, eps, numeric, right, left, _CHUNK_ELEMENTS)
        step = np.where(smooth, eps / _noise.SMALLER, eps)
        noise = np.where(smooth, _noise.floor(dtype, scale, eps / _noise.SMALLER), noise)
        cls = classify_elements(grad, numeric, right, left, None, atol + noise, rtol, step,
                                smooth)
    suspects = np.flatnonzero(cls["fail"] & ~cls["kink"] & np.isfinite(grad)
                              & np.isfinite(numeric))
    if suspects.size:  # the floor may be too tight (cancellation in fn): measure their noise
        noise = noise.copy()
        noise[suspects] = np.fmax(noise[suspects], _noise.measured_noise(
            prob, suspects, step[suspects], _CHUNK_ELEMENTS))
        cls = classify_elements(grad, numeric, right, left, None, atol + noise, rtol, step,
                                smooth)
    cls.update(noise=noise, jumped=jumped, coarse=coarse, step=step, coarse_step=eps)
    return cls, (numeric, right, left, step, noise, smooth)


def _run_full(prob, tol, modes, k, seed, chunk_size, allowed, progress=None):
    spec, theta, leaves, cots = prob["spec"], prob["theta"], prob["leaves"], prob["cotangents"]
    eps, rtol, atol = tol
    n = theta.shape[0]
    chunk = int(chunk_size or max(1, min(n, _CHUNK_ELEMENTS // max(n, 1))))
    segments = _segments(prob)
    tangents = None
    notes = []
    rev = "rev" in modes
    if "fwd" in modes and rev:  # without rev every element is checked by a jvp of its own
        tangents, _ = _random_tangents(seed, n, segments, k)
    passes = functools.partial(_full_pass.run, spec, theta, leaves, cots, eps=eps, chunk=chunk,
                               rev=rev, progress=progress)
    try:
        result = passes(tangents)
    except TypeError as e:
        if not rev and "custom_vjp" in str(e):
            raise ValueError(_FWD_ONLY_CUSTOM_VJP) from e
        if tangents is None or "custom_vjp" not in str(e):
            raise
        notes.append(_NO_FWD_NOTE)
        tangents = None
        result = passes(None)
    f0, fp, fm, grad, out = result[:5]
    _check_finite_output(prob, out)
    cls, (numeric, right, left, step, noise, smooth) = _judge_elements(
        prob, float(f0), fp, fm, grad, out, tol)
    reference = _reference_grad(prob, modes) if cls["kink"].any() else None
    if reference is not None:  # custom rules: their kinks are held to JAX's convention
        cls = {**cls, **classify_elements(grad, numeric, right, left, None, atol + noise, rtol,
                                          step, smooth, reference)}
    if (cls["fail"] & ~cls["kink"]).any():  # only then ask whether stop_gradient explains it
        g_st = _see_through_grad(prob, modes)
        if g_st is not None:
            cls = {**cls, **classify_elements(grad, numeric, right, left, g_st, atol + noise,
                                              rtol, step, smooth, reference)}  # keeps noise, ...
    fwd = None
    if tangents is not None:
        accepted = np.where(cls["explained"], grad, numeric)  # JAX's value at kinks
        fwd_noise = np.abs(tangents) @ np.where(cls["explained"], 0.0, noise)
        fwd = (tangents, np.asarray(result[5]), tangents @ accepted, fwd_noise)
    rows = []
    for li, (lo, hi) in enumerate(segments):
        fwd_err = None
        if fwd is not None:
            sel = slice(li * k, (li + 1) * k)
            fwd_err = (fwd[1][sel], fwd[2][sel], fwd[3][sel])
        rows.append(LeafCheck.from_elements(
            prob["paths"][li], prob["shapes"][li], prob["dtype_used"], cls, lo, hi,
            fwd_err, atol, rtol, allowed[li]))
    if cls["sg"].any():
        notes.append(_sg_note(allowed, rows))
    return rows, notes


