"""Where a non-finite value came from (`_Origin`: the first equation that made it of finite
operands), and the values, frames and steps that carry origins through
`funcgrad.debug._nonfinite_eval._Evaluator` (private).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import source_line

# Lines of this file are never "the user's line".
source_info_util.register_exclusion(__file__)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _finite(x) -> bool:
    try:
        if not _is_float(x):
            return True
    except TypeError:  # PRNG keys and other extended dtypes
        return True
    return bool(np.all(np.isfinite(np.asarray(x))))


@dataclasses.dataclass(frozen=True)
class _Loc:
    where: str = ""
    file: str | None = None
    line: int | None = None


_SUMMARY = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?::\d+)? \(")


def _loc(eqn, outer: _Loc) -> _Loc:
    where = source_line(eqn)
    if not where:
        return outer
    match = _SUMMARY.match(ji.source_summary(eqn))
    return _Loc(where, match["file"], int(match["line"])) if match else _Loc(where)


def _at(label: str, loc: _Loc) -> str:
    return f"{label} at {loc.where}" if loc.where else label


@dataclasses.dataclass(eq=False)
class _Origin:
    """The equation that first produced a non-finite value from finite operands."""
    seq: int                      # creation order: smaller is earlier
    phase: str
    primitive: str
    loc: _Loc
    context: tuple[str, ...]
    operands: list                # (name, value) pairs
    produced: Any
    produced_name: str
    forward_out: list = dataclasses.field(default_factory=list)  # backward: forward outputs
    own_transpose: bool = False   # inside a derivative that fn computes itself
    into: _Origin | None = None   # the origin this one merged into downstream
    sentinel: bool = False        # ranks below computed origins: a constant, or an argument
    constant: bool = False        # made from a non-finite literal or constant (a -inf mask)
    from_infinities: bool = False  # a NaN this equation made of sentinel infinities (inf - inf)
    sources: list = dataclasses.field(default_factory=list)  # backward: forward origins of the
                                                             # operands' non-finite elements

    def reaches(self, reached: set) -> bool:
        o: _Origin | None = self
        while o is not None and o not in reached:
            o = o.into
        return o is not None


def _rank(origin: _Origin) -> tuple[bool, int]:
    """Which origin takes the blame where several meet: a computed one before a sentinel, then
    the first created."""
    return origin.sentinel, origin.seq


def _earliest(*origins):
    """The first-ranked of `origins` (`_rank`; None if all are None). The others are marked as
    merged into it, so that they do not count as masked when it reaches the output."""
    present = [o for o in origins if o is not None]
    if not present:
        return None
    first = min(present, key=_rank)
    for o in present:
        if o is not first:
            o.into = first
    return first


class _V(NamedTuple):
    """A value during evaluation."""
    x: Any                  # the array
    org: _Origin | None     # where it became non-finite (None while it is finite)
    act: bool               # depends on a differentiated argument
    ids: Any = None         # forward pass: the seq of each element's origin, -1 where finite


class _Frame(NamedTuple):
    """Where the evaluator is: the user's line, the enclosing calls, and whether it is inside a
    derivative that fn computes itself."""
    loc: _Loc
    context: tuple[str, ...]
    own_transpose: bool

    def enter(self, text: str) -> _Frame:
        return self._replace(context=self.context + (text,))


@dataclasses.dataclass
class _Step:
    """An evaluated equation that depends on a differentiated argument, for the reverse pass."""
    kind: str               # "prim" (pulled back by its own rule), "call", "cond" or "scan"
    eqn: Any
    ins: list[_V]
    outs: list
    frame: _Frame
    sub: Any = None         # call/cond: (jaxpr, tape); scan: (body, [(iteration, tape)])


def _label(eqn) -> str:
    """``jit 'norm'``, ``custom_vjp_call 'my_fn'``: the primitive and the function's name.

    A custom rule of JAX's own around a function it names ``_<name>_impl`` is named by the
    user's word for it: ``jax.nn.logsumexp`` (a custom_jvp from jax 0.12.1 on, around
    ``_logsumexp_impl``) is ``"logsumexp"``."""
    name = ji.name(eqn)
    fn = ji.function_name(eqn)
    if fn and ji.kind(eqn) in ji.CUSTOM_KINDS:
        public = re.fullmatch(r"_([A-Za-z]\w*?)_impl", fn)
        if public:
            return public.group(1)
    return f"{name} {fn!r}" if fn else name


def _sum(a: _V | None, b: _V | None) -> _V | None:
    if a is None or b is None:
        return a if b is None else b
    return _V(a.x + b.x, _earliest(a.org, b.org), True)


def _operand_name(var, i: int) -> str:
    return f"operand {i} (literal)" if ji.is_literal(var) else f"operand {i}"
