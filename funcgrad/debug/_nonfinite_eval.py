"""The eager jaxpr evaluator behind `funcgrad.debug.anomaly.find_nonfinite` (private).

`_Evaluator.forward` runs a jaxpr equation by equation on concrete values, entering nested
jaxprs, and gives each non-finite value its `_Origin`: the first equation on its path that made
a non-finite value from finite operands. The forward pass tracks that per element (`_V.ids`):
elementwise primitives keep each element's own origin, and primitives that only move elements
(slice, gather, reshape, select_n, ...) move the origins with them, so a masked inf elsewhere
in an array does not take the blame for a new one. An origin made from a non-finite literal or
constant (``jnp.where(mask, s, -jnp.inf)``) is a *sentinel*: where a reduction or matmul mixes
elements, a computed origin outranks it. `_Evaluator.backward` then pulls the loss's cotangent
back through the recorded `_Step`s, one ``jax.vjp`` per equation. The approach, and why it was
chosen, is described in `funcgrad.debug.anomaly`; the reports are built there.
"""
from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util

from funcgrad import _jax_internals as ji
from funcgrad.debug._nonfinite_origin import (
    _V,
    _at,
    _earliest,
    _finite,
    _Frame,
    _is_float,
    _label,
    _loc,
    _operand_name,
    _Origin,
    _Step,
    _sum,
)

# Lines of this file are never "the user's line".
source_info_util.register_exclusion(__file__)


_in_transpose = ji.in_transpose
_bind = ji.bind


                            # (None: no per-element record; then every element has `org`)


class _Evaluator:
    """Evaluates jaxprs equation by equation, tracking origins; then pulls cotangents back."""

    def __init__(self):
        self._seq = itertools.count()
        self.forward_origins: list[_Origin] = []
        self.by_seq: list[_Origin] = []  # every origin, at the index of its seq

    def new(self, phase, primitive, frame, operands, produced, produced_name, **kw) -> _Origin:
        origin = _Origin(next(self._seq), phase, primitive, frame.loc, frame.context,
                         list(operands), produced, produced_name, **kw)
        self.by_seq.append(origin)
        if phase != "backward" or origin.own_transpose:
            self.forward_origins.append(origin)
        return origin

    # forward ---------------------------------------------------------------------------------

    def forward(self, jaxpr, consts, args: list[_V], frame: _Frame, record: bool):
        """Evaluates `jaxpr`; returns its outputs as `_V`s and the tape for `backward`."""
        env = {v: _V(c, None, False) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return _V(v.val, None, False) if ji.is_literal(v) else env[v]

        tape = []
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            here = frame._replace(loc=_loc(eqn, frame.loc),
                                  own_transpose=frame.own_transpose or _in_transpose(eqn))
            outs, step = self._eqn(eqn, ins, here, record)
            env.update(zip(eqn.outvars, outs))
            if record and any(v.act for v in ins):
                tape.append(step)
        return [read(v) for v in jaxpr.outvars], tape

    def _eqn(self, eqn, ins, frame, record):
        name, kind = ji.name(eqn), ji.kind(eqn)
        step = _Step("prim", eqn, ins, [], frame)
        if kind in ji.CALL_KINDS:
            sub, consts = ji.call_body(eqn)
            outs, tape = self.forward(sub, consts, ins[len(ins) - len(sub.invars):],
                                      frame.enter(_at(_label(eqn), frame.loc)), record)
            step.kind, step.sub = "call", (sub, tape)
        elif kind == "cond":
            branches = ji.cond_branches(eqn)
            index = int(np.clip(int(ins[0].x), 0, len(branches) - 1))
            sub, consts = branches[index]
            outs, tape = self.forward(sub, consts, ins[1:],
                                      frame.enter(_at(f"cond branch {index}", frame.loc)), record)
            step.kind, step.sub = "cond", (sub, tape)
        elif kind == "scan" and ji.scan(eqn).length > 0:
            outs, step.sub = self._scan(eqn, ins, frame, record)
            step.kind = "scan"
        else:
            values = _bind(eqn, [v.x for v in ins])
            if kind == "while":
                orgs = [v.org for v in self._while(eqn, ins, frame)]
            elif kind in ji.CUSTOM_KINDS:  # look inside; differentiate as a whole
                sub, consts = ji.call_body(eqn)
                inner, _ = self.forward(sub, consts, ins[len(ins) - len(sub.invars):],
                                        frame.enter(_at(_label(eqn), frame.loc)), False)
                orgs = None  # the inner evaluation's per-element origins, on the bound values
                outs = [_V(x, v.org, False, v.ids) for x, v in zip(values, inner)]
            else:
                orgs = None
                outs = self._element_origins(eqn, ins, values, frame)
            active = any(v.act for v in ins) and name != "stop_gradient"
            if orgs is not None:
                outs = [_V(x, o, False) for x, o in zip(values, orgs)]
            outs = [v._replace(act=active and _is_float(v.x)) for v in outs]
        step.outs = [v.x for v in outs]
        return outs, step

    def _element_origins(self, eqn, ins, values, frame) -> list[_V]:
        """The outputs of a primitive with the origin of each non-finite element (`_V.ids`)."""
        bad = [not _finite(x) for x in values]
        if not any(bad):
            return [_V(x, None, False) for x in values]
        made: dict[int, _Origin] = {}  # this equation's own origins, made at most once each

        def mine(k, code):
            if code not in made:
                # Made from a non-finite literal or constant (no origin of its own): a sentinel.
                constant = code == _NEW and any(v.org is None and not _finite(v.x) for v in ins)
                made[code] = self.new(
                    "backward" if frame.own_transpose else "forward", ji.name(eqn), frame,
                    [(_operand_name(var, i), v.x) for i, (var, v) in
                     enumerate(zip(eqn.invars, ins))],
                    values[k], f"output {k}", own_transpose=frame.own_transpose,
                    sentinel=constant, constant=constant,
                    from_infinities=code == _NAN_OF_SENTINELS)
            return made[code]

        outs = []
        for k, (x, b) in enumerate(zip(values, bad)):
            if not b:
                outs.append(_V(x, None, False))
                continue
            with np.errstate(all="ignore"):
                ids = self._ids(eqn, ins, x, len(values))
            for code in (_NEW, _NAN_OF_SENTINELS):
                if (ids == code).any():
                    ids = np.where(ids == code, mine(k, code).seq, ids)
            found = [self.by_seq[i] for i in np.unique(ids[ids >= 0])]
            outs.append(_V(x, _earliest(*found), False, ids))
        return outs

    def _ids(self, eqn, ins, out, n_out: int) -> np.ndarray:
        """The origin seq of each element of the non-finite output `out`: -1 where it is finite,
        `_NEW` where this equation made it non-finite, `_NAN_OF_SENTINELS` where it made a NaN
        of infinities that all come from constants (-inf - -inf in a fully masked softmax row,
        -inf * 0 in a matmul)."""
        bad = ~np.isfinite(np.asarray(out))
        name, shape = ji.name(eqn), np.shape(out)
        floats = [v for v in ins if _is_float(v.x)]
        ids = None
        if name in _MOVES and n_out == 1:
            try:
                moved = _bind(eqn, [self._id_array(v) if _is_float(v.x) else v.x for v in ins])[0]
                ids = np.asarray(moved).astype(np.int64)
            except Exception:  # noqa: BLE001 - a parameter that wants the float dtype
                ids = None
        elif name in _ELEMENTWISE:
            # Operands broadcast to the output (JAX's elementwise ops take [2, 3] with [2, 1]).
            operands = [v for v in floats if _broadcasts(np.shape(v.x), shape)]
            if operands:
                ids = self._best(np.stack([np.broadcast_to(self._id_array(v), shape)
                                           for v in operands]))
        elif name in _ALONG_AXES and len(floats) == 1 and np.ndim(floats[0].x) >= 1:
            ids = self._along_axes(eqn, floats[0], shape)
        if ids is None:  # mixes elements (a matmul, ...): the best origin among its inputs
            best = _earliest(*(v.org for v in ins))
            ids = np.full(shape, _NEW if best is None else best.seq, np.int64)
        if ids.shape != shape:
            ids = np.broadcast_to(ids, shape)
        # A NaN this equation made of infinities that all come from constants is its own doing
        # (infinities from an argument stay the argument's: bad data is not a mask).
        constant = np.array([o.constant for o in self.by_seq] or [False])
        inherited = ids >= 0
        if (np.isnan(np.asarray(out)) & inherited).any() and not any(
                np.isnan(np.asarray(v.x)).any() for v in floats):
            from_constants = constant[np.clip(ids, 0, None)] & inherited
            ids = np.where(np.isnan(np.asarray(out)) & from_constants, _NAN_OF_SENTINELS, ids)
        known = ((ids >= 0) & (ids < len(self.by_seq))) | (ids == _NAN_OF_SENTINELS)
        return np.where(bad, np.where(known, ids, _NEW), -1)

    def _along_axes(self, eqn, operand: _V, shape) -> np.ndarray | None:
        """Reductions, sorts and scans along axes: each output element takes the best origin of
        the input elements on its line (its row for a row-wise max or sort), not of the whole
        array."""
        p, ndim = ji.params(eqn), np.ndim(operand.x)
        axes = tuple(p["axes"]) if "axes" in p else (
            (p["axis"],) if "axis" in p else (p["dimension"],) if "dimension" in p else (-1,))
        axes = tuple(a % ndim for a in axes)
        ids = np.asarray(self._id_array(operand), np.int64)
        best = self._from_keys(np.min(self._keys(ids), axis=axes, keepdims=True))
        self._merge_losers(ids, np.broadcast_to(best, ids.shape))
        squeezed = np.squeeze(best, axis=axes)
        if squeezed.shape == tuple(shape):  # a reduction drops its axes
            return squeezed
        try:  # sorts and cumulative ops keep the shape; top_k keeps k of the last axis
            return np.broadcast_to(best, shape)
        except ValueError:
            return None

    def _id_array(self, v: _V) -> np.ndarray:
        """`v`'s element origins as int32: its `ids`, or `org` on every non-finite element."""
        if v.ids is not None:
            return np.asarray(v.ids, np.int32)
        bad = ~np.isfinite(np.asarray(v.x))
        seq = -1 if v.org is None else v.org.seq
        return np.where(bad, seq, -1).astype(np.int32)

    def _best(self, stacked: np.ndarray) -> np.ndarray:
        """Per element, the best-ranked origin (`_rank`) over the first axis; -1 if none. An
        origin that loses to another at some element is marked as merged into it (`into`), so
        that it is not listed as masked when the winner reaches the output."""
        best = self._from_keys(np.min(self._keys(stacked), axis=0))
        self._merge_losers(stacked, np.broadcast_to(best, stacked.shape))
        return best

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        """Origin seqs as keys whose order is `_rank`'s (computed before sentinels, then by
        seq): seq, plus n + 1 for a sentinel; `_NO_KEY` where there is no origin (-1)."""
        sentinel = np.array([o.sentinel for o in self.by_seq] or [False])
        safe = np.clip(ids, 0, None)
        return np.where(ids >= 0, safe + sentinel[safe] * (len(self.by_seq) + 1), _NO_KEY)

    def _from_keys(self, keys: np.ndarray) -> np.ndarray:
        """The origin seqs of `_keys` (-1 for `_NO_KEY`)."""
        n = len(self.by_seq)
        return np.where(keys == _NO_KEY, -1, np.where(keys > n, keys - (n + 1), keys))

    def _merge_losers(self, ids: np.ndarray, winners: np.ndarray) -> None:
        """Marks each origin in `ids` that lost to `winners` (same shape) as merged into it."""
        losers = (ids >= 0) & (winners >= 0) & (ids != winners)
        for loser, winner in set(zip(ids[losers].tolist(), winners[losers].tolist())):
            self.by_seq[loser].into = self.by_seq[winner]

    def _scan(self, eqn, ins, frame, record):
        s = ji.scan(eqn)
        nc, nk, length = s.num_consts, s.num_carry, s.length
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        ys, iterations = {}, []
        for t in (reversed(range(length)) if s.reverse else range(length)):
            xs_t = [_V(v.x[t], v.org if not _finite(v.x[t]) else None, v.act,
                       None if v.ids is None else v.ids[t]) for v in xs]
            outs, tape = self.forward(
                s.body, s.body_consts, [*consts, *carry, *xs_t],
                frame.enter(_at("scan", frame.loc) + f", iteration {t} (0-based) of {length}"),
                record)
            carry, ys[t] = outs[:nk], outs[nk:]
            iterations.append((t, tape))
        stacked = [_V(jnp.stack([ys[t][j].x for t in range(length)]),
                      _earliest(*(ys[t][j].org for t in range(length))),
                      any(ys[t][j].act for t in range(length)),
                      None if all(ys[t][j].ids is None for t in range(length)) else
                      np.stack([self._id_array(ys[t][j]) for t in range(length)]))
                   for j in range(len(ys[0]))]
        return [*carry, *stacked], (s, iterations)

    def _while(self, eqn, ins, frame):
        """Runs a while_loop's condition and body in Python, for the origins of its outputs."""
        w = ji.while_loop(eqn)
        cn, bn = w.cond_nconsts, w.body_nconsts
        carry = ins[cn + bn:]
        for it in itertools.count():
            here = frame.enter(_at("while_loop", frame.loc) + f", iteration {it} (0-based)")
            (pred,), _ = self.forward(w.cond, w.cond_consts,
                                      [*ins[:cn], *carry], here, False)
            if not bool(pred.x):
                return carry
            carry, _ = self.forward(w.body, w.body_consts,
                                    [*ins[cn:cn + bn], *carry], here, False)

    # backward --------------------------------------------------------------------------------

    def backward(self, jaxpr, tape, out_cts: list[_V | None]) -> list[_V | None]:
        """Pulls the cotangents of `jaxpr`'s outputs back through its `tape`; returns those of
        its inputs, None where nothing arrived (a symbolic zero)."""
        ct: dict[Any, _V] = {}

        def add(var, c: _V | None, frame: _Frame | None):
            if c is None or ji.is_literal(var):
                return
            if var not in ct:
                ct[var] = c
                return
            before = ct[var]
            total = _V(before.x + c.x, _earliest(before.org, c.org), True)
            if total.org is None and not _finite(total.x):  # finite + finite overflowed
                total = total._replace(org=self.new(
                    "backward", "add_any", frame, [("cotangent", before.x), ("cotangent", c.x)],
                    total.x, "their sum"))
            ct[var] = total

        for var, c in zip(jaxpr.outvars, out_cts):
            add(var, c, None)
        for step in reversed(tape):
            cts = [ct.get(v) for v in step.eqn.outvars]
            if all(c is None for c in cts):
                continue  # a symbolic zero: jax.grad skips this equation too
            for var, c in zip(step.eqn.invars, getattr(self, "_back_" + step.kind)(step, cts)):
                add(var, c, step.frame)
        return [ct.get(v) for v in jaxpr.invars]

    def _back_prim(self, step, cts):
        eqn, n = step.eqn, len(step.eqn.invars)
        idx = [i for i, v in enumerate(step.ins) if v.act]
        floats = [j for j, x in enumerate(step.outs) if _is_float(x)]
        if not idx or not floats:
            return [None] * n

        def one_equation(*xs):
            values = [v.x for v in step.ins]
            for i, x in zip(idx, xs):
                values[i] = x
            outs = _bind(eqn, values)
            return [outs[j] for j in floats]

        _, pullback = jax.vjp(one_equation, *[step.ins[i].x for i in idx])
        got = pullback([(cts[j].x if cts[j] is not None else jnp.zeros_like(step.outs[j]))
                        .astype(jnp.result_type(step.outs[j])) for j in floats])
        incoming = _earliest(*(c.org for c in cts if c is not None))
        result: list[_V | None] = [None] * n
        origin = None
        for i, g in zip(idx, got):
            if not _finite(g):
                origin = origin or incoming or self._backward_origin(step, cts, floats, g, i)
            result[i] = _V(g, origin if not _finite(g) else None, True)
        return result

    def _backward_origin(self, step, cts, floats, produced, i):
        eqn = step.eqn
        operands = [(_operand_name(var, k), v.x) for k, (var, v) in enumerate(zip(eqn.invars,
                                                                                  step.ins))]
        operands += [(f"cotangent of output {j}", cts[j].x) for j in floats if cts[j] is not None]
        name = _label(eqn) if ji.kind(eqn) in ji.CUSTOM_KINDS else ji.name(eqn)
        sources = []  # where the operands' non-finite elements came from (a NaN data row?)
        for v in step.ins:
            if v.org is not None:
                seqs: list[int] | np.ndarray = [] if v.ids is None else np.unique(np.asarray(v.ids))
                sources += [self.by_seq[s] for s in seqs if s >= 0] or [v.org]
        return self.new("backward", name, step.frame, operands, produced,
                        f"cotangent of operand {i}", forward_out=[step.outs[j] for j in floats],
                        sources=list(dict.fromkeys(sources)))

    def _back_call(self, step, cts):
        sub, tape = step.sub
        got = self.backward(sub, tape, cts)
        return [None] * (len(step.eqn.invars) - len(got)) + got

    _back_cond = _back_call

    def _back_scan(self, step, cts):
        s, iterations = step.sub
        nc, nk, length = s.num_consts, s.num_carry, s.length
        carry, ys = cts[:nk], cts[nk:]
        consts: list[_V | None] = [None] * nc
        xs: dict[int, list[_V | None]] = {}
        for t, tape in reversed(iterations):
            ys_t = [None if c is None else _V(c.x[t], c.org if not _finite(c.x[t]) else None, True)
                    for c in ys]
            got = self.backward(s.body, tape, [*carry, *ys_t])
            consts = [_sum(a, b) for a, b in zip(consts, got[:nc])]
            carry, xs[t] = got[nc:nc + nk], got[nc + nk:]
        stacked: list[_V | None] = []
        for j, x in enumerate(step.ins[nc + nk:]):
            parts = [xs[t][j] for t in range(length)]
            if all(c is None for c in parts):
                stacked.append(None)
                continue
            zero = jnp.zeros_like(x.x[0])
            stacked.append(_V(jnp.stack([zero if c is None else c.x for c in parts]),
                              _earliest(*(c.org for c in parts if c is not None)), True))
        return [*consts, *carry, *stacked]


#: Primitives that only move, copy or choose elements: applied to the origin seqs (int32 in
#: place of each float operand), they say where each output element came from.
_MOVES = frozenset({
    "slice", "dynamic_slice", "gather", "reshape", "transpose", "broadcast_in_dim", "squeeze",
    "expand_dims", "rev", "concatenate", "pad", "dynamic_update_slice", "select_n", "copy",
    "copy_p"})
#: Primitives whose output element i depends on element i of each operand only.
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt",
    "cbrt", "pow", "integer_pow", "square", "sin", "cos", "tan", "asin", "acos", "atan",
    "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "logistic", "abs", "sign",
    "floor", "ceil", "round", "max", "min", "convert_element_type", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "rem", "clamp", "nextafter", "real", "imag", "conj",
    "reduce_precision", "stop_gradient", "add_any", "one_minus_square"})
#: Primitives along axes (reductions, sorts, cumulative ops, top_k): `_Evaluator._along_axes`.
_ALONG_AXES = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "sort", "cumsum", "cumprod",
    "cummax", "cummin", "cumlogsumexp", "top_k"})


def _broadcasts(operand_shape, out_shape) -> bool:
    try:
        return np.broadcast_shapes(operand_shape, out_shape) == tuple(out_shape)
    except ValueError:
        return False


#: `_Evaluator._keys` where an element has no origin.
_NO_KEY = np.iinfo(np.int64).max


#: In `_Evaluator._ids`: an element this equation made non-finite, and a NaN it made of
#: infinities that all come from constants.
_NEW = -2
_NAN_OF_SENTINELS = -3


