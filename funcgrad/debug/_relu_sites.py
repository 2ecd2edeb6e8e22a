"""Every ReLU of a program and its dead units on one batch (`ReluSite`), for `explain_grads`.

A unit is dead when its pre-activation is <= 0 for every example and position: its gradient is
then zero whatever the loss (`funcgrad.debug.diagnose` says which leaves that blocks).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import interpret, source_line
from funcgrad.debug._relu_axes import UNKNOWN_AXIS_NOTE, ReluAxes


@dataclasses.dataclass(frozen=True)
class ReluSite:
    """One ReLU in the program and its dead units for the given input.

    Attributes:
      where: the source line of the ReLU (``file.py:LINE (function)``).
      units: number of units: the size of the feature axis of the layer feeding the ReLU
        (a convolution's output channels in its own layout, NCHW or NHWC; a dense layer's
        outputs), found from the program (`funcgrad.debug._relu_axes`).
      dead: units whose pre-activation is <= 0 for every example of the batch and every
        position (pixel) (inside ``scan``: at every iteration).
      dead_per_iteration: inside ``scan``, the dead units of each time the ReLU ran, in the
        order run: once per iteration (a scan over stacked layers runs one layer each), or,
        inside a ``cond`` in the scan body, once per iteration that took its branch; () when
        it ran once.
      axis: the axis of the ReLU's input that holds the units; a tuple of axes (row-major)
        when a reshape has split the features over several, e.g. (groups, channels / groups).
      note: "" or, when the feature axis could not be found from the program, why the last
        axis was used.
    """
    where: str
    units: int
    dead: int
    dead_per_iteration: tuple[int, ...] = ()
    axis: int | tuple[int, ...] = -1
    note: str = ""

    @property
    def dead_fraction(self) -> float:
        return self.dead / self.units if self.units else 0.0


# --- ReLU sites: evaluate the program once and look at every max(x, 0) -------------------
#
# The program is re-traced equation by equation under one jax.jit, which returns the input of
# every ReLU (evaluated eagerly instead, every primitive compiled on its own: 5.5 s of a small
# CNN's explain_grads). A ReLU in a scan body comes back stacked over the iterations (the scan
# is re-built with the ReLU inputs as extra per-iteration outputs); every branch of a cond is
# traced, its outputs selected by the branch index, and its ReLUs counted only where its
# branch was taken. Dead counting is then done in NumPy.

@dataclasses.dataclass
class _Site:
    where: str
    units: int
    axes: tuple[int, ...]
    note: str


def _relu_sites(closed, params, args, n_params) -> list[ReluSite]:
    # A loss of the params alone closes over its batch: its constants are then data.
    relus = ReluAxes(closed.jaxpr, n_params, consts_are="unknown" if args else "data")
    sites: dict[tuple, _Site] = {}  # call path -> static facts, filled while tracing

    def staged(consts, flat_args):
        recorded: dict[tuple, tuple] = {}  # call path -> (ReLU input, taken) with iteration axes
        _record(closed.jaxpr, consts, flat_args, recorded, sites, "", (), relus)
        return recorded

    recorded = jax.jit(staged)(closed.consts, jax.tree.leaves((params, *args)))
    out = []
    for key, site in sites.items():
        if key not in recorded:
            continue
        x, taken = (np.asarray(v) for v in recorded[key])
        # x: (*iterations, *shape of one evaluation); taken: (*iterations,)
        per_eval = x.reshape(-1, *x.shape[taken.ndim:])[taken.reshape(-1)]
        alive_any, dead = np.zeros(site.units, bool), []
        for one in per_eval:
            axes = list(site.axes)
            alive = np.any(np.moveaxis(one, axes, range(one.ndim - len(axes), one.ndim))
                           .reshape(-1, site.units) > 0, axis=0)
            alive_any |= alive
            dead.append(int(site.units - alive.sum()))
        if not dead:
            continue  # only in branches never taken
        axis = site.axes[0] if len(site.axes) == 1 else site.axes
        out.append(ReluSite(site.where, site.units, int(site.units - alive_any.sum()),
                            tuple(dead) if len(dead) > 1 else (), axis, site.note))
    return out


def _is_zero_literal(v) -> bool:
    return ji.is_literal(v) and np.ndim(v.val) == 0 and float(v.val) == 0.0


def _record(jaxpr, consts, args, recorded, sites, where, path, relus: ReluAxes, taken=None):
    """Traces `jaxpr` on `args`; puts into ``recorded[key]`` each ReLU's input and whether it
    ran (`taken`, a boolean scalar; None: always), keyed by its call path (the ids of the
    equations that lead to it), so the same jitted helper called by two layers gives two
    sites, and one ReLU in a scan body gives one site over all iterations."""
    def rule(eqn, ins):
        kind = ji.kind(eqn)
        here = source_line(eqn) or where
        key = (*path, id(eqn))
        called = ji.body(eqn)
        if called is not None:
            sub, sub_consts = called
            return _record(sub, sub_consts, ins[len(ins) - len(sub.invars):], recorded, sites,
                           here, key, relus, taken)
        if kind == "scan" and relus.has_relu(ji.scan(eqn).body):  # else: one bind
            return _record_scan(eqn, ins, recorded, sites, here, key, relus, taken)
        if kind == "cond" and any(relus.has_relu(b) for b, _ in ji.cond_branches(eqn)):
            return _record_cond(eqn, ins, recorded, sites, here, key, relus, taken)
        if relus.is_relu(eqn):  # a float max(x, 0), not a variance clamp
            x = ins[1] if _is_zero_literal(eqn.invars[0]) else ins[0]
            if jnp.ndim(x):
                axes, known = relus.unit_axes(eqn, jnp.shape(x))
                units = math.prod(jnp.shape(x)[d] for d in axes)
                note = "" if known or jnp.ndim(x) == 1 else UNKNOWN_AXIS_NOTE
                sites.setdefault(key, _Site(here, units, tuple(axes), note))
                recorded[key] = (x, jnp.bool_(True) if taken is None else taken)
        return None
    return interpret(jaxpr, consts, args, rule)


def _record_cond(eqn, ins, recorded, sites, where, key, relus, taken):
    """Every branch traced; the outputs of the one the index picks (as cond's clamp)."""
    branches = ji.cond_branches(eqn)
    index = jnp.clip(ins[0], 0, len(branches) - 1).astype(jnp.int32)
    outs = []
    for b, branch in enumerate(branches):
        ran = index == b if taken is None else jnp.logical_and(taken, index == b)
        outs.append(_record(*branch, ins[1:], recorded, sites, where,
                            (*key, b), relus, ran))
    return [jax.lax.select_n(index, *vals) if len(branches) > 1 else vals[0]
            for vals in zip(*outs)]


def _record_scan(eqn, ins, recorded, sites, where, key, relus, taken):
    """A scan re-built with its body's ReLU inputs as extra per-iteration outputs."""
    s = ji.scan(eqn)
    nc, nk = s.num_consts, s.num_carry
    body, body_consts = s.body, s.body_consts
    consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), list(ins[nc + nk:])

    def step(carry, x):
        inner: dict[tuple, tuple] = {}
        outs = _record(body, body_consts, [*consts, *carry, *x], inner, sites, where, key,
                       relus, taken)
        return outs[:nk], (outs[nk:], inner)

    carry, (ys, inner) = jax.lax.scan(step, carry, xs, length=s.length, reverse=s.reverse)
    for k, (x, ran) in inner.items():
        if s.reverse:  # in the order the iterations ran
            x, ran = jnp.flip(x, 0), jnp.flip(ran, 0)
        recorded[k] = (x, ran)
    return [*carry, *ys]
