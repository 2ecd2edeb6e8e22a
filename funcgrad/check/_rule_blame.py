"""Which custom rule a failed gradient check points at (private to `funcgrad.check`).

A ``jax.custom_vjp`` activation whose backward is 1% too large fails the check on the parameter
elements around it (``l2.weight`` row 5); the fault sits in the rule between two layers. When a
check fails and fn calls custom rules, each rule is checked on its own: the program is run to
the check point, recording the inputs of every custom_jvp / custom_vjp call (inside jit and
checkpoint; a rule inside a loop or cond is not reached: named as unchecked), and at those
inputs the rule's vjp is compared, in float64 (`funcgrad.check._lift`), with JAX's own vjp of
the rule's primal program (the rule inlined), for a random output cotangent. A rule whose vjp
differs by more than `RTOL` (relative, per input) is named with its function, the line that
called it and its backward's file and line.
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import interpret, is_float, source_line
from funcgrad.check import _lift
from funcgrad.check import _objective as obj

#: A rule's float64 vjp may differ from JAX's derivative of its primal by rounding only (both
#: evaluated in float64 at the same inputs); a wrong rule differs by its error (1% and up).
RTOL = 1e-6


def blame(prob: dict, seed: int = 0) -> list[str]:
    """Sentences naming each custom rule whose vjp is wrong at the check point, and the rules
    the check could not reach; [] when fn has no custom rule or every reached rule is right."""
    spec = prob["spec"]._replace(order=1)
    theta, leaves = prob["theta"], prob["leaves"]
    closed = jax.make_jaxpr(lambda t: obj.output_vector(spec, t, leaves))(theta)
    jaxpr, consts = ji.closed_parts(closed)
    found: list[Any] = []
    unreached: list[tuple[str, str]] = []
    _find(jaxpr, found, unreached, inside=None)
    if not found and not unreached:
        return []

    def record(t):
        inputs: list[list] = []

        def rule(eqn, ins):
            if ji.kind(eqn) in ji.CUSTOM_KINDS:
                inputs.append(list(ins))
                return None
            if ji.kind(eqn) in ji.CALL_KINDS:
                sub, sub_consts = ji.call_body(eqn)
                return interpret(sub, sub_consts, ins[len(ins) - len(sub.invars):], rule)
            return None
        interpret(jaxpr, consts, [t], rule)
        return inputs

    recorded = jax.jit(record)(theta) if found else []
    out = []
    rng = np.random.default_rng(seed)
    for eqn, ins in zip(found, recorded):
        wrong = _check_rule(eqn, ins, rng)
        if wrong:
            out.append(f"{_describe(eqn)} is wrong at the check point: {wrong}. The failing "
                       "elements' derivatives pass through it; fix its backward rule (check it "
                       "alone: fg.check_grads on the function with its inputs here).")
    out += [f"{name} was not checked on its own ({why})." for name, why in unreached]
    return out


def _find(jaxpr, found: list, unreached: list, inside: str | None) -> None:
    """The custom-rule equations a jit/checkpoint path reaches, in evaluation order; rules
    inside loops and conds as ``(name, why)``."""
    for eqn in jaxpr.eqns:
        kind = ji.kind(eqn)
        if kind in ji.CUSTOM_KINDS:
            if inside is None:
                found.append(eqn)
            else:
                unreached.append((_describe(eqn), f"it runs inside a {inside}"))
            continue
        if kind in ji.CALL_KINDS:
            _find(ji.call_body(eqn)[0], found, unreached, inside)
            continue
        for _, sub, _ in ji.sub_jaxprs(eqn):
            _find(sub, found, unreached, inside or kind)


def _check_rule(eqn, ins: list, rng) -> str | None:
    """How the rule's vjp differs from JAX's vjp of its primal at `ins`; None if it agrees."""
    nc = (ji.custom_vjp(eqn) if ji.kind(eqn) == "custom_vjp" else ji.custom_jvp(eqn)).num_consts
    consts, xs = ins[:nc], ins[nc:]
    diff = [k for k, v in enumerate(eqn.invars[nc:]) if is_float(v.aval.dtype)]
    outs = [k for k, v in enumerate(eqn.outvars) if is_float(v.aval.dtype)]
    if not diff or not outs:
        return None
    with jax.enable_x64(True):
        program = jax.make_jaxpr(lambda *a: ji.bind(eqn, [*consts, *a]))(*xs)
        jaxpr, program_consts = ji.closed_parts(program)
        cts = [rng.standard_normal(np.shape(eqn.outvars[k].aval)) for k in outs]

        def pullback(flags):
            def g(*d):
                full = list(xs)
                for k, x in zip(diff, d):
                    full[k] = x
                y = _lift.evaluate(jaxpr, program_consts, full, flags)
                return [y[k] for k in outs]
            start = [jnp.asarray(xs[k], jnp.float64) for k in diff]
            _, pull = jax.vjp(g, *start)
            return [np.asarray(c, np.float64) for c in pull([jnp.asarray(c) for c in cts])]

        try:
            got = pullback(_lift.Flags(lift_precision=True))
            want = pullback(_lift.Flags(lift_precision=True, inline_custom_rules=True))
        except ji.JaxInternalsError:
            raise
        except Exception:  # noqa: BLE001 - a rule that cannot be differentiated on its own
            return None
    worst = None
    for k, a, b in zip(diff, got, want):
        scale = float(np.linalg.norm(b)) or 1.0
        rel = float(np.linalg.norm(a - b)) / scale
        if rel > RTOL and (worst is None or rel > worst[1]):
            worst = (k, rel)
    if worst is None:
        return None
    names = _input_names(eqn)
    k = worst[0]
    arg = names[k] if k < len(names) and names[k] else f"input {k} (0-based)"
    return (f"its vjp for {arg} differs from JAX's derivative of its primal by {worst[1]:.3g} "
            "relative (float64, a random output cotangent)")


def _describe(eqn) -> str:
    kind = "custom_vjp" if ji.kind(eqn) == "custom_vjp" else "custom_jvp"
    name = ji.function_name(eqn) or f"a {kind} function"
    where = source_line(eqn)
    text = f"the {kind} rule of {name}" + (f" called at {where}" if where else "")
    rule = (ji.custom_vjp(eqn).user_bwd() if kind == "custom_vjp"
            else getattr(ji.custom_jvp(eqn).jvp_jaxpr_fun, "f", None))
    rule = inspect.unwrap(rule) if callable(rule) else None
    if rule is None:
        return text
    try:
        file = os.path.basename(inspect.getsourcefile(rule) or "")
        text += f" (its {'bwd' if kind == 'custom_vjp' else 'jvp'} "
        text += f"{getattr(rule, '__name__', '')} at {file}:{inspect.getsourcelines(rule)[1]})"
    except (TypeError, OSError):
        pass
    return text


def _input_names(eqn) -> list:
    info = getattr(ji.call_body(eqn)[0], "debug_info", None)
    return list(getattr(info, "arg_names", None) or ())
