"""The full gradient check: every element of every differentiated leaf compared with central
finite differences in float64, naming the wrong leaf and element (concept 19; article A §4.5,
B §3.2).

Non-scalar outputs are reduced by a fixed random cotangent u (seeded), so what is checked is
the vector-Jacobian product uᵀJ; ``CheckOptions(order=2)`` checks the gradient of
<u2, grad f>, i.e. Hessian-vector products, the same way. The step and tolerances come from the
dtype fn computes in (`funcgrad.check.TOLERANCES`). A function that computes in a narrower
float on the differentiated path is checked with those casts lifted to float64
(`funcgrad.check._lift_precision`, `funcgrad.check._lift`), so float64's step and tolerances
apply. At a kink inside a custom rule, the rule's value is compared with JAX's own convention
there (the gradient with the custom rules inlined). The directional check for large models is
`funcgrad.check_directional`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from funcgrad.check import _full_mode, _run
from funcgrad.check.options import CheckOptions, _options_of
from funcgrad.check.report import GradCheckReport

#: The keywords check_grads had before its two checks were split (issue 33), and where each
#: went; passing one raises a TypeError that says so.
_MOVED_KEYWORDS = {
    "mode": "mode='full' is check_grads itself, and mode='directional' is "
            "funcgrad.check_directional(fn, *args, num_directions=4)",
    "num_directions": "random tangents are funcgrad.check_directional(fn, *args, "
                      f"num_directions=4); check_grads checks every element (and jvps along "
                      f"{_full_mode.FWD_TANGENTS} random tangents per leaf)",
    "block_size": "tangents per block are funcgrad.check_directional(fn, *args, block_size=B)",
    "respect_stop_gradient": "it is allow_stop_gradient=True",
    **{field.name: f"set it in the options: options=funcgrad.CheckOptions({field.name}=...)"
       for field in dataclasses.fields(CheckOptions)},
}


def _refuse_moved(who: str, moved: dict[str, Any]) -> None:
    """TypeError for the first of `moved`: where a former keyword went, or Python's message
    for an unknown one."""
    name = next(iter(moved))
    if name in _MOVED_KEYWORDS:
        raise TypeError(f"{who}: {name}= is no longer a keyword; {_MOVED_KEYWORDS[name]}.")
    raise TypeError(f"{who}() got an unexpected keyword argument {name!r}.")


def check_grads(fn: Callable, *args: Any, argnums: int | Sequence[int] = 0,
                has_aux: bool = False, allow_stop_gradient: bool | str | Sequence[str] = False,
                options: CheckOptions | None = None, **moved: Any) -> GradCheckReport:
    """Compares the gradient of `fn` at `args` with central finite differences, element by
    element, in float64.

    Each of the n elements of the differentiated leaves is perturbed by ± eps: the 2n forward
    evaluations run in ``vmap``-ed chunks inside few compiled calls, and the reverse-mode
    gradient is compared element by element; forward mode (``jvp``) is compared along 4 random
    tangents per leaf against the same numerical gradient (every element's jvp when it is the
    only mode checked). For models too large for 2n evaluations, `funcgrad.check_directional`
    checks random tangents, and `funcgrad.audit` picks one or the other.

    Args:
      fn: ``fn(*args)`` returning a floating array or pytree of arrays (any shape); with
        `has_aux`, a pair ``(output, aux)`` whose aux is ignored.
      *args: the primal point. Floating leaves of every argument are promoted to float64 for
        the check (inside ``jax.enable_x64``; the global flag is never changed). An equinox
        module is taken as ``eqx.filter_grad`` takes it: its floating arrays are checked
        (rows ``m.layers[0].weight``), its other leaves closed over.
      argnums: which positional argument(s) to differentiate. Integer and boolean leaves inside
        them are skipped and listed in the report.
      has_aux: fn returns ``(output, aux)``; only the output is checked.
      allow_stop_gradient: which leaves may differ from finite differences because of
        ``stop_gradient``. By default none: a leaf whose gradient is cut (or changed) by a
        ``stop_gradient`` that finite differences see through fails with status
        "stop_gradient", as ``torch.autograd.gradcheck`` fails a detached input -- an accidental
        ``stop_gradient`` on a weight is a bug the check must not pass. Declare intended cuts
        with True (every leaf), a leaf path, or paths (``["params['frozen']"]``; a path also
        covers the leaves under it): those leaves get "stop_gradient_declared" and pass.
      options: a `funcgrad.CheckOptions` (tolerances, step, modes, order, seed, chunk size,
        precision lifting, progress); None for its defaults.
    Returns:
      a `GradCheckReport` (``mode`` "full"): one `LeafCheck` row per differentiated leaf,
      ``.ok``, ``.raise_if_failed()``, ``.to_dict()``; ``print(report)`` shows the table.
    Raises:
      TypeError: if `fn` is not callable, argnums is not an int or a tuple of ints, options is
        not a CheckOptions, or a keyword is one check_grads no longer takes (mode,
        num_directions, block_size, respect_stop_gradient, or a `CheckOptions` field): the
        message names where it went; `funcgrad.TracedValueError` (a TypeError) when fn uses a
        traced value as a Python value (``if x > 0:``, ``range(n)``, ``float(x)``, NumPy):
        the message names fn's line and the fix (``jnp.where`` / ``lax.cond`` for a
        differentiated value, ``functools.partial`` for a setting).
      ValueError: an argnum out of range, a selected argument that is an integer or boolean
        array, nothing floating to differentiate, an allow_stop_gradient path that names no
        differentiated leaf, a non-finite output at the primal point (the message names the
        output leaf and the argument shapes), "rev" with a ``while_loop`` that depends on the
        arguments (JAX cannot reverse it), or ``modes=("fwd",)`` with a ``custom_vjp`` (JAX
        cannot forward-differentiate it).
      funcgrad.check.LiftError: lifting fn to float64 failed inside funcgrad (never a silent
        check at the narrow dtype instead); `funcgrad.JaxInternalsError`: a JAX internal
        funcgrad reads is missing in the installed JAX.
    Example:
      >>> report = fg.check_grads(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, x)
      >>> report.ok, report.rows[0].path
      (True, 'w')
      >>> fg.check_grads(f, params, options=fg.CheckOptions(modes=("fwd",), rtol=1e-5))
    """
    if moved:
        _refuse_moved("check_grads", moved)
    options = _options_of("check_grads", options)
    return _run.run("check_grads", "full", fn, args, argnums, has_aux, allow_stop_gradient,
                    options, lambda prob, tol, allowed: _full_mode.run_full(
                        prob, tol, options, allowed))
