"""Anomaly location: the first primitive that made a function or its gradient NaN or inf.

PyTorch's ``torch.autograd.detect_anomaly`` names the backward function that returned NaN and
prints the traceback of the forward line that created it. JAX's tools stop short of that:
``jax_debug_nans`` raises at the first NaN, but under ``jit(grad(f))`` it names only the
primitive ("invalid value (nan) encountered in div") and not the line, sees no inf (that is
``jax_debug_infs``), and also stops at a NaN that a ``jnp.where`` hides from the loss;
``checkify.float_checks`` misses an inf made by overflow
(``exp(1000.)``) and, for a hand-written softmax, blames the ``div`` that turned inf into NaN
rather than the ``exp`` that overflowed. `find_nonfinite` answers the question those leave
open: *which primitive, in which pass, on which line of my code, with which operands*.

Approach (chosen over scanning ``make_jaxpr(jax.grad(f))``): an evaluator over the jaxpr of
the function, run eagerly equation by equation, followed by a reverse pass over the same
equations that we drive ourselves. The evaluator lives in the private module
`funcgrad.debug._nonfinite_eval`; this module checks the arguments, runs it and writes the report.
  * Forward: every equation is bound on concrete values and its outputs checked; nested jaxprs
    are entered (jit, remat, custom_jvp/custom_vjp bodies, cond's taken branch, while and scan
    bodies iteration by iteration). Each non-finite element carries its *origin*: the first
    equation on its path that produced a non-finite value from finite operands. Elementwise
    primitives (broadcasts included) keep each element's origin, primitives that move elements
    (slice, gather, select_n, reshape, concatenate, ...) move the origins with them, and
    reductions, sorts and top_k take the best origin of each row; a matmul or other mixing
    primitive takes the best of its inputs. A value made from a non-finite literal or constant
    (a ``-inf`` mask) or a non-finite argument that is not differentiated ranks below a
    computed one there, and a NaN made of a constant's infinities (``-inf - -inf`` in the
    softmax of a fully masked row, ``-inf * 0`` in a matmul) is an origin of its own. The
    report names the origin of the non-finite output, so a ``-inf`` that a ``jnp.where`` hides
    from the output (an attention mask, ``where(x > 0, log(x), 0)``) is not blamed for the
    forward pass; it is listed under ``masked``. A non-finite differentiated argument is
    reported before fn runs; any other is reported only if it reaches the output.
  * Backward (``grad=True`` and a finite loss): the equations are walked in reverse with the
    cotangent of the loss, 1. Each equation's cotangents come from ``jax.vjp`` of that one
    equation (its own derivative rule, so custom_jvp/custom_vjp rules are honoured), cotangents
    of ``scan`` are pulled back iteration by iteration, and only equations that depend on the
    differentiated arguments take part, as in ``jax.grad``. Because every backward step belongs
    to one forward equation, the report names *that* primitive (``log``, ``sqrt``), its source
    line and its primal operands, which a scan of the grad jaxpr can only guess (the
    transposed ``div`` of a ``log`` shares its line with every equation made from that line).
    The gradient it computes is ``jax.grad``'s (the same rules; the tests compare the two). As
    with ``jax.grad``, a ``while_loop`` that depends on the differentiated arguments cannot be
    reversed (a ValueError says so and points to ``grad=False``); ``fori_loop`` with static
    bounds is a scan and can. The backward pass tracks origins per array, not per element.
  * A function that computes a gradient itself (``jit(grad(f))`` checked with ``grad=False``)
    is evaluated like any other; its transposed equations carry the name stack
    ``transpose(jvp(...))`` and the forward line that created them, so the report still gives
    the line and says "backward".
Cost: the program runs op by op in Python, each value is checked on the host, and the reverse
pass traces one small ``jax.vjp`` per equation (about a millisecond each): seconds for a small
model, fine for a debugging tool and nothing for code that does not call it. Values are those
of eager (op-by-op) execution, which can differ in the last bits from a fused ``jit`` program.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util

from funcgrad._jaxpr import arg_names, leaf_paths
from funcgrad._library_objects import split_equinox_args
from funcgrad._paths import arg_leaf_paths
from funcgrad._traced import (
    _FUNCGRAD_DIR,  # the package's folder, all its subpackages
    traced_values,
)
from funcgrad.debug._anomaly_hints import DOUBLE_WHERE as DOUBLE_WHERE
from funcgrad.debug._anomaly_hints import _hint, _rows
from funcgrad.debug._nonfinite_eval import _Evaluator
from funcgrad.debug._nonfinite_origin import _V, _finite, _Frame, _is_float, _Loc, _Origin, _rank

# Lines of this file are never "the user's line".
source_info_util.register_exclusion(__file__)


_MAX_MASKED = 5


@dataclasses.dataclass(frozen=True)
class ValueStats:
    """Summary of one array: an operand, a cotangent or the non-finite value produced.

    Attributes:
      name: what the array is, e.g. "operand 0", "cotangent of output 0", "params['w']".
      shape, dtype: the array's.
      min, max: over its non-NaN elements (±inf included); nan when every element is NaN.
      nonfinite: number of NaN or ±inf elements, of which `nan` are NaN; size: elements.
    """
    name: str
    shape: tuple[int, ...]
    dtype: str
    min: float
    max: float
    nonfinite: int
    nan: int
    size: int

    def __str__(self) -> str:
        bad = f" ({self.nan} NaN)" if self.nan else ""
        return (f"{self.name:<24}{self.dtype}{list(self.shape)}  min {self.min:.4g}  "
                f"max {self.max:.4g}  non-finite {self.nonfinite}/{self.size}{bad}")


@dataclasses.dataclass(frozen=True)
class AnomalyReport:
    """What `find_nonfinite` found: the first non-finite value's origin, or that all is finite.

    Attributes:
      phase: None when everything is finite; "input" (an argument leaf is non-finite),
        "forward" (the function's value) or "backward" (its gradient).
      primitive: the primitive that produced the first non-finite value; in the backward pass,
        the forward primitive whose derivative rule did (``log``, ``sqrt``), or the transposed
        primitive itself for a gradient the function computes (``jit(grad(f))``).
        None for "input".
      where: ``file.py:LINE:COL (function)`` of the user's code, or the input leaf's path.
      file, line: the full path and line number of `where` (None when unknown).
      context: enclosing calls, outermost first, e.g. ``("scan at f.py:9:8 (f), iteration 3
        (0-based) of 5",)``.
      inputs: statistics of the primitive's operands (backward: and of the cotangents it
        received).
      output: statistics of the non-finite value it produced (backward: the cotangent of its
        operand).
      nonfinite: names of the non-finite outputs (forward) or gradient leaves (backward).
      value: the loss (grad=True) or the scalar output, as a float; None otherwise.
      checked: "forward" or "forward and backward".
      hint: a likely cause and fix, in words and code.
      masked: non-finite intermediates of the forward pass that did not reach the output.
    """
    phase: str | None
    primitive: str | None = None
    where: str = ""
    file: str | None = None
    line: int | None = None
    context: tuple[str, ...] = ()
    inputs: tuple[ValueStats, ...] = ()
    output: ValueStats | None = None
    nonfinite: tuple[str, ...] = ()
    value: float | None = None
    checked: str = "forward"
    hint: str = ""
    masked: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every checked value (inputs, outputs, gradient) is finite."""
        return self.phase is None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return d | {"ok": self.ok, "context": list(self.context), "nonfinite": list(self.nonfinite),
                    "masked": list(self.masked),
                    "inputs": [s | {"shape": list(s["shape"])} for s in d["inputs"]]}

    def __str__(self) -> str:
        value = "" if self.value is None else f", value {self.value:.6g}"
        if self.ok:
            lines = [f"find_nonfinite: all finite ({self.checked} checked{value})"]
        elif self.phase == "input":
            lines = [f"find_nonfinite: the input {self.where} is already non-finite",
                     f"  {self.output}"]
        else:
            lines = [f"find_nonfinite: first non-finite value in the {self.phase} pass"
                     f" ({self.checked} checked{value})",
                     f"  primitive  {self.primitive}", f"  at         {self.where or '?'}"]
            lines += [f"  inside     {c}" for c in self.context]
            lines += [f"  {'operands' if i == 0 else '':<11}{s}" for i, s in enumerate(self.inputs)]
            shown = ", ".join(self.nonfinite[:_MAX_NAMED])
            if len(self.nonfinite) > _MAX_NAMED:
                shown += f", ... ({len(self.nonfinite)} in all; all in .nonfinite)"
            lines += [f"  {'produced':<11}{self.output}", f"  non-finite {shown}"]
        if self.masked:
            lines.append("  masked     (non-finite in the forward pass, hidden from the output)")
            lines += [f"             {m}" for m in self.masked]
        if self.hint:
            lines.append("  hint       " + self.hint.replace("\n", "\n             "))
        return "\n".join(lines)

    def raise_if_nonfinite(self) -> None:
        """Raises ``FloatingPointError`` with this report's text unless it is ok."""
        if not self.ok:
            raise FloatingPointError(str(self))


#: How many non-finite outputs or gradient leaves the report's text names (all are kept).
_MAX_NAMED = 8


def find_nonfinite(fn: Callable, *args: Any, argnums: int | Sequence[int] = 0, grad: bool = True,
                   has_aux: bool = False) -> AnomalyReport:
    """Locates the first NaN or inf of ``fn(*args)`` and of its gradient: primitive, pass, line.

    PyTorch's ``detect_anomaly`` as a function call: run it on the arguments of the step that
    went non-finite (``funcgrad.train.fit`` returns the state from before that step and the batch's
    index). See the module docstring for how it works and what it costs.

    Args:
      fn: a pure function; with `grad`, ``fn(*args) -> scalar loss`` (or ``(loss, aux)`` with
        `has_aux`). It may use jit, vmap, scan, cond, while_loop, remat and custom_jvp/vjp.
      *args: its arguments: pytrees of arrays (params, a batch...).
      argnums: the argument(s) differentiated, as in ``jax.grad``: their real floating leaves
        (integer and PRNG-key leaves, e.g. an nnx RngCount, are passed through, not
        differentiated). An equinox module is taken as ``eqx.filter_grad`` takes it: its
        floating arrays are differentiated, its other leaves closed over.
      grad: check the gradient too (the default); False checks only the forward pass, of any
        function with any outputs.
      has_aux: whether `fn` returns ``(loss, aux)`` (aux is checked, not differentiated).
    Returns:
      an `AnomalyReport`; ``report.ok`` is True when the arguments, every output and (with
      `grad`) the gradient are finite. ``print(report)`` explains it.
    Raises:
      TypeError: if `fn` is not callable, an argument leaf is not an array or number, `argnums`
        is not an int or ints, or a differentiated leaf is complex (its path is named);
        `funcgrad.TracedValueError` (a TypeError) when `fn` uses a traced
        value as a Python value (``if x > 0:``, ``range(n)``): the message names fn's line and
        the fix.
      ValueError: if `argnums` is out of range, or with `grad` the loss is not a real scalar.
    Example:
      >>> report = find_nonfinite(lambda x: jnp.where(x > 0, jnp.log(x), 0.0).sum(),
      ...                         jnp.array([0.0, 1.0]))
      >>> report.phase, report.primitive
      ('backward', 'log')
    """
    return _locate(fn, args, argnums=argnums, grad=grad, has_aux=has_aux)[0]


# --- the public boundary --------------------------------------------------------------------

def _locate(fn, args, *, argnums, grad, has_aux):
    """`find_nonfinite`'s work; also returns the flat outputs and gradient (for the tests)."""
    if not callable(fn):
        raise TypeError(f"find_nonfinite needs a callable fn, got {type(fn).__name__}.")
    nums = _argnums(argnums, len(args), grad)
    fn, args = split_equinox_args(fn, args, "find_nonfinite")  # an equinox model: arrays
    names = arg_names(fn, len(args))
    paths = leaf_paths(tuple(args), names)
    leaves = jax.tree.leaves(tuple(args))
    owner = [i for i, _ in arg_leaf_paths(tuple(args))]
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            raise TypeError(f"find_nonfinite: the argument leaf {path} is a {type(leaf).__name__};"
                            " arguments must be pytrees of arrays or numbers. Close over other "
                            "values (functools.partial or a lambda).")
    # Only the real floating leaves of argnums are differentiated: an integer or key leaf (a
    # step counter, an nnx RngCount or RngKey) has no gradient and is passed through.
    active = [grad and i in nums and _is_real_float(leaf) for i, leaf in zip(owner, leaves)]
    for path, leaf, i in zip(paths, leaves, owner):
        if grad and i in nums and _is_complex(leaf):
            raise TypeError(f"find_nonfinite: the differentiated leaf {path} has dtype "
                            f"{jnp.result_type(leaf)}; complex leaves are not supported. Pass "
                            "it in an argument that is not in argnums.")
    for path, leaf, a in zip(paths, leaves, active):
        if a and not _finite(leaf):  # differentiated: params gone bad before fn runs
            return _input_report(path, leaf), None, None
    with traced_values("find_nonfinite", fn, tuple(args), names, nums):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_paths = ["output" + jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    if grad:
        _check_loss(out_shape, has_aux)
    ev = _Evaluator()
    top = _Frame(_Loc(), (), False)
    # Any other non-finite argument (an additive -inf attention mask, a NaN in the data) is a
    # sentinel origin of its own: reported only if it reaches the output, listed if masked.
    inputs = [_V(x, None if _finite(x) else ev.new("input", f"argument {path}", top, (), x,
                                                    path, sentinel=True), a)
              for x, a, path in zip(leaves, active, paths)]
    outs, tape = ev.forward(closed.jaxpr, closed.consts, inputs, top, record=grad)
    values = [v.x for v in outs]
    scalar = len(values) >= 1 and np.ndim(values[0]) == 0 and _is_float(values[0])
    value = float(values[0]) if scalar and (grad or len(values) == 1) else None
    checked = "forward and backward" if grad else "forward"
    for i, v in enumerate(outs):  # a non-finite constant returned as is
        if v.org is None and not _finite(v.x):
            outs[i] = v._replace(org=ev.new("forward", "constant", _Frame(_Loc(), (), False),
                                            (), v.x, "output"))
    bad = [(v.org, p) for v, p in zip(outs, out_paths) if v.org is not None]
    if bad:
        origin = _first(bad)
        if origin.phase == "input":
            return (_input_report(origin.produced_name, origin.produced, data=True), values,
                    None)
        return (_report(origin, tuple(p for _, p in bad), value, checked,
                        _masked(ev, {o for o, _ in bad}), _has_minus_inf_mask(ev)), values, None)
    masked = _masked(ev, set())
    if not grad:
        return AnomalyReport(None, value=value, checked=checked, masked=masked), values, None
    seed = _V(jnp.ones((), jnp.result_type(values[0])), None, True)
    try:
        cts = ev.backward(closed.jaxpr, tape, [seed] + [None] * (len(outs) - 1))
    except ValueError as error:
        if "while_loop" not in str(error):
            raise
        raise ValueError(
            "find_nonfinite: the forward pass is finite, but fn runs a lax.while_loop (or a "
            "fori_loop with traced bounds) that depends on the differentiated arguments, and "
            "JAX has no reverse-mode derivative for it, so the backward pass cannot be checked. "
            "Pass grad=False to check the forward pass alone, or write the loop as lax.scan."
        ) from error
    grads = [None if not a else (c.x if c is not None else jnp.zeros_like(x))
             for a, c, x in zip(active, cts, leaves)]
    bad = [(c.org, f"grad of {p}") for c, p, a in zip(cts, paths, active)
           if a and c is not None and c.org is not None]
    if bad:
        return (_report(_first(bad), tuple(p for _, p in bad), value, checked, masked,
                        _has_minus_inf_mask(ev)), values, grads)
    return AnomalyReport(None, value=value, checked=checked, masked=masked), values, grads


def _input_report(path: str, leaf, data: bool = False) -> AnomalyReport:
    """The report of a non-finite argument: a differentiated one (params gone bad) or, with
    `data`, one that is not differentiated and reached the output (a NaN in the batch)."""
    hint = ("an argument is NaN or inf before fn runs and reaches the output: check the data "
            "batch, or the update that produced these params.")
    if data:
        hint = (f"{path} is non-finite in {_rows(leaf)} before fn runs, and that reaches the "
                "output. If those are padded or masked rows that the loss weights out, the "
                "weight does not help: 0 * NaN is NaN (and 0 * inf too). Fill padding with "
                "finite values (zeros), or replace the NaN before the model: "
                "jnp.where(valid[:, None], x, 0.0).")
    return AnomalyReport("input", where=path, output=_stats(path, leaf), nonfinite=(path,),
                         checked="inputs", hint=hint)


def _first(bad: list) -> _Origin:
    return min((o for o, _ in bad), key=_rank)


def _is_real_float(leaf) -> bool:
    try:
        return bool(jnp.issubdtype(jnp.result_type(leaf), jnp.floating))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def _is_complex(leaf) -> bool:
    try:
        return bool(jnp.issubdtype(jnp.result_type(leaf), jnp.complexfloating))
    except TypeError:
        return False


def _argnums(argnums, nargs: int, grad: bool) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, (int, np.integer)) else argnums
    ints = isinstance(nums, (tuple, list)) and all(isinstance(n, (int, np.integer)) for n in nums)
    if not ints:
        raise TypeError(f"find_nonfinite: argnums must be an int or a sequence of ints, got "
                        f"{argnums!r}.")
    if grad and not nums:
        raise ValueError("find_nonfinite: argnums is empty; name the argument(s) to "
                         "differentiate, or pass grad=False to check only the forward pass.")
    for n in nums:
        if grad and not -nargs <= n < nargs:
            raise ValueError(f"find_nonfinite: argnums={argnums!r} but fn gets {nargs} "
                             f"argument(s); pass them after fn: find_nonfinite(fn, params, batch).")
    return tuple(int(n) % nargs for n in nums) if grad else ()


def _check_loss(out_shape, has_aux: bool) -> None:
    loss = out_shape[0] if has_aux and isinstance(out_shape, (tuple, list)) else out_shape
    if not (hasattr(loss, "shape") and loss.shape == ()
            and jnp.issubdtype(loss.dtype, jnp.floating)):
        got = (f"shape {tuple(loss.shape)} dtype {loss.dtype}" if hasattr(loss, "shape")
               else type(loss).__name__)
        raise ValueError(
            f"find_nonfinite(grad=True) needs fn to return a real scalar loss"
            f"{' as the first element of (loss, aux)' if has_aux else ''}; got {got}. Reduce "
            "it (e.g. .mean()), pass has_aux=True, or grad=False to check the forward pass only.")


# --- statistics and reports ----------------------------------------------------------------

def _stats(name: str, x) -> ValueStats:
    a = np.asarray(x)
    if np.iscomplexobj(a):
        a = np.abs(a)
    a = a.astype(np.float64) if a.dtype != bool else a.astype(np.int8)
    nonfinite, nan = int(np.sum(~np.isfinite(a))), np.isnan(a)
    real = a[~nan]
    lo, hi = (float(real.min()), float(real.max())) if real.size else (float("nan"),) * 2
    return ValueStats(name, tuple(np.shape(x)), str(jnp.result_type(x)), lo, hi, nonfinite,
                      int(nan.sum()), int(a.size))


def _has_minus_inf_mask(ev: _Evaluator) -> bool:
    """Whether the forward pass used a -inf constant of the user's or a -inf argument that is
    not differentiated (a mask, additive or in a jnp.where)."""
    return any((o.constant and not _own(o) or o.phase == "input")
               and np.any(np.isneginf(np.asarray(o.produced))) for o in ev.forward_origins)


def _own(origin: _Origin) -> bool:
    """Whether `origin` sits in funcgrad's own code (e.g. the label guard of
    `funcgrad.demo.mlp.softmax_cross_entropy`, a NaN constant that only a bad label lets
    through)."""
    file = origin.loc.file
    return bool(file and os.path.abspath(file).startswith(_FUNCGRAD_DIR + os.sep))


def _report(origin: _Origin, nonfinite, value, checked, masked,
            minus_inf_mask: bool = False) -> AnomalyReport:
    """The report of `origin`: its operands' statistics, its line, a hint."""
    inputs = tuple(_stats(n, v) for n, v in origin.operands)
    produced = _stats(origin.produced_name, origin.produced)
    return AnomalyReport(origin.phase, origin.primitive, origin.loc.where, origin.loc.file,
                         origin.loc.line, origin.context, inputs, produced, tuple(nonfinite),
                         value, checked, _hint(origin, inputs, produced, minus_inf_mask), masked)


def _masked(ev: _Evaluator, reached: set) -> tuple[str, ...]:
    """Forward origins whose values never reached the output, one line per site."""
    sites: dict[tuple[str, str], list[_Origin]] = {}
    for o in ev.forward_origins:
        if o.constant and _own(o):  # funcgrad's own sentinel, hidden as designed: not news
            continue
        if not o.reaches(reached):
            sites.setdefault((o.primitive, o.loc.where), []).append(o)
    text = []
    for (primitive, where), group in sites.items():
        s = _stats("", group[0].produced)
        site = (primitive if group[0].phase == "input" else
                f"a non-finite constant (a -inf mask?) in {primitive} at {where or '?'}"
                if group[0].constant else f"{primitive} at {where or '?'}")
        text.append(f"{site}: {s.nonfinite}/{s.size} non-finite "
                    f"(min {s.min:.4g}, max {s.max:.4g})"
                    + (f", and at {len(group) - 1} later time(s)" if len(group) > 1 else ""))
    return tuple(text[:_MAX_MASKED]) + ((f"... and {len(text) - _MAX_MASKED} more",)
                                        if len(text) > _MAX_MASKED else ())
