"""A functional train step: an explicit train state and one jitted step (`fit` runs it).

There is no ``zero_grad``: each step computes fresh gradients with ``jax.value_and_grad`` and
hands them to an optax optimizer, so nothing accumulates between steps unless you ask for it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from funcgrad._library_objects import check_optimizer
from funcgrad.train._program import _build, _Built
from funcgrad.train.loss import Loss, as_loss
from funcgrad.train.masks import train_only
from funcgrad.train.monitor import GradMonitor, MonitorState
from funcgrad.train.optimizers import (
    make_optimizer,
)
from funcgrad.train.precision import LossScale
from funcgrad.train.state import TrainState, _initial_state, _trainable_of, _watch_trainable
from funcgrad.train.transforms import ClipState, check_records, records_of_optimizer

PyTree = Any
Batch = Mapping[str, Any]
LossFn = Callable[[PyTree, Batch], jax.Array]

#: What a train step does when the loss or the global gradient norm is NaN or inf.
NONFINITE_POLICIES = ("skip", "raise")


#: make_train_step's former keywords and the piece that replaced each.
_MOVED_KEYWORDS = {
    "has_aux": "declare it on the loss: funcgrad.Loss(loss_fn, has_aux=True)",
    "has_state": "declare it on the loss: funcgrad.Loss(loss_fn, has_state=True)",
    "takes_key": "declare it on the loss: funcgrad.Loss(loss_fn, takes_key=True)",
    "compute_dtype": "transform the loss: funcgrad.mixed_precision(loss_fn, jnp.bfloat16)",
    "loss_scale": "transform the loss: funcgrad.mixed_precision(loss_fn, jnp.float16, "
                  "loss_scale=funcgrad.dynamic_loss_scale())",
    "accumulate": "transform the loss: funcgrad.accumulate(per_example_loss, k)",
    "tail": "transform the loss: funcgrad.accumulate(per_example_loss, k, tail='drop')",
    "detect_anomaly": "wrap the step: funcgrad.detect_anomaly(step)",
    "mesh": "wrap the step: funcgrad.data_parallel(step, mesh)",
    "data_axis": "wrap the step: funcgrad.data_parallel(step, mesh, data_axis='data')",
    "shard_opt_state": "wrap the step: funcgrad.data_parallel(step, mesh, "
                       "shard_opt_state=True)",
    "clip_norm": "chain it before the optimizer: optax.chain(funcgrad.clip_by_global_norm("
                 "1.0), optax.adam(1e-3)) (metrics['clip_coef'] and the pre-clip "
                 "metrics['grad_norm'] come from its state)",
    "monitor": "chain it first in the optimizer: optax.chain(funcgrad.grad_monitor(), "
               "optax.adam(1e-3)) (metrics['monitor'] comes from its state)",
}


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """A train step as a value: what it computes (its pieces, as fields) and ``init`` /
    ``update``, the way an optax optimizer is ``init`` / ``update``.

    Built by `make_train_step` and its wrappers (`funcgrad.detect_anomaly`,
    `funcgrad.data_parallel`); `funcgrad.fit`, `funcgrad.doctor` and the CLI read its fields.

    Attributes:
      loss: the `funcgrad.Loss` (with its ``precision`` and ``accumulation`` pieces).
      optimizer: the optax transformation applied (wrapped by `funcgrad.train_only` for
        `trainable`).
      trainable: the trainable mask (`funcgrad.trainable_mask`; from `trainable` and every
        `funcgrad.train_only` of the optimizer), or None when every leaf trains.
      nonfinite: "skip" or "raise" (`make_train_step`).
      jit: whether calls run the jitted step.
      detect_anomaly: whether a non-finite step is located (`funcgrad.detect_anomaly`).
      parallel: the data-parallel placement (`funcgrad.data_parallel`), or None.
    """
    #: Tells the loss pieces that a TrainStep is not a loss (`funcgrad.train.loss`).
    _is_train_step = True

    loss: Loss
    optimizer: optax.GradientTransformation
    trainable: PyTree = None
    nonfinite: str = "skip"
    jit: bool = True
    detect_anomaly: bool = False
    parallel: Any = None
    _built: _Built = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE_POLICIES:  # dataclasses.replace comes here too
            raise ValueError(f"TrainStep: nonfinite must be one of {NONFINITE_POLICIES}, got "
                             f"{self.nonfinite!r}."
                             + (" Zeroing the non-finite gradient leaves is a piece of the "
                                "optimizer now: optax.chain(funcgrad.zero_nonfinite(), "
                                "optax.adam(1e-3))." if self.nonfinite == "zero" else ""))
        object.__setattr__(self, "_built", _build(self))

    @property
    def monitor(self) -> GradMonitor | None:
        """The settings of the `funcgrad.grad_monitor` in the optimizer's chain, or None (found
        in the state the optimizer makes for a one-leaf params; None where that cannot be
        made, e.g. inside a `funcgrad.train_only` of other params)."""
        node = next((r for r in _records_of(self.optimizer) if isinstance(r, MonitorState)),
                    None)
        return None if node is None else node.monitor

    @property
    def clips(self) -> bool:
        """Whether the optimizer's chain has a `funcgrad.clip_by_global_norm` (as `monitor`
        finds it)."""
        return any(isinstance(r, ClipState) for r in _records_of(self.optimizer))

    # What the loss's pieces say (None without them).
    @property
    def compute_dtype(self) -> Any:
        """The loss's compute dtype (`funcgrad.mixed_precision`), or None."""
        return None if self.loss.precision is None else self.loss.precision.compute_dtype

    @property
    def loss_scale(self) -> LossScale | None:
        """The loss's `funcgrad.LossScale` (`funcgrad.mixed_precision`), or None."""
        return None if self.loss.precision is None else self.loss.precision.loss_scale

    @property
    def accumulate(self) -> int | None:
        """K, micro-batches per update (`funcgrad.accumulate`), or None."""
        return None if self.loss.accumulation is None else self.loss.accumulation.k

    @property
    def tail(self) -> str | None:
        """What a short final group does (`funcgrad.accumulate`), or None."""
        return None if self.loss.accumulation is None else self.loss.accumulation.tail

    @property
    def mesh(self) -> Any:
        """The ``jax.sharding.Mesh`` of a data-parallel step, or None."""
        return None if self.parallel is None else self.parallel.mesh

    @property
    def data_axis(self) -> str | None:
        """The mesh axis the batch's rows are split over, or None."""
        return None if self.parallel is None else self.parallel.data_axis

    @property
    def shard_opt_state(self) -> bool:
        """Whether the optimizer state is split over the data axis (ZeRO-1)."""
        return self.parallel is not None and self.parallel.shard_opt_state

    # What fit runs (funcgrad.train.loop): the step before jax.jit, and without the guard.
    @property
    def unjitted(self) -> Callable | None:
        """The step before ``jax.jit`` (None with ``jit=False``): fit runs it many steps at a
        time inside one compiled chunk."""
        return self._built.unjitted

    @property
    def unguarded(self) -> Callable | None:
        """`unjitted` without the guard's selects (it still reports "skipped"; None with a
        loss scale): fit runs it first and re-runs a chunk guarded when a step was skipped."""
        return self._built.unguarded

    def init(self, params: PyTree, *, model_state: PyTree = None, seed: int | None = None,
             key: jax.Array | None = None) -> TrainState:
        """The `TrainState` at step 0 for this step: `params`, the optimizer's state (frozen
        leaves keep none), the loss scale's and the monitor's states when the step has them.

        Args:
          params: the parameter pytree (float32 master params under mixed precision).
          model_state: the initial model state (a pytree of arrays: BatchNorm's running
            statistics); required exactly when the loss is declared ``has_state=True``.
          seed: an int, the run's base PRNG key ``jax.random.key(seed)`` for a loss declared
            ``takes_key=True`` (default 0); step s draws ``fold_in(key, s)``.
          key: a PRNG key instead of `seed` (typed ``jax.random.key(0)`` or raw
            ``jax.random.PRNGKey(0)``).
        Raises:
          ValueError: for a model state the loss does not declare (or none where it does), a
            seed or key for a loss that takes none, or both `seed` and `key`.
          TypeError: for params that are an equinox module or nnx object (the message gives
            the split), a non-array model-state leaf, a key that is not a PRNG key.
        """
        loss = self.loss
        if loss.has_state and model_state is None:
            raise ValueError(f"TrainStep.init: the loss is declared with model state ({loss!r});"
                             " pass its initial value: step.init(params, model_state=...).")
        if not loss.has_state and model_state is not None:
            raise ValueError("TrainStep.init: model_state= was given but the loss is not "
                             "declared with has_state=True, so it would never update. Declare "
                             "funcgrad.Loss(loss_fn, has_state=True), or drop model_state=.")
        if not loss.takes_key and (seed is not None or key is not None):
            raise ValueError("TrainStep.init: a seed or key was given but the loss takes no "
                             "key, so it would never be used. Declare funcgrad.Loss(loss_fn, "
                             "takes_key=True), or drop it.")
        if loss.takes_key and seed is None and key is None:
            seed = 0
        state = _initial_state(params, self.optimizer, loss_scale=self.loss_scale,
                               model_state=model_state, seed=seed, key=key,
                               _where="TrainStep.init")
        if self.trainable is None:
            return state
        return state._replace(opt_state=_watch_trainable(state.opt_state, params,
                                                         self.trainable))

    def update(self, state: TrainState, batch: Batch, mask: jax.Array | None = None
               ) -> tuple[TrainState, dict[str, Any]]:
        """One update: ``(state, batch) -> (new state, metrics)`` (see `make_train_step`);
        with `funcgrad.accumulate`, ``(state, microbatches, mask=None)``."""
        return self(state, batch) if mask is None else self(state, batch, mask)

    def __call__(self, state: TrainState, *args: Any) -> tuple[TrainState, dict[str, Any]]:
        return self._built.call(state, *args)

    def explain_skipped_update(self, state: TrainState, *args: Any) -> str:
        """Which leaves' updates or new values were NaN/inf in the step ``self(state, *args)``
        and how to fix it; "" if none were. Runs that step again (once, on the host's call)."""
        return self._built.explain(state, *args)

    def lower(self, state: TrainState, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the step (for `funcgrad.memory_report`,
        `funcgrad.collectives`); not with ``jit=False``."""
        lower = getattr(self._built.lowered, "lower", None)
        if lower is None:
            raise ValueError("TrainStep.lower: this step was made with jit=False.")
        return lower(state, *args)

    def place_state(self, state: TrainState, *, check: bool = True) -> TrainState:
        """The state placed where this step takes it: as is on one device; replicated over
        the mesh (the optimizer state split under ZeRO-1) for `funcgrad.data_parallel`."""
        return state if self.parallel is None else self.parallel.place_state(state, check=check)

    def state_shardings(self, state: TrainState) -> Any:
        """The shardings of a data-parallel step's state (None on one device)."""
        return None if self.parallel is None else self.parallel.state_shardings(state)

    def __repr__(self) -> str:
        pieces = [repr(self.loss), _optimizer_name(self.optimizer)]
        pieces += [f"{name}={getattr(self, name)!r}" for name in
                   ("nonfinite", "jit", "detect_anomaly", "parallel")
                   if getattr(self, name) != _DEFAULTS[name]]
        return f"TrainStep({', '.join(pieces)})"


_DEFAULTS = {"nonfinite": "skip", "jit": True, "detect_anomaly": False, "parallel": None}


def _optimizer_name(optimizer: Any) -> str:
    """A short name for the step's repr: the optax function that made `optimizer`."""
    update = getattr(optimizer, "update", None)
    name = getattr(update, "__qualname__", "") or type(optimizer).__name__
    return "optimizer=" + name.split(".<locals>")[0]


def _records_of(optimizer: Any) -> tuple:
    """`funcgrad.train.transforms.records_of_optimizer`, () where they cannot be known."""
    return records_of_optimizer(optimizer) or ()


def make_train_step(loss: LossFn | Loss, optimizer: str | optax.GradientTransformation, *,
                    trainable: PyTree | None = None, nonfinite: str = "skip",
                    jit: bool = True, **moved: Any) -> TrainStep:
    """Returns the `TrainStep` that trains `loss` with `optimizer`: ``step.init(params)``
    makes its state, ``step(state, batch) -> (state, metrics)`` (``step.update``) runs it,
    jitted.

    The step computes ``value_and_grad`` of the loss over the trained leaves, applies the
    optimizer's update (the loss goes to the chain as optax's ``value`` extra argument) and
    never applies a non-finite one: a step whose loss or gradient norm is NaN/inf, or whose
    update would make a trained leaf or the model state NaN/inf, leaves params, optimizer
    state and model state as they were (``state.step`` still counts it) and reports
    ``metrics["skipped"] = 1``; ``step.explain_skipped_update(state, batch)`` then names the
    leaves. The guard is one fused reduction and a ``jnp.where`` per leaf, no host round trip.
    The training guide (docs/guide/train.md) gives the whole behaviour; what each piece adds is
    in its own docstring.

    Pieces: the loss's contract (`funcgrad.Loss`: aux, model state, key), its precision
    (`funcgrad.mixed_precision`) and accumulation (`funcgrad.accumulate`); in the optimizer's
    ``optax.chain``, `funcgrad.clip_by_global_norm`, `funcgrad.zero_nonfinite` and
    `funcgrad.grad_monitor`, whose records the step reports; the step's wrappers
    `funcgrad.detect_anomaly` and `funcgrad.data_parallel`.

    Args:
      loss: ``loss(params, batch) -> scalar``, a pure function, or a `funcgrad.Loss`.
      optimizer: an optax transformation, or a name for `funcgrad.make_optimizer`.
      trainable: a mask (`funcgrad.trainable_mask`; True = trained, as everywhere in
        funcgrad): frozen leaves are not differentiated (exact zero gradient, left out of the
        norm and the guard) and get exactly zero updates. Integer and bool leaves must be
        frozen.
      nonfinite: "skip" (above) or "raise" (skip, and `funcgrad.fit` raises
        ``FloatingPointError``).
      jit: False returns the step un-jitted (for debugging with prints).
    Returns:
      a `TrainStep`. Its metrics are device arrays: "loss" and "grad_norm" (the global norm
      of the gradient; the pre-clip norm with `funcgrad.clip_by_global_norm`), "skipped"
      (int32, 1 when the update was not applied), plus "clip_coef", "nonfinite_leaves",
      "monitor", "loss_scale" and "skipped_total", "learning_rate" (an optimizer that keeps
      its rate: ``optax.inject_hyperparams``) and "aux" as the pieces add them.
    Raises:
      TypeError: for a keyword that became a piece (the message names it); at the first
        call, a trained integer leaf or a traced value used as a Python value in the loss
        (`funcgrad.TracedValueError`, at the loss's line).
      ValueError: for an unknown `nonfinite`; at ``init`` or the first call,
        `funcgrad.zero_nonfinite` in the chain with a loss scale, a loss that is not a
        scalar (per example under `funcgrad.accumulate`) or a state made by another step.
    Example:
      >>> tx = optax.chain(fg.clip_by_global_norm(1.0), optax.adam(1e-3))
      >>> step = fg.make_train_step(loss_fn, tx)
      >>> state = step.init(params)
      >>> state, metrics = step(state, batch)
    """
    if moved:
        name = next(iter(moved))
        if name in _MOVED_KEYWORDS:
            raise TypeError(f"make_train_step: {name}= is no longer a keyword; "
                            f"{_MOVED_KEYWORDS[name]}.")
        raise TypeError(f"make_train_step() got an unexpected keyword argument {name!r}.")
    check_optimizer("make_train_step", optimizer)
    optimizer = make_optimizer(optimizer)
    if nonfinite == "zero":
        raise ValueError("make_train_step: nonfinite='zero' is a piece of the optimizer now: "
                         "optax.chain(funcgrad.zero_nonfinite(), optax.adam(1e-3)) (its "
                         "state counts the leaves it zeroed: metrics['nonfinite_leaves']).")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    loss = as_loss(loss)
    if trainable is not None:
        optimizer = train_only(optimizer, trainable)
    # trainable= and an optimizer from fg.train_only are one thing: the frozen leaves are not
    # differentiated, so the norm, the guard and the chain see only the gradient that is
    # applied (frozen leaves add exact zeros and are left out of them).
    step = TrainStep(loss=loss, optimizer=optimizer, trainable=_trainable_of(optimizer),
                     nonfinite=nonfinite, jit=bool(jit))
    check_records(_records_of(optimizer), step.loss_scale)  # the rest at init and first call
    return step


def detect_anomaly(step: TrainStep) -> TrainStep:
    """`step`, locating the first non-finite value of a step whose loss or gradient norm is
    NaN/inf (PyTorch's ``detect_anomaly``, for one step).

    After such a step, `funcgrad.find_nonfinite` runs (eagerly) on that step's params and batch,
    evaluating the loss as the step does (its compute dtype and loss scale, only the trained
    leaves differentiated), and its `funcgrad.AnomalyReport` is ``metrics["anomaly"]``; `fit`
    puts it in its report. Under `funcgrad.accumulate` it runs on each micro-batch of the
    first non-finite update and names the first that is not finite. Under a loss scale a step
    whose loss is finite is a routine overflow and is not located. It costs one host read of
    the loss and norm per step.

    Raises:
      TypeError: if `step` is not a `TrainStep`.
      ValueError: for a data-parallel step (locate on the one-device step, same global batch).
    """
    require_train_step("detect_anomaly", step)
    if step.parallel is not None:
        raise ValueError("detect_anomaly: not with funcgrad.data_parallel yet: it re-runs the "
                         "loss eagerly on the host's copy of the batch. Apply detect_anomaly "
                         "to the one-device step and run it on the same global batch.")
    return dataclasses.replace(step, detect_anomaly=True)


def require_train_step(where: str, step: Any) -> None:
    if not isinstance(step, TrainStep):
        raise TypeError(f"{where}: expected a TrainStep from funcgrad.make_train_step(loss, "
                        f"optimizer), got {type(step).__name__}.")


def step_was_skipped(metrics: Mapping[str, Any]) -> bool:
    """Whether a train step did not apply its update, from its metrics (on the host).

    Uses ``metrics["skipped"]``, which every step of `make_train_step` reports (a step
    skipped for a non-finite update has a finite loss and norm). For metrics without it
    (another step's), the loss or the pre-clip global norm being NaN or inf.
    """
    if "skipped" in metrics:
        return bool(np.asarray(metrics["skipped"]))
    return not (math.isfinite(float(metrics["loss"]))
                and math.isfinite(float(metrics["grad_norm"])))
