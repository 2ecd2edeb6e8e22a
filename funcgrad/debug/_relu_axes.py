"""Which ``max(x, 0)`` of a program are ReLUs, and along which axis their units lie (private).

Shared by `funcgrad.debug.diagnose` (dead units in `explain_grads`) and `funcgrad.debug.dead_relu`
(the monitor's dead-unit counts). A ReLU's *units* are the feature axis of the layer that feeds it:
the output feature dimension of a ``conv_general_dilated`` (from its dimension numbers, so
channel-first NCHW as in equinox and PyTorch gives axis 1, flax's NHWC gives the last axis), or
the free dimension of the weight operand of a ``dot_general`` (the operand that depends on the
params, argument 0, and not on the data). The axis is followed through bias adds, broadcasts,
reshapes, transposes, squeezes and elementwise ops, and into jit, custom_jvp/vjp, checkpoint,
scan and cond bodies; it is tracked as a group of adjacent axes, so a reshape that splits it
(GroupNorm's C -> (groups, C / groups)) and one that merges it back keep it. Where the data's
axis is not known, a vector leaf of the params broadcast onto it (a norm's per-channel scale
or bias) names it. Where it cannot be found (a ReLU applied to the data with no per-feature
parameter, an attention product of two data-dependent operands), the last axis is used and
the site says so: the count stays (for a (batch, features) input, the common case, it is
right), and `funcgrad.train.monitor` alerts on such a site only when all of it is dead.

A ``max(v, 0)`` whose operand is a variance (``E[x^2] - E[x]^2``, ``mean((x - m)^2)`` or a
call named ``var``/``_var``) is the clamp inside a normalisation layer (flax and equinox
LayerNorm, BatchNorm, GroupNorm), not an activation: it is not listed.
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from funcgrad import _jax_internals as ji

_PASS = {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p",
         "psum", "pmean"}  # ops a mean goes through (psum: the batch mean under a named vmap)
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}

_NONE, _UNKNOWN = (None, False, False), (None, True, True)
UNKNOWN_AXIS_NOTE = "feature axis not found from the program: units taken along the last axis"


def _is_zero(v) -> bool:
    return ji.is_literal(v) and np.ndim(v.val) == 0 and float(v.val) == 0.0


def is_max_zero(eqn) -> bool:
    """A floating ``max(x, 0)`` with a literal zero (ReLU or clamp; integer clamps excluded)."""
    return (ji.name(eqn) == "max" and len(eqn.invars) == 2
            and any(map(_is_zero, eqn.invars)) and not all(map(_is_zero, eqn.invars))
            and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating))


class ReluAxes:
    """The ReLUs of a closed jaxpr and the unit axis of each.

    Each value is tracked as ``(feature group or None, depends on data, depends on params)``,
    the group ``(start, stop)``: the features lie along axes start..stop-1 (row-major), one
    axis, or several while a reshape has split them (GroupNorm's (groups, channels / groups)).
    A vector leaf of the params (a bias, a norm's scale) has its features on axis 0: where it
    is broadcast onto data whose axis is not known, it names the data's feature axis.

    Args:
      jaxpr: the program (``closed.jaxpr``).
      n_params: how many of ``jaxpr.invars`` are leaves of the params (argument 0); the others
        are data.
      consts_are: what the closed-over constants are: "data" (a loss of the params alone
        closing over the batch), "params" (a function of the batch alone closing over the
        model) or "unknown".
    """

    def __init__(self, jaxpr, n_params: int, consts_are: str = "unknown"):
        self.axes: dict[int, tuple | None] = {}  # id(eqn) -> feature group (None: unknown)
        self.clamps: set[int] = set()            # id(eqn) of variance clamps
        ins = [(_vector_group(v) if i < n_params else None, i >= n_params, i < n_params)
               for i, v in enumerate(jaxpr.invars)]
        consts = [(_vector_group(v) if consts_are == "params" else None,
                   consts_are == "data", consts_are == "params") for v in jaxpr.constvars]
        self._walk(jaxpr, ins, consts)

    def is_relu(self, eqn) -> bool:
        return is_max_zero(eqn) and id(eqn) not in self.clamps

    def unit_axes(self, eqn, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
        """``(axes, known)``: the axes of the ReLU input (of shape `shape`) that hold its units,
        one axis, or several (row-major) where a reshape split the features; unknown: the last
        axis, ``known`` False."""
        group = self.axes.get(id(eqn))
        if group is None or group[1] > len(shape):
            return (len(shape) - 1,), False
        return tuple(d for d in range(*group) if shape[d] != 1) or (group[0],), True

    def has_relu(self, jaxpr) -> bool:
        """Whether `jaxpr` (or a jaxpr nested in it) holds a ReLU."""
        return any(self.is_relu(eqn) or any(self.has_relu(sub) for _, sub, _ in ji.sub_jaxprs(eqn))
                   for eqn in jaxpr.eqns)

    # --- the walk ---------------------------------------------------------------------------

    def _walk(self, jaxpr, ins, consts=()):
        env: dict[Any, tuple] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, ins))
        producer: dict[Any, Any] = {}  # var -> the equation that made it
        for eqn in jaxpr.eqns:
            vals = [_NONE if ji.is_literal(v) else env.get(v, _UNKNOWN)
                    for v in eqn.invars]
            if is_max_zero(eqn):
                x = eqn.invars[1] if _is_zero(eqn.invars[0]) else eqn.invars[0]
                if _is_variance(x, producer):
                    self.clamps.add(id(eqn))
                else:
                    self.axes[id(eqn)] = vals[1 if _is_zero(eqn.invars[0]) else 0][0]
            outs = self._transfer(eqn, vals)
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
                producer[var] = eqn
        return [_NONE if ji.is_literal(v) else env.get(v, _UNKNOWN)
                for v in jaxpr.outvars]

    def _transfer(self, eqn, vals):
        kind = ji.kind(eqn)
        data, param = any(v[1] for v in vals), any(v[2] for v in vals)
        inherit = (None, data, param)
        n_out = len(eqn.outvars)
        called = ji.body(eqn)
        if called is not None:
            sub, consts = called
            return self._walk(sub, vals[len(vals) - len(sub.invars):], [inherit] * len(consts))
        if kind == "scan":
            s = ji.scan(eqn)
            nc, nk = s.num_consts, s.num_carry
            xs = [(_shift(g, -1), d, q) for g, d, q in vals[nc + nk:]]
            outs = self._walk(s.body, [*vals[:nc + nk], *xs], [inherit] * len(s.body_consts))
            return [*outs[:nk], *[(_shift(g, 1), d, q) for g, d, q in outs[nk:]]]
        if kind == "cond":
            branches = [self._walk(b, vals[1:], [inherit] * len(consts))
                        for b, consts in ji.cond_branches(eqn)]
            return [(o[0][0] if all(x[0] == o[0][0] for x in o) else None,
                     any(x[1] for x in o), any(x[2] for x in o)) for o in zip(*branches)]
        for _, sub, consts in ji.sub_jaxprs(eqn):  # while and others: visit, axes unknown
            self._walk(sub, [_UNKNOWN] * len(sub.invars), [_UNKNOWN] * len(consts))
        if n_out != 1:
            return [inherit] * n_out
        return [(_out_axis(eqn, vals), data, param)]


def _out_axis(eqn, vals) -> tuple[int, int] | None:
    """The feature group ``(start, stop)`` of `eqn`'s output: the features lie along axes
    start..stop-1, flattened in row-major order (one axis, or several after a reshape split it,
    as GroupNorm's (groups, channels per group)); None when not known."""
    name, p = ji.name(eqn), ji.params(eqn)
    out_shape = tuple(eqn.outvars[0].aval.shape)
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    if name == "conv_general_dilated":  # out_spec = (batch dim, feature dim, spatial dims...)
        spec = getattr(p.get("dimension_numbers"), "out_spec", None)
        return _one(int(spec[1])) if spec is not None else None
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        weight = [not d and q for _, d, q in vals]  # depends on the params, not on the data
        if weight.count(True) != 1 or not any(d for _, d, _ in vals):
            return None  # no single weight operand to read the units from (e.g. q @ k.T)
        w = weight.index(True)
        contract, batch = (lc, lb) if w == 0 else (rc, rb)
        free = [i for i in range(len(shapes[w])) if i not in contract and i not in batch]
        if len(free) != 1:
            return None
        lhs_free = len(shapes[0]) - len(lc) - len(lb)
        return _one(len(lb) + (free[0] - sum(i < free[0] for i in (*contract, *batch))
                               + (lhs_free if w == 1 else 0)))
    # Data-dependent operands first: the bias add keeps theirs. Where the data's axis is not
    # known, a params-only operand's (a per-channel scale or bias broadcast along the channel
    # axis, as after a norm) is the evidence.
    known = [(v[0], s) for v, s in sorted(zip(vals, shapes), key=lambda t: not t[0][1])
             if v[0] is not None]
    if not known:
        return None
    (a, z), src = known[0]
    if name == "transpose":  # the group survives when its axes stay adjacent and in order
        perm = list(p["permutation"])
        b = perm.index(a)
        return (b, b + z - a) if perm[b:b + z - a] == list(range(a, z)) else None
    if name == "broadcast_in_dim":
        dims = [int(d) for d in p["broadcast_dimensions"]]
        b = dims[a]
        kept = dims[a:z] == list(range(b, b + z - a)) and out_shape[b:b + z - a] == src[a:z]
        return (b, b + z - a) if kept else None
    if name == "squeeze":
        return _removed(src, a, z, {d % len(src) for d in p["dimensions"]})
    if name in _REDUCE or name.startswith("reduce_") or name.startswith("argm"):
        return _removed(src, a, z, {int(d) for d in p.get("axes", p.get("dimensions", ()))})
    if name == "reshape":
        return _reshaped(src, out_shape, a, z)
    if len(out_shape) == len(src) and out_shape[a:z] == src[a:z]:  # elementwise, slices, pads
        return (a, z)
    return None


def _vector_group(var) -> tuple[int, int] | None:
    shape = tuple(getattr(var.aval, "shape", ()))
    return (0, 1) if len(shape) == 1 and shape[0] > 1 else None


def _shift(group, by: int):
    """A group through a scan's slicing (-1: axis 0 removed) or stacking (+1)."""
    if group is None or group[0] + by < 0:
        return None
    return (group[0] + by, group[1] + by)


def _one(axis: int) -> tuple[int, int]:
    return (axis, axis + 1)


def _removed(src, a: int, z: int, dims: set) -> tuple[int, int] | None:
    """The group after removing axes `dims` (a squeeze, a reduction): kept when only size-1
    axes of it go."""
    if any(src[d] != 1 for d in dims if a <= d < z):
        return None
    left = [d for d in range(a, z) if d not in dims]
    if not left:
        return None
    shift = lambda d: d - sum(e < d for e in dims)  # noqa: E731
    return (shift(left[0]), shift(left[-1]) + 1)


def _reshaped(src, out, a: int, z: int) -> tuple[int, int] | None:
    """The group after a reshape: the features occupy the same run of row-major positions,
    so the group is kept where the output has axis boundaries at the run's two ends (a split
    of C into (groups, C / groups), or the merge back). Size-1 axes at its ends are left out."""
    before, size = math.prod(src[:a]), math.prod(src[a:z])
    starts = [b for b in range(len(out) + 1) if math.prod(out[:b]) == before]
    stops = [b for b in range(len(out) + 1) if math.prod(out[:b]) == before * size]
    pairs = [(b, c) for b in starts for c in stops if c > b]
    if not pairs:
        return None
    b = max(b for b, _ in pairs)
    return (b, min(c for c in stops if c > b))


def _is_variance(var, producer, depth: int = 0) -> bool:
    """Whether `var` is a variance: ``E[x^2] - E[x]^2``, a mean of squares, or ``var(x)``."""
    eqn = producer.get(var)
    if eqn is None or depth > 8:
        return False
    name = ji.name(eqn)
    if name in _PASS or (name in ("div", "mul") and _literal_or_param_scale(eqn)):
        return _is_variance(eqn.invars[0], producer, depth + 1)
    called = ji.body(eqn)
    if called is not None:
        fname = str(ji.param(eqn, "name", ""))
        if fname.strip("_") in ("var", "variance"):
            return True
        sub, _ = called
        inner = {}
        for e in sub.eqns:
            for v in e.outvars:
                inner[v] = e
        k = eqn.outvars.index(var) if var in eqn.outvars else 0
        return _is_variance(sub.outvars[k], inner, depth + 1)
    if name == "sub":
        return _is_square(eqn.invars[1], producer)
    if name == "reduce_sum":
        return _is_square(eqn.invars[0], producer)
    return False


def _literal_or_param_scale(eqn) -> bool:
    """``div x n`` / ``mul x (1/n)``: a mean's normalisation, the first operand the sum."""
    return all(ji.is_literal(v) or tuple(v.aval.shape) == ()
               for v in eqn.invars[1:])


def _is_square(var, producer) -> bool:
    eqn = producer.get(var)
    while eqn is not None and ji.name(eqn) in _PASS:
        eqn = producer.get(eqn.invars[0])
    if eqn is None:
        return False
    name = ji.name(eqn)
    if name == "mul":  # x * x, or (x - m) * (x - m') as equinox's BatchNorm writes it
        a, b = (producer.get(v) for v in eqn.invars)
        return eqn.invars[0] is eqn.invars[1] or (
            a is not None and b is not None and ji.name(a) == ji.name(b) == "sub"
            and a.invars[0] is b.invars[0])
    return name == "square" or (name == "integer_pow" and ji.param(eqn, "y", None) == 2)
