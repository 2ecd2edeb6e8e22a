"""A functional train step: an explicit train state and one jitted step (`fit` runs it).

There is no ``zero_grad``: each step computes fresh gradients with ``jax.value_and_grad`` and
hands them to an optax optimizer, so nothing accumulates between steps unless you ask for it.
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from funcgrad import _user_line
from funcgrad._library_objects import check_optimizer, check_params
from funcgrad._paths import key_paths, keystr
from funcgrad._platform import require_dtype_compiles
from funcgrad._traced import naming_traced_values
from funcgrad.train._anomaly import (
    _detecting_anomalies,
    _detecting_anomalies_per_micro_batch,
    _explain_skipped_update,
)
from funcgrad.train._stages import (
    Update,
    chain,
    clip_stage,
    differentiate,
    finish,
    guard_stage,
    loss_scale_stage,
    monitor_stage,
    norm_stage,
    optimizer_stage,
    zero_nonfinite_stage,
)
from funcgrad.train.accumulate import make_accumulating_step
from funcgrad.train.loss import Loss, as_loss
from funcgrad.train.masks import (
    _AllOf,
    _leaf_flags,
    check_differentiable,
    freeze,
    frozen_masks,
    value_and_grad_trainable,
)
from funcgrad.train.monitor import GradMonitor, MonitorState
from funcgrad.train.precision import LossScale, LossScaleState, _floating_dtype, first_half_leaf

PyTree = Any
Batch = Mapping[str, Any]
LossFn = Callable[[PyTree, Batch], jax.Array]

#: Optimizer names accepted wherever an optimizer is asked for, and what they build.
OPTIMIZERS: dict[str, str] = {
    "sgd": "optax.sgd(learning_rate)",
    "momentum": "optax.sgd(learning_rate, momentum=momentum)  # v = momentum*v + g; p -= lr*v",
    "adam": "optax.adam(learning_rate)",
}


class TrainState(NamedTuple):
    """Everything that persists from one step to the next, as one pytree.

    Attributes:
      params: the model's parameter pytree.
      opt_state: the optax optimizer state for `params`.
      step: shape (), int32; number of step calls so far, skipped steps included (a skipped
        step leaves params and optimizer state, hence e.g. Adam's own count, unchanged).
      loss_scale: the `funcgrad.train.precision.LossScaleState` of a step that scales the loss
        (``init_train_state(..., loss_scale=...)``), else None.
      monitor: the `funcgrad.train.monitor.MonitorState` (gradient-norm baseline, vanishing
        streaks) of a step made with ``monitor=`` (``init_train_state(..., monitor=...)``),
        else None.
      model_state: the model's non-differentiated state (BatchNorm running statistics,
        counters), passed to a loss declared with ``has_state=True`` and replaced by the
        state it returns (`funcgrad.train.loss`); None without.
      key: the run's base PRNG key (``init_train_state(..., seed=)``); the step draws
        ``jax.random.fold_in(key, step)`` for a loss declared with ``takes_key=True``, so
        every step has a fresh key and a rerun or resume draws the same ones. None without.
    """
    params: PyTree
    opt_state: optax.OptState
    step: jax.Array
    loss_scale: LossScaleState | None = None
    monitor: MonitorState | None = None
    model_state: PyTree = None
    key: jax.Array | None = None


def make_optimizer(optimizer: str | optax.GradientTransformation, learning_rate: float = 1e-3,
                   *, momentum: float = 0.9) -> optax.GradientTransformation:
    """Returns an optax optimizer given by name (see `OPTIMIZERS`), or `optimizer` unchanged.

    Args:
      optimizer: "sgd", "momentum" (SGD with heavy-ball momentum), "adam", or an
        ``optax.GradientTransformation``, which is returned as is.
      learning_rate: step size, > 0 (units of params per unit of gradient for SGD), or an
        optax schedule ``count -> rate``. A schedule is wrapped in ``optax.inject_hyperparams``
        so that the optimizer state holds the rate of each update and the train step reports
        it as ``metrics["learning_rate"]``. It counts optimizer updates: with
        ``make_train_step(..., accumulate=K)`` one per K micro-batches (not per micro-batch or
        example), and a skipped (non-finite) update does not advance it.
      momentum: the momentum coefficient beta in [0, 1) for "momentum".
    Raises:
      ValueError: for an unknown name, a non-positive learning rate or a momentum outside [0, 1).
      TypeError: if `optimizer` is neither a name nor an optax transformation (an
        ``nnx.Optimizer`` is told to pass the optax transformation it wraps).
    """
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    check_optimizer("make_optimizer", optimizer)
    if isinstance(optimizer, optax.MultiSteps):
        raise TypeError(
            "optimizer is an optax.MultiSteps, which is not a GradientTransformation itself. "
            "For accumulation equal to the full-batch gradient use make_train_step(..., "
            "accumulate=K) with the inner optimizer; to keep MultiSteps' semantics pass "
            "multi_steps.gradient_transformation().")
    if not isinstance(optimizer, str):
        raise TypeError(
            f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or an optax "
            f"GradientTransformation such as optax.adam(1e-3), got {type(optimizer).__name__}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {list(OPTIMIZERS)} "
                         "or an optax GradientTransformation.")
    if not callable(learning_rate):  # an optax schedule is passed through
        # A number (a str or bool would pass float() here and fail later inside optax).
        number = (isinstance(learning_rate, (int, float, np.number))
                  or (isinstance(learning_rate, (np.ndarray, jax.Array))
                      and np.ndim(learning_rate) == 0
                      and jnp.issubdtype(jnp.result_type(learning_rate), jnp.floating)))
        lr = float(learning_rate) if number and not isinstance(learning_rate, bool) else math.nan
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"learning_rate must be a positive finite number or an optax "
                             f"schedule, got {learning_rate!r}"
                             + (" (a string: pass the number, e.g. 1e-3)."
                                if isinstance(learning_rate, str) else "."))
    # A schedule's current rate lives in the state (InjectStatefulHyperparamsState), where the
    # step reads it for metrics["learning_rate"]; a constant rate needs no state.
    build = optax.inject_hyperparams if callable(learning_rate) else (lambda factory: factory)
    if optimizer == "sgd":
        return build(optax.sgd)(learning_rate)
    if optimizer == "momentum":
        if (isinstance(momentum, (bool, str)) or not isinstance(momentum, (int, float, np.number))
                or not 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}.")
        return build(optax.sgd)(learning_rate, momentum=momentum)
    return build(optax.adam)(learning_rate)


def _check_kinds(monitor: Any, loss_scale: Any) -> None:
    """TypeError for a `monitor` or `loss_scale` of the wrong kind (True, an uncalled factory)."""
    if monitor is not None and not isinstance(monitor, GradMonitor):
        raise TypeError(f"monitor must be a GradMonitor, e.g. monitor=funcgrad.grad_monitor() "
                        f"(called), got {type(monitor).__name__}.")
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        raise TypeError(f"loss_scale must be a LossScale, e.g. "
                        f"loss_scale=funcgrad.dynamic_loss_scale() (called), got "
                        f"{type(loss_scale).__name__}.")


def init_train_state(params: PyTree, optimizer: str | optax.GradientTransformation, *,
                     trainable: PyTree | None = None, loss_scale: LossScale | None = None,
                     monitor: GradMonitor | None = None, model_state: PyTree = None,
                     seed: int | None = None, key: jax.Array | None = None) -> TrainState:
    """Returns the `TrainState` at step 0: `params`, ``optimizer.init(params)`` and step 0.

    `optimizer` is an optax transformation or a name for `make_optimizer` (default settings).
    With `trainable` (a mask from `funcgrad.train.masks.trainable_mask`) the optimizer is wrapped in
    ``funcgrad.train.masks.freeze(optimizer, trainable)``, as `make_train_step` does with the same
    mask: frozen leaves keep no optimizer state (an optimizer from ``funcgrad.freeze`` is
    already wrapped: give the step the same one). `loss_scale` (e.g.
    ``funcgrad.dynamic_loss_scale()``) adds its initial state; give `make_train_step` the same.
    `monitor` (``funcgrad.grad_monitor()``) adds the monitor's state (layers whose leaves are
    all frozen by `trainable` are not checked for vanishing); give `make_train_step` the same.
    `model_state` (a pytree of arrays: BatchNorm's running statistics) is the initial model
    state for a loss declared with ``has_state=True``; `seed` (an int) or `key` (a PRNG key,
    typed ``jax.random.key(0)`` or raw ``jax.random.PRNGKey(0)``) is the base key of a loss
    declared with ``takes_key=True`` (`funcgrad.train.loss`; step s draws ``fold_in(key, s)``).
    Raises TypeError for a `monitor` or `loss_scale` of the wrong kind (``monitor=True``), a
    `key` that is not a PRNG key or a `seed` that is not an int; ValueError if both `seed` and
    `key` are given. Raises TypeError for an ``nnx.Optimizer``, and for params that are an
    equinox module, an nnx Module, an nnx State with Variables other than ``nnx.Param``
    (BatchStat, RngCount...) or hold a non-array leaf: the message gives the split that fixes
    it (`funcgrad._library_objects`). Raises RuntimeError for float16 params where XLA cannot
    compile float16 (an x86 CPU without F16C: `funcgrad._platform`).
    """
    _check_kinds(monitor, loss_scale)
    check_optimizer("init_train_state", optimizer)
    check_params("init_train_state", params)  # equinox / nnx objects: the fix, not optax's error
    base_key = _base_key(seed, key)
    half = first_half_leaf(params)
    if half is not None:
        require_dtype_compiles(half[1], "init_train_state", f"params{half[0]}")
    if model_state is not None:
        _check_model_state(model_state)
    optimizer = make_optimizer(optimizer)
    if trainable is not None:
        optimizer = freeze(optimizer, trainable)
    mask = _trainable_of(optimizer)
    if mask is not None:  # the monitor skips layers frozen by trainable= or by fg.freeze
        mask = jax.tree.unflatten(jax.tree.structure(params),
                                  _leaf_flags(mask, params, "init_train_state"))
    return TrainState(params=params, opt_state=optimizer.init(params),
                      step=jnp.zeros((), jnp.int32),
                      loss_scale=None if loss_scale is None else loss_scale.init(),
                      monitor=None if monitor is None else monitor.init(params, trainable=mask),
                      model_state=model_state, key=base_key)


def _base_key(seed: Any, key: Any) -> jax.Array | None:
    """The state's base PRNG key from `seed` or `key` (at most one)."""
    if seed is not None and key is not None:
        raise ValueError("init_train_state: give seed= or key=, not both.")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"init_train_state: seed must be an int, got {seed!r}; or pass "
                            "key=jax.random.key(seed).")
        return jax.random.key(int(seed))
    if key is None:
        return None
    dtype = jnp.result_type(key)
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == jnp.uint32 and jnp.shape(key)[-1:] == (2,)
    if not (typed and jnp.shape(key) == ()) and not (raw and jnp.ndim(key) == 1):
        raise TypeError(f"init_train_state: key must be one PRNG key (jax.random.key(0), or "
                        f"a raw jax.random.PRNGKey(0)), got {dtype} of shape {jnp.shape(key)}.")
    return jnp.asarray(key)


def _check_model_state(model_state: PyTree) -> None:
    """TypeError naming a model-state leaf that is not an array (it is a jit and scan carry)."""
    for path, leaf in zip(key_paths(model_state), jax.tree.leaves(model_state)):
        if not hasattr(leaf, "dtype") and not isinstance(leaf, (int, float, bool)):
            raise TypeError(f"init_train_state: model_state{keystr(path)} is a "
                            f"{type(leaf).__name__}; the model state must be a pytree of "
                            "arrays (keep functions and settings out of it, in the loss).")


def _trainable_of(optimizer: optax.GradientTransformation) -> PyTree | None:
    """The trainable mask of an optimizer wrapped by `funcgrad.train.masks.freeze` (all its masks
    together when nested), or None."""
    masks = frozen_masks(optimizer)
    return None if not masks else masks[0] if len(masks) == 1 else _AllOf(masks)


#: What a train step does when the loss or the global gradient norm is NaN or inf.
NONFINITE_POLICIES = ("skip", "zero", "raise")


def make_train_step(loss_fn: LossFn | Loss, optimizer: optax.GradientTransformation, *,
                    has_aux: bool = False, has_state: bool = False, takes_key: bool = False,
                    clip_norm: float | None = None, nonfinite: str = "skip",
                    trainable: PyTree | None = None, compute_dtype: Any = None,
                    loss_scale: LossScale | None = None, accumulate: int | None = None,
                    tail: str = "apply", jit: bool = True, detect_anomaly: bool = False,
                    monitor: GradMonitor | None = None, mesh: Any = None,
                    data_axis: str = "data", shard_opt_state: bool = False
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """Returns one training step ``(state, batch) -> (state, metrics)``, jitted.

    The step computes ``loss, grads = value_and_grad(loss_fn)(state.params, batch)``, the global
    norm ``||grads||_2`` over all leaves (`funcgrad.train.clipping.global_norm`, equal to
    ``optax.tree.norm`` up to rounding but one fused reduction), clips the gradients to
    `clip_norm` by global norm if asked (`funcgrad.train.clipping.clip_by_global_norm`: optax's
    clipping, which keeps their direction, plus the coefficient it applied), and applies the
    optimizer's update.

    A non-finite step never reaches the parameters. With ``nonfinite="skip"`` (the default) a
    step whose loss or gradient norm is NaN/inf, or whose update would make a trained leaf
    NaN/inf, leaves params and optimizer state exactly as they were (``state.step`` still
    counts the call) and reports ``metrics["skipped"] = 1``. The last case catches what the
    optimizer makes from a finite gradient: float16 params with Adam, whose eps=1e-8 is 0 in
    float16 (0/0 where a gradient is 0), or an update that overflows a param. After such a
    skip ``step.explain_skipped_update(state, batch)`` names the leaves and the fix (`fit`
    puts it in its report). The guard tests one fused sum over the new values of the trained
    leaves (`funcgrad.train.clipping.all_finite`) and is a ``jnp.where`` per leaf, no host round
    trip; ``benchmarks/train_step.py`` measures it ("guard cost"; a ``lax.cond`` measured
    1.8x and is not used).
    ``nonfinite="zero"`` instead zeroes the gradient leaves that hold a NaN/inf and applies the
    rest (a non-finite loss is still skipped); ``nonfinite="raise"`` skips like "skip" and
    marks the step so that `fit` raises ``FloatingPointError`` instead of stopping quietly (a
    jitted step cannot raise without a host round-trip).

    float16/bfloat16 params without `compute_dtype` train in that dtype (PyTorch's
    ``model.half()``): the step warns once per trace (``RuntimeWarning``) that updates below
    the params' spacing round away, and points to float32 params with `compute_dtype`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, a pure function; or a loss with model
        state, a PRNG key and aux outputs under the contract of `funcgrad.train.loss` (declared by
        the next three flags, or a `funcgrad.Loss` that carries them).
      has_aux: the loss returns ``(loss, aux)``; the aux pytree is returned as
        ``metrics["aux"]`` (with `accumulate`: one entry per micro-batch, stacked).
      has_state: the loss takes ``model_state=`` and returns ``(loss, new_model_state)``
        (``(loss, (new_model_state, aux))`` with `has_aux`); the state comes from and goes
        to ``TrainState.model_state`` (``init_train_state(..., model_state=)``). A skipped
        step leaves it unchanged; a new model state with NaN/inf skips the step. With
        `accumulate` it threads through the micro-batches in order.
      takes_key: the loss takes ``key=``, a fresh PRNG key per step:
        ``fold_in(state.key, state.step)`` (``init_train_state(..., seed=)``); with
        `accumulate`, micro-batch j of an update gets ``fold_in(that key, j)``.
      optimizer: an optax optimizer (see `make_optimizer` for names); the state passed to the
        step must come from ``init_train_state(params, optimizer)``.
      clip_norm: if given (> 0), the maximum global norm of the gradients used for the update:
        the norm is taken over the trained leaves (frozen by `trainable` or by an optimizer
        from `funcgrad.train.masks.freeze` is left out). A freeze the step cannot see, inside
        ``optax.chain`` or a hand-made ``optax.partition``/``optax.masked``, leaves the frozen
        leaves' gradients in the norm, so a large one shrinks every applied update.
      nonfinite: "skip", "zero" or "raise" (see above).
      trainable: a mask from `funcgrad.train.masks.trainable_mask` (PyTorch's ``requires_grad``).
        Frozen leaves are not differentiated at all (their gradient is exactly 0 and is left
        out of "grad_norm", the clipping and the guard) and get exactly zero updates (the
        optimizer is wrapped in ``freeze(optimizer, trainable)``); create the state with
        ``init_train_state(params, optimizer, trainable=trainable)``. An `optimizer` made by
        ``funcgrad.freeze(optimizer, mask)`` acts the same way (with both, a leaf trains
        only if both masks say so). Integer and bool leaves (a step counter, an index table)
        have no gradient and must be frozen: they are then carried unchanged. They are not
        frozen silently, because an integer weight is more often a mistake
        (``jnp.array(0)`` for a bias) than a counter, and it would never train.
      compute_dtype: if given (jnp.float16, jnp.bfloat16), the forward and backward pass run in
        it over the float32 params (`funcgrad.train.precision.scaled_value_and_grad`); gradients,
        norm, clipping and update stay float32.
      loss_scale: if given (``funcgrad.dynamic_loss_scale()``), the loss is multiplied by
        ``state.loss_scale.scale`` and the gradients divided by it in float32 *before* the norm
        and the clipping; a non-finite step is skipped as above and backs the scale off
        (metrics gain "loss_scale", the scale used, and "skipped_total"). Needs
        ``nonfinite="skip"`` or ``"raise"`` and ``init_train_state(..., loss_scale=loss_scale)``.
      accumulate: K, to accumulate gradients over micro-batches (`funcgrad.train.accumulate`): the
        step becomes ``step(state, microbatches, mask=None)`` with `microbatches` a pytree
        whose leaves have shape ``(M, m, ...)`` (M micro-batches of m examples, padded; `mask`
        bool ``(M, m)`` marks the real ones), or one `funcgrad.train.accumulate.Microbatches` that
        carries both (``step(state, mbs)``; `funcgrad.train.accumulate.group_microbatches` builds
        them), and `loss_fn` must return one loss per example, shape ``(m,)``. Each group of
        K micro-batches gives one update with the mean gradient over its examples (the
        norm, clipping, guard and optimizer run once per update, inside one ``lax.scan``);
        the metrics gain a leading axis of length U (updates in the call) plus
        ``"examples": (U,)`` and ``"dropped_examples": ()``. A learning-rate schedule counts
        updates, one per K micro-batches (see "learning_rate" below). The mean is the
        full-batch gradient only if each example's loss depends on that example alone: a
        loss coupled through the micro-batch (BatchNorm in training mode, centring on the
        batch mean) warns at the first call (`funcgrad.train.coupling.CoupledExamplesWarning`).
        With `compute_dtype` and/or `loss_scale` every micro-batch of an update runs in the
        compute dtype at that update's scale and is unscaled in float32 before it is summed;
        an overflow in any micro-batch skips the whole update and backs the scale off once
        (PyTorch: one ``GradScaler.update()`` per optimizer step). Each micro-batch's pass
        sees the cotangents of its mean loss, as a step without accumulation does, so the
        compute dtype overflows no sooner and a dynamic scale settles at the same level.
      tail: with `accumulate`, what a final group of fewer than K micro-batches does:
        "apply" (one more update over its examples, the default) or "drop" (counted in
        "dropped_examples").
      jit: if False the step is returned un-jitted (for debugging with prints).
      detect_anomaly: PyTorch's ``detect_anomaly`` for this step. After a step whose loss or
        gradient norm is NaN/inf, `funcgrad.debug.anomaly.find_nonfinite` runs (eagerly) on that
        step's params and batch and its `AnomalyReport` is added as ``metrics["anomaly"]``;
        `fit` puts it in its `NonFiniteReport`. With `accumulate` it runs on each micro-batch
        of the first non-finite update, from the params that update started from, and reports
        the first micro-batch that is not finite (named in the report's context). With
        `compute_dtype` and `loss_scale` the location evaluates the loss as the step does (in
        that dtype, times the scale); under a loss scale a step whose loss is finite is a
        routine overflow (skipped, the scale backs off) and is not located. It costs one host
        read of the loss and norm per step; with the default False the step is the plain
        jitted function and pays nothing.
      monitor: a `funcgrad.train.monitor.GradMonitor` (``funcgrad.grad_monitor()``): every update
        also computes per-leaf norm, mean and std, per-layer norms, the dead-ReLU fraction of
        each ReLU in `loss_fn` (found in its jaxpr, no model change; on the float32 path
        without `accumulate`), a baseline and the vanishing streaks, all inside the jitted
        step, as ``metrics["monitor"]`` (a `MonitorMetrics`, whose explosion / nonfinite /
        vanishing flags are read from those values; `fit` prints its alerts). "grad_norm"
        then comes from the monitor's fused sums (the same global norm). The step's packed
        monitor values are returned once, in the new state, and a thin Python wrapper around
        the jitted function (``step.__wrapped__``) hands them to ``metrics["monitor"]``.
        Adds 9-17% to a batch-32 CPU step of a small MLP, 3-6% at batch 256
        (``benchmarks/monitor.py``). Create the state with
        ``init_train_state(..., monitor=monitor)``.
      mesh: a ``jax.sharding.Mesh`` (``funcgrad.data_mesh()``) for data parallelism
        (`funcgrad.parallel.step`): the step is jitted with the state replicated over the mesh
        and the batch's rows (axis 0; axis 1 of stacked micro-batches) split over its
        `data_axis`, in one process or across processes (``jax.distributed``). The loss is
        written on the global batch as before; XLA inserts the gradient all-reduce, and the
        numbers are the one-device step's on the same global batch. With `accumulate`, each
        device accumulates its own rows and the sums are all-reduced once per update
        (`funcgrad.train.accumulate.make_accumulating_step`: a coupled loss such as BatchNorm
        then sees each device's rows, the model state is averaged over the devices, a
        loss's key is folded with the device index). Rows must divide among the axis's
        devices (pad and mask otherwise: the error says how). Not with ``jit=False`` or
        `detect_anomaly`.
      data_axis: the mesh axis the batch is split over (default "data").
      shard_opt_state: with `mesh`, shard the optimizer state over `data_axis` ZeRO-1 style
        (`funcgrad.parallel.zero`): each optimizer-state leaf split along its first axis
        that divides among the devices, the params replicated; each device keeps 1/N of
        Adam's moments, and the step gathers the updated params (an all-gather of the update
        besides the gradient reduce). The numbers are the replicated step's. Place the state
        with ``step.place_state(state)`` (``step.state_shardings(state)`` says where each
        leaf goes); `fit` does it itself.
    Returns:
      ``step(state, batch) -> (state, metrics)``; metrics are device arrays:
      ``{"loss": (), "grad_norm": ()}``, plus ``"clip_coef": ()`` with `clip_norm`, and
      ``"skipped": () int32`` (1 when the update was not applied), and with
      ``nonfinite="zero"`` ``"nonfinite_leaves": () int32``, with a `loss_scale`
      "loss_scale" and "skipped_total" (the steps whose scaled gradients overflowed, each of
      which backed the scale off; a skip for a non-finite update leaves the scale alone).
      "grad_norm" is the pre-clip global norm in the gradients' units (with ``nonfinite="zero"``, of
      the gradient after its non-finite leaves were zeroed: the norm of what the update used;
      "nonfinite_leaves" counts the zeroed leaves, and a monitor still sees the raw gradient and
      raises its nonfinite alert). `step_was_skipped` reads "skipped". With a learning-rate schedule
      that the optimizer state holds (`make_optimizer` with a schedule, or
      ``optax.inject_hyperparams``), metrics gain ``"learning_rate": ()``, the rate of this update
      (`applied_learning_rate`). A schedule passed straight into an optax optimizer
      (``optax.sgd(optax.linear_schedule(...))``, ``optax.adam(schedule)``) is applied but kept
      nowhere the step can read (only its count, an ``optax.ScaleByScheduleState``): the metrics
      then have no "learning_rate", and the first call says so once (a ``UserWarning`` at your
      line naming ``optax.inject_hyperparams``); wrap it as
      ``optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)`` or use
      ``make_optimizer("sgd", schedule)`` to have the rate reported. A constant rate has nothing
      to report and is not warned about. The step has attributes ``nonfinite`` (the policy),
      ``accumulate``, ``explain_skipped_update`` (see above), ``unjitted``, the same step
      before ``jax.jit`` (None with ``jit=False``), which `fit` runs many steps at a time, and
      ``unguarded``, that step without the guard's selects (it still reports "skipped"; None
      with a loss scale), which `fit` runs first and re-runs guarded when a step was skipped.
    Raises:
      TypeError: if `mesh` is not a ``jax.sharding.Mesh``;
        if `monitor` is not a `GradMonitor` or `loss_scale` not a `LossScale` (e.g.
        ``monitor=True`` or the uncalled ``funcgrad.grad_monitor``); at the first call, if a
        trained leaf of the params is not floating point (the message names its path, e.g.
        ``params['count']``, and how to freeze it), or `funcgrad.TracedValueError` naming
        loss_fn's line when it uses a traced value as a Python value (``if loss > 0:``), with
        the fix (``jnp.where`` / ``lax.cond``).
      ValueError: if `shard_opt_state` is given without `mesh`; if `mesh` has no axis
        `data_axis` (or it is Explicit, or it leaves a process out), or comes with
        ``jit=False`` or `detect_anomaly`; at the first call, if a batch's
        rows do not divide among the devices;
        if `clip_norm` is not positive or `nonfinite` is not a known policy, or if
        `loss_scale` comes with ``nonfinite="zero"``; at the first call, if the loss is not a
        scalar (with `accumulate`: not one loss per example) or the optimizer state does not
        match `optimizer` and the params.
      RuntimeError: if `compute_dtype` is float16 and XLA on this machine cannot compile
        float16 (an x86 CPU without F16C: `funcgrad._platform`); the message points to bfloat16.
    """
    check_optimizer("make_train_step", optimizer)
    loss = as_loss(loss_fn, has_aux=has_aux, has_state=has_state, takes_key=takes_key)
    optimizer = make_optimizer(optimizer)
    if clip_norm is not None and not (isinstance(clip_norm, (int, float, np.number))
                                      and math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be a positive number or None, got {clip_norm!r}.")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    _check_kinds(monitor, loss_scale)
    if mesh is not None:
        _check_parallel(mesh, data_axis, jit, detect_anomaly)
    elif shard_opt_state:
        raise ValueError("make_train_step: shard_opt_state=True shards the optimizer state over "
                         "a mesh's data axis; pass mesh= too (e.g. mesh=fg.data_mesh()).")
    if compute_dtype is not None:
        compute_dtype = _floating_dtype(compute_dtype, "make_train_step")
        require_dtype_compiles(compute_dtype, "make_train_step", "compute_dtype")
    if loss_scale is not None and nonfinite == "zero":
        raise ValueError("loss_scale needs nonfinite='skip' (or 'raise'): a step whose scaled "
                         "gradients overflowed must be skipped whole, not applied with its "
                         "non-finite leaves zeroed.")
    # The user's function, named in errors about traced values used as Python values.
    traced_named = naming_traced_values(loss.fn, "the train step", ("params", "batch"), (0,))
    loss = Loss(traced_named, has_aux=loss.has_aux, has_state=loss.has_state,
                takes_key=loss.takes_key)
    if trainable is not None:
        optimizer = freeze(optimizer, trainable)
    # trainable= and an optimizer from fg.freeze are one thing: the frozen leaves are not
    # differentiated, so the norm, the clipping, the guard and the monitor see only the
    # gradient that is applied (frozen leaves add exact zeros and are left out of them).
    trainable = _trainable_of(optimizer)
    value_and_grad = (functools.partial(value_and_grad_trainable, mask=trainable)
                      if trainable is not None else _value_and_grad_checked)
    # Dead ReLUs come from interpreting the loss's jaxpr; the mixed-precision and accumulating
    # paths differentiate their own wrappers of it, so there the monitor has norms only.
    dead_relu = (monitor is not None and monitor.dead_relu and compute_dtype is None
                 and loss_scale is None and accumulate is None)
    grads_of = differentiate(loss, value_and_grad=value_and_grad, compute_dtype=compute_dtype,
                             scaled=loss_scale is not None, dead_relu=dead_relu)

    gather_updates = None
    if shard_opt_state and mesh is not None:  # ZeRO-1: one all-gather of the sharded update
        from funcgrad.parallel.zero import replicated_constraint
        gather_updates = replicated_constraint(mesh)

    def apply_update(state: TrainState, loss_value: jax.Array, grads: PyTree, *,
                     model_state: PyTree = None, aux: PyTree = None, dead: Any = None,
                     locate: bool = False, optimistic: bool = False
                     ) -> tuple[TrainState, dict]:
        """The stages after differentiation, once per update (funcgrad.train._stages)."""
        flags = ([True] * len(jax.tree.leaves(state.params)) if trainable is None
                 else _leaf_flags(trainable, state.params, "make_train_step"))
        if gather_updates is not None:  # ZeRO-1: the reduced gradient stays whole (the norm,
            grads = gather_updates(grads)  # clipping, the guard), each device slicing its part
        update = Update(state=state, loss=loss_value, grads=grads, model_state=model_state,
                        aux=aux, dead=dead, flags=flags)
        chain(
            monitor_stage(monitor, stacked=accumulate is not None) if monitor else None,
            zero_nonfinite_stage if nonfinite == "zero" else None,
            norm_stage,
            clip_stage(clip_norm) if clip_norm is not None else None,
            optimizer_stage(optimizer, applied_learning_rate, gather_updates),
            guard_stage(zero=nonfinite == "zero", locate=locate, optimistic=optimistic),
            loss_scale_stage(loss_scale) if loss_scale is not None else None,
        )(update)
        # Under accumulation the aux is per micro-batch (make_accumulating_step adds it).
        return finish(update, has_aux=loss.has_aux and accumulate is None)

    said_unreported: list[bool] = []  # the unreadable-schedule warning, once per step

    def entry_checks(state: TrainState) -> None:
        _check_state(state, optimizer, loss_scale, monitor, loss)
        if compute_dtype is None:
            _warn_half_params(state.params)
        if not said_unreported:
            said_unreported.append(True)
            _warn_unreported_schedule(state.opt_state)

    def build_accumulating(apply: Callable, accumulate: int) -> Callable:
        """`build`'s step under accumulation: one update per group of micro-batches."""
        accumulating = make_accumulating_step(
            loss, apply, accumulate=accumulate, tail=tail, value_and_grad=value_and_grad,
            compute_dtype=compute_dtype,
            loss_scale_of=None if loss_scale is None else lambda s: s.loss_scale.scale,
            jit=False, mesh=mesh, data_axis=data_axis)

        def step(state: TrainState, microbatches: PyTree, mask: jax.Array | None = None):
            entry_checks(state)
            _check_stacked(microbatches, mask, accumulate)
            return accumulating(state, microbatches, mask)
        return step

    def build(apply: Callable) -> Callable:
        """The step (unjitted) around `apply_update` or a variant of it."""
        if accumulate is not None:
            return build_accumulating(apply, accumulate)

        def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
            entry_checks(state)
            # entry_checks: a state with a key when the loss takes one, a loss scale state
            # when the step scales the loss.
            key = (jax.random.fold_in(cast(jax.Array, state.key), state.step) if loss.takes_key
                   else None)
            scale = (None if compute_dtype is None and loss_scale is None
                     else jnp.ones((), jnp.float32) if loss_scale is None
                     else cast(LossScaleState, state.loss_scale).scale)
            loss_value, grads, model_state, aux, dead = grads_of(
                state.params, batch, state.model_state if loss.has_state else None, key, scale)
            return apply(state, loss_value, grads, model_state=model_state, aux=aux, dead=dead)
        return step

    step = build(apply_update)
    out: Any = step if not jit else jax.jit(step)  # a function with the attributes set below
    if mesh is not None:  # the same step jitted with the state replicated, the rows split
        from funcgrad.parallel.step import data_parallel_jit

        out = data_parallel_jit(step, mesh, data_axis, accumulate, shard_opt_state)
    if monitor is not None and accumulate is None:
        out = _attach_monitor(out)
    if detect_anomaly:
        out = (_detecting_anomalies(out, loss, trainable, compute_dtype) if accumulate is None
               else _detecting_anomalies_per_micro_batch(out, loss, trainable, accumulate,
                                                         compute_dtype))
    # The step with per-leaf finiteness of updates, jitted at the first skip.
    located: list[Callable] = []

    def explain_skipped_update(state: TrainState, *args) -> str:
        """Which leaves' updates or new values were NaN/inf in the step ``out(state, *args)``
        and how to fix it; "" if none were. Runs that step again (on the host's call)."""
        if not located:
            located.append(jax.jit(build(functools.partial(apply_update, locate=True))))
        with warnings.catch_warnings():  # the step's own trace already warned about these
            warnings.simplefilter("ignore", RuntimeWarning)
            metrics = located[0](state, *args)[1]
        return _explain_skipped_update(state, metrics)

    out.explain_skipped_update = explain_skipped_update
    # fit runs it in chunks (funcgrad.train.loop._chunks), a mesh's step too (the chunk splits
    # each batch's rows over the mesh's data axis).
    out.unjitted = step if jit else None
    # The same without the guard's selects, for fit's re-checked chunks; not with a loss scale
    # (its routine overflows would each send a chunk back to be re-run).
    out.unguarded = (build(functools.partial(apply_update, optimistic=True))
                     if jit and loss_scale is None else None)
    out.detect_anomaly = detect_anomaly
    out.nonfinite = nonfinite
    out.accumulate = accumulate
    out.tail = tail if accumulate is not None else None
    out.loss = loss
    out.mesh = mesh
    out.data_axis = data_axis if mesh is not None else None
    out.shard_opt_state = bool(shard_opt_state and mesh is not None)
    return out


def _check_parallel(mesh: Any, data_axis: str, jit: bool, detect_anomaly: bool) -> None:
    """make_train_step's checks of `mesh` (`funcgrad.parallel.placement.check_mesh`)."""
    from funcgrad.parallel.placement import check_mesh

    check_mesh(mesh, data_axis, "make_train_step")
    if not jit:
        raise ValueError("make_train_step: mesh= shards the jitted step; with jit=False there "
                         "is nothing to shard. Debug with the one-device step (no mesh).")
    if detect_anomaly:
        raise ValueError("make_train_step: detect_anomaly is not supported with mesh= yet: it "
                         "re-runs the loss eagerly on the host's copy of the batch. Locate a "
                         "NaN with the one-device step on the same global batch.")


def applied_learning_rate(opt_state: optax.OptState) -> jax.Array | None:
    """The learning rate of the update that produced `opt_state`, when the state holds one.

    It does when the optimizer was built with ``optax.inject_hyperparams`` (as `make_optimizer`
    builds a scheduled one): the state's ``hyperparams["learning_rate"]`` is the rate its
    last update used. Returns that array (shape (), the params' float dtype), or None when no
    such state or more than one is found: a rate passed as a schedule straight into an optax
    optimizer (``optax.adam(schedule)``) is computed inside its update and kept nowhere; build
    it as ``optax.inject_hyperparams(optax.adam)(learning_rate=schedule)`` to have it reported.
    """
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    found = [s.hyperparams["learning_rate"]
             for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kinds))
             if isinstance(s, kinds) and "learning_rate" in s.hyperparams]
    return found[0] if len(found) == 1 else None


def _unreported_schedule(opt_state: optax.OptState) -> str | None:
    """Where `opt_state` counts a learning-rate schedule that `applied_learning_rate` cannot read
    (e.g. ``"opt_state[1]"``, an ``optax.ScaleByScheduleState``), or None.

    ``optax.sgd(schedule)`` and ``optax.adam(schedule)`` keep only the schedule's count (in
    ``optax.scale_by_schedule``'s state); the rate is computed inside the update. None when the
    state holds no such count (a constant rate) or holds a rate the step reports
    (``optax.inject_hyperparams``, `make_optimizer` with a schedule).
    """
    kind = optax.ScaleByScheduleState
    if applied_learning_rate(opt_state) is not None:
        return None
    found = [path for path, node in jax.tree_util.tree_flatten_with_path(
                 opt_state, is_leaf=lambda s: isinstance(s, kind))[0] if isinstance(node, kind)]
    return "opt_state" + keystr(found[0]) if found else None


def _warn_unreported_schedule(opt_state: optax.OptState) -> None:
    """The step's once-per-step warning that it cannot report the rate it applies (see
    `_unreported_schedule`), at the user's line."""
    where = _unreported_schedule(opt_state)
    if where is None:
        return
    _user_line.warn(
        "make_train_step: the optimizer applies a learning-rate schedule that the step cannot "
        f"read (only its count is kept, {where}, an optax.ScaleByScheduleState: a schedule "
        "passed straight into optax, as in optax.sgd(optax.linear_schedule(...))), so the "
        'metrics have no "learning_rate" and fit records none. Training is unaffected. To '
        "have the rate of each update reported, wrap the optimizer in optax.inject_hyperparams: "
        "optax.inject_hyperparams(optax.sgd)(learning_rate=schedule) (likewise optax.adam, "
        "...), or use funcgrad.make_optimizer('sgd', schedule).", UserWarning)


def _attach_monitor(step: Callable) -> Callable:
    """`step`, with metrics["monitor"] completed with the new state's monitor values."""
    def stepped(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        new_state, metrics = step(state, batch)
        metrics["monitor"].values = new_state.monitor.values  # a fresh object every call
        return new_state, metrics

    return functools.wraps(step)(stepped)


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


def _value_and_grad_checked(fn: Callable, **kwargs) -> Callable:
    """``jax.value_and_grad(fn, **kwargs)`` that first names a params leaf with no gradient
    (an integer or bool leaf: JAX's own error names none) and says how to fix it."""
    value_and_grad = jax.value_and_grad(fn, **kwargs)

    def checked(params, *args):
        check_differentiable(params, "make_train_step")
        return value_and_grad(params, *args)

    return checked


def _floating(grads: PyTree) -> PyTree:
    """`grads` with the zeros of frozen integer/bool leaves as float32 zeros (for the monitor,
    which takes norms and means of every leaf)."""
    return jax.tree.map(lambda g: g if jnp.issubdtype(jnp.result_type(g), jnp.inexact)
                        else jnp.zeros(jnp.shape(g), jnp.float32), grads)


def _warn_half_params(params: PyTree) -> None:
    """A warning (once per trace) for float16/bfloat16 params trained without compute_dtype:
    PyTorch's ``model.half()`` habit, where updates below the params' spacing round away."""
    half = first_half_leaf(params)
    if half is not None:
        path, dtype = half
        warnings.warn(
            f"params{path} is {dtype}, and the step updates it in {dtype}: an update smaller "
            f"than {float(jnp.finfo(dtype).eps) / 2:.3g} of a weight rounds away. For mixed "
            f"precision keep float32 params and pass compute_dtype=jnp.{dtype} (with "
            "loss_scale= for float16).", RuntimeWarning, stacklevel=4)


def _check_state(state: TrainState, optimizer: optax.GradientTransformation,
                 loss_scale: LossScale | None = None, monitor: GradMonitor | None = None,
                 loss: Loss | None = None) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"the step takes a TrainState (from init_train_state), got "
                        f"{type(state).__name__}.")
    if loss is not None:
        if loss.has_state and state.model_state is None:
            raise ValueError(f"the loss is declared with model state ({loss!r}) but the "
                             "TrainState has none. Create it with init_train_state(params, "
                             "optimizer, model_state=...).")
        if not loss.has_state and state.model_state is not None:
            raise ValueError("the TrainState has a model state but the loss is not declared "
                             "with has_state=True: the state would never update (BatchNorm "
                             "statistics frozen at their init). Pass has_state=True to "
                             "make_train_step and have the loss take model_state= and return "
                             "(loss, new_model_state).")
        if loss.takes_key and state.key is None:
            raise ValueError(f"the loss takes a PRNG key ({loss!r}) but the TrainState has "
                             "none. Create it with init_train_state(params, optimizer, "
                             "seed=0) (or key=jax.random.key(0)).")
    if loss_scale is not None and state.loss_scale is None:
        raise ValueError("this step scales the loss but the TrainState has no loss-scale state. "
                         "Create it with init_train_state(params, optimizer, "
                         "loss_scale=loss_scale), the loss_scale given to make_train_step.")
    if monitor is not None and state.monitor is None:
        raise ValueError("this step has a gradient monitor but the TrainState has no monitor "
                         "state. Create it with init_train_state(params, optimizer, "
                         "monitor=monitor), the monitor given to make_train_step.")
    # The other way round the step would carry the state along unchanged: a monitor that
    # never updates, a loss scale that never moves. Almost surely two different steps mixed.
    if loss_scale is None and state.loss_scale is not None:
        raise ValueError("the TrainState has a loss-scale state but this step scales no loss: "
                         "it would never update. Pass the same loss_scale to make_train_step "
                         "as to init_train_state, or create the state without one.")
    if monitor is None and state.monitor is not None:
        raise ValueError("the TrainState has a gradient-monitor state but this step has no "
                         "monitor: it would never update. Pass the same monitor to "
                         "make_train_step as to init_train_state, or create the state without "
                         "one.")
    shapes = lambda tree: jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), tree)
    expected = jax.eval_shape(optimizer.init, state.params)
    got = state.opt_state
    if jax.tree.structure(expected) != jax.tree.structure(got) or shapes(expected) != shapes(got):
        frozen = lambda tree: "MaskedNode" in repr(jax.tree.structure(tree))
        cause = ("The step freezes leaves (trainable= or funcgrad.freeze) but the state was "
                 "created without the same mask: pass the same trainable= to "
                 "init_train_state. " if frozen(expected) and not frozen(got) else
                 "The state was created with a trainable= mask (or funcgrad.freeze) that "
                 "this step does not have: pass the same trainable= to make_train_step. "
                 if frozen(got) and not frozen(expected) else "")
        short = lambda tree: (text if len(text := str(jax.tree.structure(tree))) <= 300
                              else text[:300] + " ...")
        raise ValueError(
            "the optimizer state in the TrainState was not made by this optimizer for these "
            f"params (structure or leaf shapes differ). {cause}\n  expected: {short(expected)}"
            f"\n  got: {short(got)}\nCreate the state with init_train_state(params, "
            "optimizer) using the same optimizer (and the same trainable= mask, if the step "
            "has one).")


def _check_stacked(microbatches: PyTree, mask: Any, k: int) -> None:
    """The accumulation shape error, saying first that this step takes stacked micro-batches
    (a plain batch passed to an ``accumulate=K`` step is the usual cause)."""
    from funcgrad.train.accumulate import _leading_axes, _unpacked

    try:
        _leading_axes(_unpacked(microbatches, mask)[0])
    except ValueError as error:
        raise ValueError(
            f"this step was made with accumulate={k}: it takes micro-batches stacked along a "
            "leading axis, (num_micro_batches, micro_batch_size, ...), e.g. "
            "fg.stack_microbatches([mb0, mb1, ...]) or fg.group_microbatches(...), not one "
            f"batch (fit stacks them for you). {error}") from None
