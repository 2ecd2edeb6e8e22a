"""The collectives of a compiled program, read from its optimized HLO text.

A data-parallel step is right when it communicates what the math needs and nothing else: one
all-reduce of the gradients per update (XLA fuses the leaves into one tuple all-reduce), a few
scalars (the loss's global sum, a token count), and no all-gather of the parameters (which
would mean a replicated array got sharded somewhere). `collectives` lists them with their
bytes, and whether each runs inside a loop (a ``while`` body runs it once per iteration).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from funcgrad import _jax_internals as ji

#: The collective operations counted, as XLA names them (asynchronous ``-start``/``-done``
#: pairs count once, under the plain name).
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+("
                 + "|".join(re.escape(k) for k in KINDS) + r")(-start|-done)?\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_CALLS = re.compile(r"\b(?:to_apply|calls|body|condition|branch_computations)=\{?%?([\w.\-]+)")
_GROUPS = re.compile(r"replica_groups=(.*?)(?:, [a-z_]+=|$)")


@dataclass(frozen=True)
class Collective:
    """One collective operation of a compiled program.

    Attributes:
      kind: "all-reduce", "all-gather", "reduce-scatter", "collective-permute" or "all-to-all".
      name: the HLO instruction's name (``all-reduce.3``).
      shapes: the result's array types, one per operand of a fused (tuple) collective, as HLO
        writes them (``"f32[64,32]"``).
      bytes: the bytes of the result (the sum over `shapes`): what each device receives.
      computation: the HLO computation it is in (``main.42``, a while body's name).
      in_loop: it is in the body of a ``while`` (or in a computation called from one): it runs
        once per iteration, e.g. per update of a step that runs several.
      replica_groups: the devices that take part, as HLO writes them ("" when not given).
      loop_depth: how many ``while`` bodies it is nested in (0: once per call). An
        accumulating step running several updates has its gradient all-reduce at depth 1 (per
        update, in the loop over groups); one at depth 2 would run per micro-batch.
    """
    kind: str
    name: str
    shapes: tuple[str, ...]
    bytes: int
    computation: str
    in_loop: bool
    replica_groups: str = ""
    loop_depth: int = 0

    @property
    def group_size(self) -> int | None:
        """Devices in each group of this collective, read from `replica_groups` in any of the
        forms XLA writes: explicit lists (``{{0,1,2,3}}``), iota lists (``[1,4]<=[4]``: 1 group
        of 4), or mesh axes (``mesh['axis_0'=4,'axis_1'=1] {'axis_0'}``: the product of the
        reduced axes' sizes). None when the HLO gives no groups (``{}``: every device) or in
        a form not recognised."""
        return _group_size(self.replica_groups)


def _group_size(text: str) -> int | None:
    text = text.strip()
    mesh = re.match(r"mesh\[(.*?)\]\s*\{(.*?)\}", text)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'\s*=\s*(\d+)", mesh.group(1))}
        reduced = re.findall(r"'([^']+)'", mesh.group(2))
        if not reduced or any(r not in sizes for r in reduced):
            return None
        size = 1
        for r in reduced:
            size *= sizes[r]
        return size
    iota = re.match(r"\[(\d+),(\d+)\]<=", text)
    if iota:
        return int(iota.group(2))
    first = re.match(r"\{\{([\d,\s]+)\}", text)
    if first:
        return len([d for d in first.group(1).split(",") if d.strip()])
    return None


def _shapes(text: str) -> tuple[tuple[str, ...], int]:
    """The array types in an HLO result type and their bytes (token and tuple wrappers skipped)."""
    shapes, total = [], 0
    for dtype, dims in _SHAPE.findall(text):
        size = 1
        for d in dims.split(","):
            if d:
                size *= int(d)
        shapes.append(f"{dtype}[{dims}]")
        total += size * _BYTES.get(dtype, 1)
    return tuple(shapes), total


class CollectiveReport(tuple):
    """The `Collective` rows of a compiled program, in program order (a tuple), with counts.

    ``str(report)`` is a table; ``report.count("all-reduce")`` counts one kind;
    ``report.bytes`` sums the bytes of all rows.
    """

    def count(self, kind: str) -> int:
        """How many rows are of `kind` ("all-reduce", ...)."""
        return sum(1 for c in self if c.kind == kind)

    @property
    def bytes(self) -> int:
        """The bytes of all rows together (each once, loops not multiplied)."""
        return sum(c.bytes for c in self)

    def of_kind(self, kind: str) -> tuple[Collective, ...]:
        """The rows of `kind`."""
        return tuple(c for c in self if c.kind == kind)

    def to_dict(self) -> list[dict]:
        """The rows as JSON-ready dicts."""
        return [dict(c.__dict__, shapes=list(c.shapes), group_size=c.group_size) for c in self]

    def __str__(self) -> str:
        if not self:
            return "collectives: none (the program runs on one device, or needs no communication)"
        kinds = ", ".join(f"{self.count(k)} {k}" for k in KINDS if self.count(k))
        lines = [f"collectives: {len(self)} ({kinds}), {self.bytes:,} bytes"]
        for c in self:
            shown = ", ".join(c.shapes[:4]) + (f", ... ({len(c.shapes)} arrays)"
                                                if len(c.shapes) > 4 else "")
            loop = ("" if not c.in_loop else "  (in a loop: once per iteration)"
                    if c.loop_depth < 2 else f"  (in {c.loop_depth} nested loops)")
            lines.append(f"  {c.kind:<19}{c.bytes:>13,} B  {shown}{loop}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CollectiveReport({list(self)!r})"


def parse_collectives(hlo_text: str) -> CollectiveReport:
    """The collectives of optimized HLO text (``compiled.as_text()``), as `collectives` does."""
    current = ""
    rows: list[dict[str, Any]] = []
    started: dict[str, int] = {}
    loop_bodies: set[str] = set()
    calls: dict[str, set[str]] = {}
    loop_calls: dict[str, set[str]] = {}  # computation -> the while bodies it runs
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not _INSTRUCTION.match(line):
            head = _COMPUTATION.match(line)
            if head:
                current = head.group(1)
            continue
        for body in _WHILE_BODY.findall(line):
            loop_bodies.add(body)
            loop_calls.setdefault(current, set()).add(body)
        for called in _CALLS.findall(line):
            calls.setdefault(current, set()).add(called)
        op = _OP.match(line)
        if not op:
            continue
        name, result, kind, phase, rest = op.groups()
        if phase == "-done":
            operand = re.match(r"\s*(?:\S+\s+)?%?([\w.\-]+)", rest)
            if operand and operand.group(1) in started:  # the result's type is the done's
                row = rows[started[operand.group(1)]]
                row["shapes"], row["bytes"] = _shapes(result)
            continue
        groups = _GROUPS.search(rest)
        shapes, size = _shapes(result)
        if phase == "-start":
            started[name] = len(rows)
        rows.append({"kind": kind, "name": name, "shapes": shapes, "bytes": size,
                     "computation": current, "replica_groups": groups.group(1) if groups else ""})
    # Computations reached from a while body run once per iteration too.
    in_loop, todo = set(loop_bodies), list(loop_bodies)
    while todo:
        for called in calls.get(todo.pop(), ()):
            if called not in in_loop:
                in_loop.add(called)
                todo.append(called)
    depth = _loop_depths(calls, loop_calls)
    return CollectiveReport(Collective(in_loop=r["computation"] in in_loop,
                                       loop_depth=depth.get(r["computation"], 0), **r)
                            for r in rows)


def _loop_depths(calls: dict[str, set[str]], loop_calls: dict[str, set[str]]) -> dict[str, int]:
    """Each computation's deepest nesting in ``while`` bodies, over the call graph (a
    computation called from several places takes its deepest)."""
    called = set().union(*calls.values()) if calls else set()
    depth = {c: 0 for c in calls if c not in called}  # the roots: ENTRY and unused ones
    todo = list(depth)
    while todo:
        current = todo.pop()
        for c in calls.get(current, ()):
            d = depth[current] + (c in loop_calls.get(current, ()))
            if d > depth.get(c, -1):
                depth[c] = d
                todo.append(c)
    return depth


def collectives(fn: Any, *args: Any) -> CollectiveReport:
    """Lists the collectives of a compiled program: all-reduce, all-gather, reduce-scatter,
    collective-permute and all-to-all, with their bytes, read from the optimized HLO.

    Nothing is run: the program is compiled only (so this is safe on simulated CPU devices,
    where running collectives can stall in XLA:CPU's rendezvous).

    Args:
      fn: a jitted function with ``lower`` (a step from ``funcgrad.data_parallel(step, mesh)``, any
        ``jax.jit`` function), called as ``fn.lower(*args).compile()``; or a compiled
        program (it has ``as_text``); or its HLO text (a str).
      *args: the arguments to lower `fn` with (arrays or ``jax.ShapeDtypeStruct`` with their
        shardings), when `fn` is a function.
    Returns:
      a `CollectiveReport`: a tuple of `Collective` in program order.
    Raises:
      TypeError: `fn` is none of these.
    Example:
      >>> report = fg.collectives(step, state, batch)
      >>> report.count("all-reduce")   # 1 for an MLP's step: all gradient leaves in one
    """
    if isinstance(fn, str):
        return parse_collectives(fn)
    if hasattr(fn, "as_text") and not hasattr(fn, "lower"):
        return parse_collectives(ji.compiled_text(fn))
    if hasattr(fn, "lower"):
        return parse_collectives(ji.compiled_text(fn.lower(*args).compile()))
    raise TypeError(f"collectives: expected a jitted function (with .lower), a compiled program "
                    f"or HLO text, got {type(fn).__name__}. Wrap a plain function in jax.jit.")
