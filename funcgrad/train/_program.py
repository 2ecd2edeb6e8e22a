"""How a `TrainStep`'s fields become its programs: the step (jitted, or placed by its data-parallel
wrapper), the unjitted and unguarded variants `funcgrad.fit` runs, and the explanation of a
skipped update."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from funcgrad._traced import naming_traced_values
from funcgrad.train._anomaly import (
    _detecting_anomalies,
    _detecting_anomalies_per_micro_batch,
    _explain_skipped_update,
)
from funcgrad.train._stages import (
    Update,
    chain,
    differentiate,
    finish,
    guard_stage,
    loss_scale_stage,
    norm_stage,
    optimizer_stage,
)
from funcgrad.train.accumulate import make_accumulating_step
from funcgrad.train.loss import Loss
from funcgrad.train.masks import _leaf_flags, check_differentiable, value_and_grad_trainable
from funcgrad.train.optimizers import applied_learning_rate, warn_unreported_schedule
from funcgrad.train.precision import LossScaleState, first_half_leaf
from funcgrad.train.state import TrainState, _check_state
from funcgrad.train.transforms import (
    MonitorState,
    check_records,
    recorded,
    records,
    records_of_optimizer,
)

if TYPE_CHECKING:
    from funcgrad.train.step import TrainStep

PyTree = Any
Batch = Any


class _Built(NamedTuple):
    """What `_build` makes of a `TrainStep`'s fields."""
    call: Callable
    unjitted: Callable | None
    unguarded: Callable | None
    explain: Callable
    lowered: Callable | None = None  # the jitted step itself, for TrainStep.lower


def _build(spec: TrainStep) -> _Built:
    """The programs of `spec`: the step (jitted unless ``spec.jit`` is False), the unjitted
    and unguarded variants `fit` runs, and the explanation of a skipped update."""
    loss, optimizer, trainable = spec.loss, spec.optimizer, spec.trainable
    compute_dtype, loss_scale = spec.compute_dtype, spec.loss_scale
    accumulate = spec.accumulate
    # Extra arguments reach the chain's transformations (the loss as optax's ``value``).
    optimizer = optax.with_extra_args_support(optimizer)
    mesh, data_axis = spec.mesh, spec.data_axis or "data"
    # The user's function, named in errors about traced values used as Python values.
    traced_named = naming_traced_values(loss.fn, "the train step", ("params", "batch"), (0,))
    plain = Loss(traced_named, has_aux=loss.has_aux, has_state=loss.has_state,
                 takes_key=loss.takes_key)
    value_and_grad = (functools.partial(value_and_grad_trainable, mask=trainable)
                      if trainable is not None else _value_and_grad_checked)
    # Dead ReLUs come from interpreting the loss's jaxpr; the accumulating path differentiates
    # its own wrapper of it per micro-batch, so there the monitor has norms only and says so.
    monitor_note = ("" if accumulate is None else
                    "dead ReLUs are not measured under funcgrad.accumulate (each micro-batch "
                    "is differentiated in its own scan step); train without it to see them")
    grads_of = differentiate(plain, value_and_grad=value_and_grad, compute_dtype=compute_dtype,
                             scaled=loss_scale is not None)
    gather_updates = spec.parallel.gather_updates() if spec.parallel is not None else None

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
            optimizer_stage(optimizer, applied_learning_rate, gather_updates, monitor_note),
            norm_stage,
            guard_stage(locate=locate, optimistic=optimistic),
            loss_scale_stage(loss_scale) if loss_scale is not None else None,
        )(update)
        if update.monitor is not None and accumulate is None:  # its values leave the step
            update.monitor = update.monitor._detached()  # once, in the new state
        # Under accumulation the aux is per micro-batch (make_accumulating_step adds it).
        return finish(update, has_aux=loss.has_aux and accumulate is None)

    said_unreported: list[bool] = []  # the unreadable-schedule warning, once per step

    def entry_checks(state: TrainState) -> None:
        _check_state(state, optimizer, loss_scale, loss)
        check_records(records(state.opt_state), loss_scale)
        if compute_dtype is None:
            _warn_half_params(state.params)
        if not said_unreported:
            said_unreported.append(True)
            warn_unreported_schedule(state.opt_state)

    def build_accumulating(apply: Callable, accumulate: int) -> Callable:
        """`build`'s step under accumulation: one update per group of micro-batches."""
        accumulating = make_accumulating_step(
            plain, apply, accumulate=accumulate, tail=spec.tail or "apply",
            value_and_grad=value_and_grad, compute_dtype=compute_dtype,
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
                state.params, batch, state.model_state if loss.has_state else None, key, scale,
                dead_relu=_wants_dead_relu(state.opt_state))
            return apply(state, loss_value, grads, model_state=model_state, aux=aux, dead=dead)
        return step

    step = build(apply_update)
    out: Any = step if not spec.jit else jax.jit(step)
    if spec.parallel is not None:  # the same step jitted with the state replicated, the rows
        out = spec.parallel.jit(step, accumulate)  # split (funcgrad.data_parallel)
    jitted = out
    if accumulate is None and _may_monitor(optimizer):
        out = _attach_monitor(out)
    if spec.detect_anomaly:
        out = (_detecting_anomalies(out, loss, trainable, compute_dtype) if accumulate is None
               else _detecting_anomalies_per_micro_batch(out, loss, trainable, accumulate,
                                                         compute_dtype))
    # The step with per-leaf finiteness of updates, jitted at the first skip.
    located: list[Callable] = []

    def explain_skipped_update(state: TrainState, *args) -> str:
        if not located:
            located.append(jax.jit(build(functools.partial(apply_update, locate=True))))
        with warnings.catch_warnings():  # the step's own trace already warned about these
            warnings.simplefilter("ignore", RuntimeWarning)
            metrics = located[0](state, *args)[1]
        return _explain_skipped_update(state, metrics)

    # The same without the guard's selects, for fit's re-checked chunks; not with a loss scale
    # (its routine overflows would each send a chunk back to be re-run).
    unguarded = (build(functools.partial(apply_update, optimistic=True))
                 if spec.jit and loss_scale is None else None)
    return _Built(call=out, unjitted=step if spec.jit else None, unguarded=unguarded,
                  explain=explain_skipped_update, lowered=jitted if spec.jit else None)


def _attach_monitor(step: Callable) -> Callable:
    """`step`, with metrics["monitor"] completed with the new state's monitor values."""
    def stepped(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        new_state, metrics = step(state, batch)
        if "monitor" in metrics:  # a fresh object every call
            metrics["monitor"].values = recorded(new_state.opt_state)["monitor_state"].values
        return new_state, metrics

    return functools.wraps(step)(stepped)


def _may_monitor(optimizer: Any) -> bool:
    """Whether `optimizer`'s chain may hold a `funcgrad.grad_monitor` (its state for a one-leaf
    params has a `funcgrad.MonitorState`; True where that state cannot be made): only then
    does a call go through `_attach_monitor`'s host wrapper."""
    found = records_of_optimizer(optimizer)
    return found is None or any(isinstance(r, MonitorState) for r in found)


def _wants_dead_relu(opt_state: Any) -> bool:
    """Whether a `funcgrad.grad_monitor` in the chain records dead ReLUs (at trace time)."""
    return any(isinstance(r, MonitorState) and r.monitor is not None and r.monitor.dead_relu
               for r in records(opt_state))


def _value_and_grad_checked(fn: Callable, **kwargs) -> Callable:
    """``jax.value_and_grad(fn, **kwargs)`` that first names a params leaf with no gradient
    (an integer or bool leaf: JAX's own error names none) and says how to fix it."""
    value_and_grad = jax.value_and_grad(fn, **kwargs)

    def checked(params, *args):
        check_differentiable(params, "make_train_step")
        return value_and_grad(params, *args)

    return checked


def _warn_half_params(params: PyTree) -> None:
    """A warning (once per trace) for float16/bfloat16 params trained without
    `funcgrad.mixed_precision`:
    PyTorch's ``model.half()`` habit, where updates below the params' spacing round away."""
    half = first_half_leaf(params)
    if half is not None:
        path, dtype = half
        warnings.warn(
            f"params{path} is {dtype}, and the step updates it in {dtype}: an update smaller "
            f"than {float(jnp.finfo(dtype).eps) / 2:.3g} of a weight rounds away. For mixed "
            f"precision keep float32 params and train funcgrad.mixed_precision(loss_fn, "
            f"jnp.{dtype}) (with loss_scale=funcgrad.dynamic_loss_scale() for float16).",
            RuntimeWarning, stacklevel=4)


def _check_stacked(microbatches: PyTree, mask: Any, k: int) -> None:
    """The accumulation shape error, saying first that this step takes stacked micro-batches
    (a plain batch passed to an accumulating step is the usual cause)."""
    from funcgrad.train.microbatches import leading_axes, unpack_microbatches

    try:
        leading_axes(unpack_microbatches(microbatches, mask)[0])
    except ValueError as error:
        raise ValueError(
            f"this step's loss accumulates (funcgrad.accumulate(loss, {k})): it takes "
            "micro-batches stacked along a "
            "leading axis, (num_micro_batches, micro_batch_size, ...), e.g. "
            "fg.stack_microbatches([mb0, mb1, ...]) or fg.group_microbatches(...), not one "
            f"batch (fit stacks them for you). {error}") from None
