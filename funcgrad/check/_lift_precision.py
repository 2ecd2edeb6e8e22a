"""Which float a checked function computes in, and lifting it to float64 for the check
(private to `funcgrad.check`; the lifting interpreter is `funcgrad.check._lift`).

A function that rounds to bfloat16 (or float32 under float64 inputs) on the differentiated path
has central differences no better than its rounding allows: checked as computed, a 10% error in
a bfloat16 custom rule hides under bfloat16's tolerances. Lifted, the same program, custom
rules included, runs in float64 and the check's float64 tolerances see it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import sub_jaxprs
from funcgrad.check import _cache
from funcgrad.check import _objective as obj


def narrowest_float(jaxpr) -> str | None:
    """The narrowest real floating dtype produced by an equation of `jaxpr` on the
    differentiated path: it depends on the first input (theta, the differentiated vector)
    through floating values, and an output depends on it through floating values. A call
    (jit, checkpoint, a custom rule's primal program) and each branch of a cond are followed
    inside with the same rule; the nested jaxprs of other equations on the path (scan, while)
    count whole.
    Returned as a name; None if no equation is on that path.

    Left out, since they do not round the derivative being checked: work on constants (data
    prepared in float32 inside fn); values computed after an integer or boolean result
    (``(logits.argmax(-1) == y).mean()`` is float32 even under x64, and carries no tangent);
    values that reach the outputs only through integer or boolean results (a float bitcast
    to its bits, cast to int, compared: ``jnp.frexp`` inside jax 0.12's ``ndtri``); and values
    no output uses (an accuracy returned as aux, dropped from the checked output).
    """
    found: set[str] = set()
    _narrow(jaxpr, [i == 0 for i in range(len(jaxpr.invars))], [True] * len(jaxpr.outvars),
            found)
    return min(found, key=lambda d: jnp.finfo(d).bits) if found else None


def _is_var(v) -> bool:
    return not ji.is_literal(v)


def _inexact(v) -> bool:
    return bool(jnp.issubdtype(getattr(v.aval, "dtype", np.int32), jnp.inexact))


def _note(v, found: set) -> None:
    dtype = getattr(v.aval, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        found.add(str(dtype))


def _note_all(jaxpr, found: set) -> None:
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            _note(v, found)
        for _, sub, _ in sub_jaxprs(eqn):
            _note_all(sub, found)


def _narrow(jaxpr, live_in: list, used_out: list, found: set) -> None:
    """`narrowest_float` on `jaxpr` whose inputs `live_in` carry theta's tangent and whose
    outputs `used_out` reach the checked output; adds the floats on that path to `found`."""
    # What the used outputs depend on through values that carry a cotangent, backwards.
    used = {v for v, u in zip(jaxpr.outvars, used_out) if u and _is_var(v) and _inexact(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in used for v in eqn.outvars):
            used.update(v for v in eqn.invars if _is_var(v) and _inexact(v))
    live = {v for v, flag in zip(jaxpr.invars, live_in) if flag}
    for eqn in jaxpr.eqns:
        ins_live = [_is_var(v) and v in live for v in eqn.invars]
        if not any(ins_live):
            continue
        # A tangent flows on through floating outputs only (an int or bool has none).
        live.update(v for v in eqn.outvars if _inexact(v))
        outs_used = [v in used for v in eqn.outvars]
        if not any(outs_used):
            continue
        called = ji.body(eqn)
        if called is not None and len(called[0].outvars) == len(eqn.outvars):
            sub = called[0]
            _narrow(sub, ins_live[len(ins_live) - len(sub.invars):], outs_used, found)
            continue
        if ji.kind(eqn) == "cond":  # each branch runs on the operands after the index
            for branch, _ in ji.cond_branches(eqn):
                _narrow(branch, ins_live[1:], outs_used, found)
            continue
        for v in eqn.outvars:
            _note(v, found)
        for _, sub, _ in sub_jaxprs(eqn):
            _note_all(sub, found)


def lift_precision_of(prob, lift, modes, rtol_as_computed):
    # rtol_as_computed: (rtol, atol) of the dtype as computed, for the note's resolution.
    """`prob` checked in float64 when fn computes in a narrower float: its spec lifted
    (`funcgrad.check._lift`), ``dtype_used`` float64 and ``lifted_from`` the narrow dtype, with a
    note; or, when lifting is off or cannot reach every value on the differentiated path, as
    computed, with a note giving the smallest relative error the check can see (its rtol)."""
    low = prob["dtype_used"]
    prob = dict(prob, lifted_from=None)
    if low == "float64":
        return prob
    notes = [n for n in prob["notes"] if not n.startswith("fn computes in")]
    rtol, atol = rtol_as_computed
    as_computed = (f"eps and tolerances are those of {low}: this check could not see errors "
                   f"below {atol:g} + {rtol:g}·|derivative| (relative errors below {rtol:g}, and "
                   f"any error at all in a derivative smaller than {atol:g}).")
    if not lift:
        return dict(prob, notes=[f"fn computes in {low}; checked as computed "
                                 f"(lift_precision=False): {as_computed}", *notes])
    lifted = prob["spec"]._replace(lift_precision=True)
    reason = _not_liftable(lifted, prob, modes)
    if reason:
        return dict(prob, weaker=(f"checked in {low}, not float64: {reason}"), notes=[
            f"fn computes in {low}; its casts could not be lifted to float64 ({reason}), so "
            f"it was checked as computed (weaker than asked: "
            f"report.raise_if_failed(strict=True) treats that as a failure): {as_computed}",
            *notes])
    return dict(prob, spec=lifted, dtype_used="float64", lifted_from=low, notes=[
        f"fn computes in {low}; the check lifted its {low} casts to float64 (custom rules "
        "included) and used float64's eps and tolerances (lift_precision=False checks it as "
        "computed).", *notes])


class LiftError(RuntimeError):
    """check_grads could not build the float64 version of a narrower-precision function: a
    fault of funcgrad's lifting interpreter, not of the checked function. Raised rather than
    falling back to a check at the narrow dtype's tolerances, which would pass errors the
    requested check would catch; ``CheckOptions(lift_precision=False)`` checks the function as
    computed."""


#: `_not_liftable`'s verdicts, per lifted spec (fn included, by identity), derivative and the
#: signature of the check's inputs: tracing and lowering the derivative is most of a repeated
#: check of a small function (0.37 s of 0.6 s for a dropout layer's random bits, 2-core CPU),
#: and depends on nothing else (the values are traced).
_verdicts = _cache.LRU(64)
_MISSING = object()


def _not_liftable(lifted, prob, modes) -> str | None:
    """Why the lifted program cannot be checked in float64 (None if it can): a value on the
    differentiated path stays narrower than float64 (a bitcast, a host callback, a primitive
    the lifting does not enter: by design, a weaker check the report states). Verdicts are
    cached (`_verdicts`); errors are not.

    Raises:
      LiftError: tracing the lifted program, or tracing and lowering its derivative (where a
        mistyped lifted equation would show), fails: funcgrad's fault, never a silent
        fallback to the narrow dtype's tolerances.
      funcgrad.JaxInternalsError: the lifting could not read a JAX internal."""
    theta, leaves, cots = prob["theta"], prob["leaves"], prob["cotangents"]
    rev = "rev" in modes or lifted.order > 1
    key = (lifted, rev, _cache.signature((theta, leaves, cots)))
    if not _cache.hashable(key):
        return _lifting_fails_or_narrows(lifted, prob, rev)
    verdict = _verdicts.get(key, _MISSING)
    if verdict is _MISSING:
        verdict = _lifting_fails_or_narrows(lifted, prob, rev)
        _verdicts.put(key, verdict)
    return verdict


def _lifting_fails_or_narrows(lifted, prob, rev) -> str | None:
    """`_not_liftable` uncached (`rev`: its derivative is a gradient, else a jvp)."""
    theta, leaves, cots = prob["theta"], prob["leaves"], prob["cotangents"]

    def trace(spec):
        phi = functools.partial(obj.objective, spec, leaves=leaves, cotangents=cots)
        if rev:
            derivative = jax.grad(phi)
        else:
            derivative = lambda t: jax.jvp(phi, (t,), (t,))[1]  # noqa: E731
        found = [jax.make_jaxpr(phi)(theta)]
        traced = jax.jit(derivative).trace(theta)
        traced.lower()  # no compilation
        return found + [traced.jaxpr]

    try:
        jaxprs = trace(lifted)
    except ji.JaxInternalsError:
        raise
    except Exception as error:  # noqa: BLE001 - the lifting's fault: said, never hidden
        try:
            trace(prob["spec"])
        except Exception:  # noqa: BLE001 - fn's own derivative fails the same way (a
            return None    # while_loop under grad): the check run reports it in fn's terms
        import jax as _jax
        raise LiftError(
            f"{prob['who']} could not lift fn's {prob['dtype_used']} computation to float64 "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}) on jax "
            f"{_jax.__version__}. This is a fault of funcgrad's lifting, not of fn: please "
            "report it. To check fn at its own precision meanwhile (errors below that "
            "precision's tolerances pass unseen), pass "
            "options=funcgrad.CheckOptions(lift_precision=False).") from error
    for traced in jaxprs:
        left = narrowest_float(traced.jaxpr)
        if left not in (None, "float64"):
            return (f"a value on the differentiated path stays {left}: a bitcast, a host "
                    "callback or a primitive the lifting does not enter")
    return None
