"""A gradient monitor: per-step gradient statistics and alerts, computed inside the jitted step.

Every step, `GradMonitor.measure` turns the gradients into one `MonitorMetrics`: the global norm,
the L2 norm, mean and standard deviation of every leaf, the norm of every layer (the leaves that
share a parent container, e.g. ``params[0]``) and, with `with_dead_relu`, the share of each
ReLU's units that are dead for the whole batch, plus the counters of a baseline and of
vanishing streaks. Three flags follow from those values (article A §4.2, B §4.3; concept 16 of
CONCEPTS.md); they are properties of `MonitorMetrics`, computed where they are read (with NumPy
on the host for `monitor_alerts`), not in the step:

  ``explosion``  the global norm exceeds ``explode_factor`` times the baseline: the mean global
                 norm of the first ``warmup`` finite steps that did not explode themselves, or
                 during those steps the mean of the ones so far (from the second step on);
  ``nonfinite``  the global norm or the loss is NaN or inf (at any step);
  ``vanishing``  a layer's norm has stayed below ``vanish_floor`` *and* below ``vanish_ratio``
                 times the global norm for ``vanish_steps`` consecutive steps (raised once per
                 streak, on the step it reaches that length; the streak then lasts until the
                 layer has been clear of that condition for ``vanish_steps`` steps in a row).

Why the vanishing rule is relative. Vanishing gradients are an attenuation with depth: the
cotangent shrinks by the Jacobian of each layer it passes back through, so the first layers get
a gradient orders of magnitude smaller than the last ones while the loss is still high
(Hochreiter 1991; Bengio et al. 1994; Glorot & Bengio 2010 compare exactly these per-layer
norms). A model that has converged also has tiny gradients, but in every layer together: its
loss is near its minimum, so the cotangent at the output is small and each layer's share of
the global norm stays ordinary. An absolute floor alone cannot tell the two apart (a digits MLP
trained to a loss of 1e-7 drops below 1e-6 in every layer and raised thousands of alerts), so a
layer counts as vanishing only when its norm is also below ``vanish_ratio`` (default 1%) of
the step's global norm: a 12-layer sigmoid net's first layer sits at ~1e-7 of it, a converged
two-layer MLP's layers at ~0.5. With L layers of equal norms each is 1/sqrt(L) of the global
norm, so 1% leaves room for 10,000 of them. A step whose gradient is exactly zero everywhere
(an optimum, or a network that is dead throughout) is not called vanishing: gradients alone
cannot say which; the loss curve does. The hysteresis (a streak survives gaps shorter than
``vanish_steps``) keeps a norm that hovers around the floor from raising a new alert each time
it pops above it for a step.

The statistics are ``jnp`` code: no host round-trip inside ``jit``, so they compile into the
step (``benchmarks/monitor.py`` measures what they add), and everything in it that depends on
the gradient norm is one packed vector (`funcgrad.train._monitor_sums`). The baseline and the
vanishing streaks persist in a `MonitorState`: in the optimizer's state when the monitor is a
transformation of its chain (`funcgrad.grad_monitor`). On the host,
`funcgrad.train.alerts.monitor_alerts` turns one step's metrics into `Alert` objects whose
``str`` is a readable line; the names (leaf paths, layers, ReLU sites) travel as static
pytree metadata of `MonitorMetrics`, so they survive ``jit`` without a side channel.
`with_dead_relu` and `DeadReLU` live in `funcgrad.debug.dead_relu` and are re-exported here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._library_objects import equinox_floating
from funcgrad._paths import key_paths, keystr
from funcgrad.debug.dead_relu import DeadReLU as DeadReLU
from funcgrad.debug.dead_relu import with_dead_relu as with_dead_relu
from funcgrad.train._monitor_sums import statistics, values_dtype, vector

PyTree = Any


# --- per-step statistics, baseline and flags ---------------------------------------------

#: Where the per-step values sit in `MonitorMetrics.values` and `MonitorState.values`: six
#: scalars, then blocks of `leaves` or `layers` entries (`_Slots` computes the offsets).
_COUNT, _SUMSQ, _LOSS, _BASELINE_STEPS, _BASELINE, _BASELINE_TOTAL = range(6)


class _Slots(NamedTuple):
    """Offsets of the blocks of the packed values for `leaves` leaves and `layers` layers:
    ``[count, sum of squares, loss, baseline_steps, baseline, baseline_total | leaf_norm |
    layer_norm | leaf_mean | leaf_std | below_floor | clear]``."""
    leaf_norm: int
    layer_norm: int
    leaf_mean: int
    leaf_std: int
    below_floor: int
    clear: int
    size: int

    @classmethod
    def of(cls, leaves: int, layers: int) -> _Slots:
        return cls(6, 6 + leaves, 6 + leaves + layers, 6 + 2 * leaves + layers,
                   6 + 3 * leaves + layers, 6 + 3 * leaves + 2 * layers,
                   6 + 3 * leaves + 3 * layers)


def _xp(x):
    """NumPy for host arrays (after ``jax.device_get``), jax.numpy for device arrays/tracers."""
    return np if isinstance(x, (np.ndarray, np.generic)) else jnp


def _int_type(dtype):
    return np.int32 if np.dtype(dtype).itemsize == 4 else np.int64


def _count_of(values):
    """The update count, stored bit for bit in the float slot `_COUNT` (an int32 in float32,
    an int64 in float64: exact where a float count would stop at 2**24)."""
    bits = values[..., _COUNT]
    if _xp(values) is np:
        return np.asarray(bits).view(_int_type(bits.dtype))
    return jax.lax.bitcast_convert_type(bits, _int_type(bits.dtype))


class MonitorState:
    """What the monitor keeps between steps (a pytree: it jits, vmaps and checkpoints).

    One packed float vector, the last step's `MonitorMetrics.values`, holds the update count,
    the baseline and the vanishing streaks next to the statistics. A train step writes it with
    one fused kernel and reads the global norm back from it (one sqrt) for its non-finite
    guard: each further array computed from the norm would be one more small kernel ready
    together with the guarded updates, and past 8 ready kernels XLA:CPU hands half of them to
    its thread pool (measured 1.6x a small step; see funcgrad.train.step). The properties read the
    vector by name.

    Attributes:
      values: shape ``(6 + 3*leaves + 3*layers,)``, float32 (float64 for float64 params): the
        last update's `MonitorMetrics.values` (NaN statistics before the first), whose
        count, ``baseline_steps``, ``baseline_total``, ``below_floor`` and ``clear_steps``
        entries are the counters after that update (the count as the bits of an int32,
        resp. int64).
      layers: static; the number of layers.
    Properties: ``step`` (int32, updates so far: the index of the next step),
    ``baseline_steps`` (finite, non-exploding global norms in the baseline, at most
    ``warmup``),
    ``baseline_total`` (their sum), ``below_floor`` (per layer, the length in steps of its
    current vanishing streak: consecutive steps below the floor and the ratio, then, once it
    reached ``vanish_steps``, every step until ``vanish_steps`` clear steps in a row end it;
    -1 for a layer that is not watched: all its leaves frozen; exact in float32 up to 2**24
    steps, where a streak stops growing), ``clear_steps`` (per layer, consecutive steps up to
    the last one that it was *not* below the floor and the ratio; -1 when not watched).
    """
    __slots__ = ("values", "layers", "monitor", "names")

    def __init__(self, values: jax.Array, layers: int, monitor: GradMonitor | None = None,
                 names: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())):
        self.values, self.layers, self.monitor, self.names = values, layers, monitor, names

    def __repr__(self) -> str:
        return f"MonitorState(values={self.values!r}, layers={self.layers})"

    def metrics(self, dead_relu: DeadReLU | None = None, *, has_loss: bool = True,
                dead_relu_note: str = "") -> MonitorMetrics:
        """The `MonitorMetrics` of the update that made this state (its values are this
        state's), with the dead units of `dead_relu` (from `with_dead_relu`), if any;
        `dead_relu_note` says why a monitor asked for them and has none."""
        m = cast("GradMonitor", self.monitor)
        return MonitorMetrics(self.values, tuple(dead_relu.dead) if dead_relu is not None
                              else (), m._layout(self.names[0], self.names[1], dead_relu,
                                                 has_loss, dead_relu_note))

    step = property(lambda self: _count_of(self.values))
    baseline_steps = property(
        lambda self: self.values[..., _BASELINE_STEPS].astype(np.int32))
    baseline_total = property(lambda self: self.values[..., _BASELINE_TOTAL])
    below_floor = property(lambda self: self.values[
        ..., self.values.shape[-1] - 2 * self.layers:
        self.values.shape[-1] - self.layers].astype(np.int32))
    clear_steps = property(lambda self: self.values[
        ..., self.values.shape[-1] - self.layers:].astype(np.int32))


jax.tree_util.register_dataclass(MonitorState, data_fields=["values"],
                                 meta_fields=["layers", "monitor", "names"])


@dataclasses.dataclass(frozen=True)
class MonitorLayout:
    """The static half of `MonitorMetrics`: names and the monitor's settings (hashable).

    Attributes:
      leaf_names: ``params[0]['w']``, ...; layer_names: ``params[0]``, ...; relu_names:
        ``relu 0 at mlp.py:96:16 (mlp_apply)``, ...; then the `GradMonitor` settings, and
        has_loss: whether `GradMonitor.measure` was given a loss (a non-finite one raises the
        nonfinite flag); dead_relu_note: why a monitor that records dead ReLUs has none here
        ("" when it has them, or was not asked to).
    """
    leaf_names: tuple[str, ...]
    layer_names: tuple[str, ...]
    relu_names: tuple[str, ...]
    warmup: int
    explode_factor: float
    vanish_floor: float
    vanish_steps: int
    dead_threshold: float
    has_loss: bool = True
    vanish_ratio: float = 0.01
    dead_relu_note: str = ""


class MonitorMetrics:
    """One step's gradient statistics and flags: one packed vector (plus the dead-unit masks),
    read by name.

    ``m.grad_norm``, ``m.leaf_norm``, ``m.explosion``, ... are properties that slice the arrays
    (and derive the flags from them), on device or on host (after ``jax.device_get(m)``, with
    NumPy). Everything that depends on the gradient norm is one packed vector, written by one
    fused kernel, and the flags are not computed in the step at all: each extra array the step
    derives from the norm is one more kernel at its end (see `MonitorState`). A plain class with
    ``__slots__`` rather than a frozen dataclass: rebuilding one after each jitted call measured
    ~3 microseconds cheaper on CPU, ~2% of a small train step.

    Attributes:
      values: shape ``(6 + 3*leaves + 3*layers,)``, float (float32, or float64 for float64
        params): the update count including this step (the bits of an int), the global sum of
        squares (grad_norm**2), loss, baseline_steps after this step, the baseline this step
        was compared with, baseline_total after it, then leaf_norm, layer_norm, leaf_mean,
        leaf_std, below_floor and clear_steps (`_Slots`). The same vector is the next
        `MonitorState.values`.
      dead: one bool array of shape (units,) per ReLU site, `DeadReLU.dead` (True: dead for
        the whole batch); ``dead_fraction`` averages them where it is read (on the host, no
        kernel in the step).
      layout: static; a `MonitorLayout` (names and settings), so that `monitor_alerts` needs
        nothing else. ``m.leaf_names`` etc. read it through.
    Properties (norms in the gradients' units; metrics stacked by ``lax.scan`` or ``vmap``
    keep their leading axes, the shapes below are per step):
      step: (), the index of the step (0-based). loss: () (nan when none was given).
      grad_norm: () global L2 norm. baseline: () the baseline this step was compared with:
      the mean of the first ``warmup`` finite, non-exploding global norms, or of those before
      this step while there are fewer; nan at the first step. leaf_norm, leaf_mean, leaf_std:
      (leaves,) L2 norm, mean and population standard deviation (ddof=0) of each leaf, in
      ``jax.tree.leaves`` order.
      layer_norm: (layers,). dead_fraction: (sites,), dimensionless (`with_dead_relu`).
      explosion, nonfinite: () bool; vanishing: (layers,) bool, True on the step a layer's
      streak reaches ``vanish_steps`` (once per streak); below_floor: (layers,) int, each
      layer's streak, clear_steps: (layers,) int, its steps clear of the vanishing condition
      in a row (both -1: not watched; see `MonitorState`).
    """
    __slots__ = ("values", "dead", "layout")

    def __init__(self, values: jax.Array | np.ndarray | None,
                 dead: tuple[jax.Array | np.ndarray, ...],
                 layout: MonitorLayout):
        self.values, self.dead, self.layout = values, dead, layout

    def __getattr__(self, name: str):  # leaf_names, warmup, ... from the layout
        if name in MonitorLayout.__dataclass_fields__:
            return getattr(self.layout, name)
        raise AttributeError(f"MonitorMetrics has no attribute {name!r}")

    def __repr__(self) -> str:
        return (f"MonitorMetrics(values={self.values!r}, dead={self.dead!r}, "
                f"layout={self.layout!r})")

    def _detached(self) -> MonitorMetrics:
        """Without `values`, which the step's new `MonitorState` holds: a jitted train step
        returns the vector once, in the state (a second output would be a copy kernel after
        the norm), and sets ``metrics.values = state.values`` on the host."""
        return MonitorMetrics(None, self.dead, self.layout)

    def _block(self, name: str) -> Any:
        slots = _Slots.of(len(self.layout.leaf_names), len(self.layout.layer_names))
        start = getattr(slots, name)
        values = cast("jax.Array | np.ndarray", self.values)  # None only inside the step
        return values[..., start:slots[slots._fields.index(name) + 1]]

    grad_norm = property(lambda self: _xp(self.values).sqrt(self.values[..., _SUMSQ]))
    loss = property(lambda self: self.values[..., _LOSS])
    baseline = property(lambda self: self.values[..., _BASELINE])
    leaf_norm = property(lambda self: self._block("leaf_norm"))
    layer_norm = property(lambda self: self._block("layer_norm"))
    leaf_mean = property(lambda self: self._block("leaf_mean"))
    leaf_std = property(lambda self: self._block("leaf_std"))
    below_floor = property(lambda self: self._block("below_floor").astype(np.int32))
    clear_steps = property(lambda self: self._block("clear").astype(np.int32))
    step = property(lambda self: _count_of(self.values) - 1)

    @property
    def dead_fraction(self):
        xp = _xp(self.values)
        if not self.dead:
            return xp.zeros((*xp.shape(self.values)[:-1], 0), xp.float32)
        return xp.stack([xp.mean(d, axis=-1, dtype=xp.float32) for d in self.dead], axis=-1)

    @property
    def explosion(self):
        """The global norm is finite and above ``explode_factor`` x the baseline it was
        compared with (from the second step on)."""
        xp, norm, baseline = _xp(self.values), self.grad_norm, self.baseline
        dtype = cast("jax.Array | np.ndarray", self.values).dtype  # None only inside the step
        limit = xp.asarray(self.layout.explode_factor, dtype) * baseline
        return xp.isfinite(norm) & ~xp.isnan(baseline) & (norm > limit)

    @property
    def nonfinite(self):
        """The global norm, or the loss when one was given, is NaN or inf."""
        xp = _xp(self.values)
        bad = ~xp.isfinite(self.grad_norm)
        return bad | ~xp.isfinite(self.loss) if self.layout.has_loss else bad

    @property
    def vanishing(self):
        return self.below_floor == self.layout.vanish_steps

    def to_dict(self) -> dict[str, Any]:
        """One step's numbers as plain Python numbers keyed by name (for JSON)."""
        m = jax.device_get(self)
        named = lambda names, values: dict(zip(names, np.asarray(values).tolist()))
        return {"step": int(m.step), "loss": float(m.loss), "grad_norm": float(m.grad_norm),
                "baseline": float(m.baseline),
                "leaf_norm": named(m.leaf_names, m.leaf_norm),
                "leaf_mean": named(m.leaf_names, m.leaf_mean),
                "leaf_std": named(m.leaf_names, m.leaf_std),
                "layer_norm": named(m.layer_names, m.layer_norm),
                "dead_fraction": named(m.relu_names, m.dead_fraction)}


jax.tree_util.register_dataclass(MonitorMetrics, data_fields=["values", "dead"],
                                 meta_fields=["layout"])


def _layers(params: PyTree) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """Leaf names, layer names and each leaf's layer index; a layer is a leaf's parent."""
    leaf_names, layer_names, layer_of = [], [], []
    for path in key_paths(params):  # an nnx Variable's .value is not a level (funcgrad._paths)
        leaf_names.append("params" + keystr(path))
        layer = "params" + keystr(path[:-1])
        if layer not in layer_names:
            layer_names.append(layer)
        layer_of.append(layer_names.index(layer))
    return tuple(leaf_names), tuple(layer_names), tuple(layer_of)


@dataclasses.dataclass(frozen=True)
class GradMonitor:
    """The monitor's settings and its ``(init, measure)`` pair of pure functions (in an
    optimizer's ``optax.chain``: `funcgrad.grad_monitor`).

    Attributes:
      warmup: steps whose finite global norms make the baseline (their mean; a norm that
        explodes against the mean so far is left out), >= 1.
      explode_factor: the explosion threshold in units of the baseline, > 1.
      vanish_floor: a layer norm below this (gradient units) counts toward vanishing, >= 0,
        when it is also below `vanish_ratio` x the global norm.
      vanish_steps: consecutive steps below both that raise a vanishing flag, >= 1; as many
        clear steps in a row end the streak (one alert per streak).
      dead_relu: whether `funcgrad.train.step.make_train_step` records dead ReLU units.
      dead_threshold: `monitor_alerts` reports a ReLU site once its dead fraction reaches
        this (dimensionless, in (0, 1]).
      vanish_ratio: a layer counts toward vanishing only while its norm is below this
        fraction of the step's global norm (dimensionless, in (0, 1]): the gradient is
        attenuated in that layer, not small everywhere as in a converged model (see the
        module docstring). 1 leaves the absolute floor nearly alone.
    The defaults are rules of thumb, not results. Article A §4.2 calls a global norm of about
    0.01 to 10 normal and a norm that stays far outside it a warning; Pascanu et al. 2013
    (arXiv:1211.5063, §3.2) set the clipping threshold from the average norm over many
    updates, and a norm ten times the early average is far outside its usual spread. Below a
    layer norm of 1e-6 an update with a learning rate <= 0.1 is under 1.2e-7, the float32
    spacing at 1.0, so unit-scale weights no longer move.
    """
    warmup: int = 10
    explode_factor: float = 10.0
    vanish_floor: float = 1e-6
    vanish_steps: int = 10
    dead_relu: bool = True
    dead_threshold: float = 0.9
    vanish_ratio: float = 0.01

    def __post_init__(self):
        checks = [("warmup", self.warmup, _count(self.warmup), "an int >= 1 (steps)"),
                  ("explode_factor", self.explode_factor,
                   _real(self.explode_factor) and self.explode_factor > 1, "a number > 1"),
                  ("vanish_floor", self.vanish_floor,
                   _real(self.vanish_floor) and self.vanish_floor >= 0, "a number >= 0"),
                  ("vanish_steps", self.vanish_steps, _count(self.vanish_steps),
                   "an int >= 1 (steps)"),
                  ("dead_threshold", self.dead_threshold,
                   _real(self.dead_threshold) and 0 < self.dead_threshold <= 1, "in (0, 1]"),
                  ("vanish_ratio", self.vanish_ratio,
                   _real(self.vanish_ratio) and 0 < self.vanish_ratio <= 1, "in (0, 1]")]
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"grad_monitor: {name} must be {expected}, got {value!r}.")

    def init(self, params: PyTree, *, trainable: PyTree | None = None) -> MonitorState:
        """The state before the first step, for gradients with the structure of `params`.

        `trainable` (a mask from `funcgrad.trainable_mask`, the structure of `params` or a
        prefix of it) excludes layers whose leaves are all frozen from the vanishing check.
        An equinox module is described by its floating arrays (the leaves of
        ``eqx.filter_grad``'s gradient). Raises ValueError if `params` has no leaves.
        """
        # An equinox model: the leaves eqx.filter_grad gives.
        params = equinox_floating(params, "grad_monitor().init")
        leaf_names, layer_names, layer_of = _layers(params)
        if not leaf_names:
            raise ValueError(f"grad_monitor: params has no array leaves (got {params!r}), so "
                             "there is no gradient to monitor. Pass the params the train step "
                             "differentiates.")
        watched = np.zeros(len(layer_names), bool)
        flags = [True] * len(layer_of) if trainable is None else jax.tree.leaves(jax.tree.map(
            lambda m, sub: jax.tree.map(lambda _: bool(m), sub), trainable, params))
        for layer, flag in zip(layer_of, flags):
            watched[layer] |= flag
        slots = _Slots.of(len(leaf_names), len(layer_names))
        values = np.full(slots.size, np.nan, values_dtype(jax.tree.leaves(params)))
        values[[_COUNT, _BASELINE_STEPS, _BASELINE_TOTAL]] = 0  # count 0: all bits 0
        values[slots.below_floor:] = np.tile(np.where(watched, 0, -1), 2)  # and clear
        return MonitorState(jnp.asarray(values), len(layer_names), self,
                            (leaf_names, layer_names))

    def _layout(self, leaf_names: tuple[str, ...], layer_names: tuple[str, ...],
                dead_relu: DeadReLU | None, has_loss: bool, note: str = "") -> MonitorLayout:
        return MonitorLayout(
            leaf_names, layer_names, dead_relu.names if dead_relu is not None else (),
            self.warmup, float(self.explode_factor), float(self.vanish_floor),
            self.vanish_steps, float(self.dead_threshold), has_loss,
            float(self.vanish_ratio), note)

    def measure(self, state: MonitorState, grads: PyTree, *,
               loss: jax.typing.ArrayLike | None = None,
               dead_relu: DeadReLU | None = None) -> tuple[MonitorState, MonitorMetrics]:
        """Statistics of one step's gradients; pure, meant to run inside ``jit``.

        Args:
          state: from `init` or the previous `update`.
          grads: the step's gradients, same structure as the `params` given to `init`.
          loss: the step's loss, shape (); a non-finite loss raises the nonfinite flag.
          dead_relu: from `with_dead_relu`, for the dead fractions (else none are reported).
        Returns:
          ``(state, metrics)``: the next `MonitorState` and this step's `MonitorMetrics`
          (whose ``values`` is the new state's ``values``).
        Raises:
          ValueError: if `grads` has a different number of layers or leaves than the params
            of `init`.
          TypeError: if a gradient leaf is not real floating point (the message names it).
        """
        leaf_names, layer_names, layer_of = _layers(grads)
        slots = _Slots.of(len(leaf_names), len(layer_names))
        if state.layers != len(layer_names) or state.values.shape[-1] != slots.size:
            raise ValueError(f"the monitor state was made for {state.layers} layers, but the "
                             f"gradients have {len(layer_names)} ({', '.join(layer_names)}) "
                             f"and {len(leaf_names)} leaves. Make it with init(params) for "
                             "these params.")
        dtype = state.values.dtype
        sumsq, norms, mean, std = statistics(grads, leaf_names, layer_of, len(layer_names),
                                              dtype)
        layer_norm = norms[len(leaf_names):]
        has_loss = loss is not None
        loss = jnp.asarray(loss if has_loss else jnp.nan).astype(dtype)
        old = state.values
        baseline_steps, baseline_total = old[_BASELINE_STEPS], old[_BASELINE_TOTAL]
        below_floor, clear = old[slots.below_floor:slots.clear], old[slots.clear:]
        ready = baseline_steps >= self.warmup
        # The reference this step is compared with: the mean of the norms in the baseline so
        # far (all `warmup` of them once it is ready), NaN before the first. A norm that
        # explodes against it is not added, so an explosion from step 1 on (a far too large
        # learning rate) neither hides in its own baseline nor goes unreported.
        baseline = jnp.where(baseline_steps > 0,
                             baseline_total / jnp.maximum(baseline_steps, 1), jnp.nan)
        exploding = sumsq > (self.explode_factor * baseline) ** 2  # False while baseline is NaN
        add = ~ready & jnp.isfinite(sumsq) & ~exploding  # sqrt(sumsq) is finite iff sumsq is
        # Vanishing (module docstring): below the floor and a small share of the global norm.
        # A streak starts with `vanish_steps` such steps in a row (the alert) and then lasts
        # until `vanish_steps` clear steps in a row; NaN norms count as clear.
        small = ((layer_norm < self.vanish_floor)
                 & (layer_norm < self.vanish_ratio * jnp.sqrt(sumsq)))
        clear = jnp.where(below_floor < 0, -1, jnp.where(small, 0, clear + 1))
        going = small | ((below_floor >= self.vanish_steps) & (clear < self.vanish_steps))
        streak = jnp.where(below_floor < 0, -1, jnp.where(going, below_floor + 1, 0))
        count = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(old[_COUNT], _int_type(dtype)) + 1, dtype)
        # The baseline's divide and the norm's sqrt are operands of their own: inside the
        # broadcast of `vector` XLA would compute them in kernels of their own first.
        values = jnp.concatenate([
            vector(count, sumsq, loss, baseline_steps + add.astype(dtype)), baseline[None],
            (baseline_total + jnp.where(add, jnp.sqrt(sumsq), 0))[None], norms, mean, std,
            streak.astype(dtype), clear.astype(dtype)])
        # A barrier, so that XLA reads the global norm back from this vector (`grad_norm`:
        # one sqrt kernel after it, which a train step's guard and "grad_norm" share) instead
        # of computing it beside it: see MonitorState.
        values = jax.lax.optimization_barrier(values)
        dead = tuple(dead_relu.dead) if dead_relu is not None else ()
        metrics = MonitorMetrics(values, dead, self._layout(leaf_names, layer_names, dead_relu,
                                                            has_loss))
        return MonitorState(values, state.layers, self, state.names), metrics


def _real(x) -> bool:
    return isinstance(x, (int, float, np.number)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and bool(x >= 1)
