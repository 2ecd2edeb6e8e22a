"""Gradient accumulation: the mean gradient over many micro-batches, one `lax.scan` per update.

Concept 12 (article A §3.3). PyTorch accumulates by calling ``(loss / accum_steps).backward()``
on every micro-batch and ``optimizer.step()`` every ``accum_steps`` calls; that weights every
micro-batch equally, so a smaller last micro-batch counts too much, and a final group of fewer
than ``accum_steps`` micro-batches is silently left in ``.grad``. Here the gradient is

    g = (1/N) * sum over micro-batches j of sum over examples i in j of grad loss_i(params)
      = sum_j (n_j / N) * mean gradient of micro-batch j,

N = sum_j n_j: each micro-batch weighted by its example count; this is the gradient of the mean
loss over all N examples (the full-batch gradient), up to float rounding, provided each
example's loss depends on that example alone. A loss that couples the examples of a batch
(BatchNorm in training mode, a loss centred on the batch mean) is evaluated per micro-batch and
gives another gradient; `funcgrad.train.coupling` probes for that once per trace and warns
(`CoupledExamplesWarning`). An optimizer's learning-rate schedule counts updates, one per
group of micro-batches. ``lax.scan`` needs
equal shapes, so micro-batches are padded to one size with a boolean mask of real rows, and
the loss function returns **per-example** losses:

    def loss_fn(params, batch):                       # batch: one micro-batch, (m, ...)
        logits = mlp_apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])  # (m,)

* `accumulate_grads` returns the mean loss, the mean gradient and the example count over a
  stack of micro-batches ``(num_micro_batches, m, ...)`` in one scan: its compiled temporary
  memory is that of one micro-batch, whatever their number.
* ``funcgrad.make_train_step(funcgrad.accumulate(loss_fn, K), optimizer)`` applies one
  optimizer update per K micro-batches, all inside one jitted call; the inner optimizer runs
  once per applied update. It is `make_accumulating_step` around the train step's own update
  (norm, clipping, non-finite guard, masks), and `funcgrad.train.fit` feeds it groups of K
  batches. When the number
  of micro-batches is not a multiple of `accumulate`, the final partial group follows an
  explicit `tail` policy, "apply" (one update with the mean gradient over its examples) or
  "drop" (no update; the metrics count the dropped examples). ``optax.MultiSteps``, by
  contrast, runs the inner update on every mini-step (and discards it on all but every k-th)
  and keeps an incomplete final window in its state until more mini-steps come (both shown in
  ``tests/train/test_accumulate.py`` and ``examples/12_accumulation.py``).
* `stack_microbatches` and `group_microbatches` (`funcgrad.train.microbatches`, re-exported here)
  pad and stack host (NumPy) micro-batches, e.g. those of `funcgrad.Batches.epoch`, into that
  layout, as a `Microbatches`: the stacked arrays and their padding mask in one object, passed
  whole (``accumulate_grads(loss_fn, params, mbs)``, ``step(state, mbs)``), so the padding rows
  cannot be counted by forgetting ``mask=``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from funcgrad._library_objects import split_equinox_args
from funcgrad.train.coupling import warn_if_coupled
from funcgrad.train.microbatches import Microbatches as Microbatches
from funcgrad.train.microbatches import (
    _positive_int,
    checked_mask,
    leading_axes,
    one_microbatch,
    unpack_microbatches,
)
from funcgrad.train.microbatches import group_microbatches as group_microbatches
from funcgrad.train.microbatches import stack_microbatches as stack_microbatches
from funcgrad.train.precision import scaled_value_and_grad

if TYPE_CHECKING:
    from funcgrad.train.loss import Loss  # imported where used: funcgrad.train.loss imports this

PyTree = Any
PerExampleLossFn = Callable[[PyTree, PyTree], jax.Array]
# apply_update(state, loss, grads) -> (state, metrics), with model_state= when the loss has one.
ApplyUpdate = Callable[..., tuple[Any, dict[str, jax.Array]]]

#: Policies for a final group of fewer than `accumulate` micro-batches.
TAIL_POLICIES: dict[str, str] = {
    "apply": "one update with the mean gradient over the examples the partial group holds",
    "drop": "no update; metrics['dropped_examples'] counts the examples left out",
}

_PER_EXAMPLE_HELP = """\
Accumulation sums per-example losses over micro-batches and divides by the total example count,
so loss_fn must return one loss per example of the micro-batch, not their mean.
  failing:  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  fixed:    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
Return the per-example losses as they are: do not divide them (or a mean) by the number of
micro-batches, as PyTorch's `loss / accum_steps` does. The division by the example count is
done here, and dividing again would shrink every gradient that many times."""


class AccumulatedGrads(NamedTuple):
    """The mean loss and mean gradient over every real example of a stack of micro-batches.

    Attributes:
      loss: shape (), the mean per-example loss over the real examples (at least float32).
      grads: same structure, shapes and dtypes as `params`: the gradient of that mean loss.
      count: shape (), int32; the number of real (unmasked) examples N.
    """
    loss: jax.Array
    grads: PyTree
    # The public name shadows tuple.count (a method), which mypy reports on a NamedTuple.
    count: jax.Array  # type: ignore[assignment]


def accumulate_grads(loss_fn: PerExampleLossFn | Loss, params: PyTree,
                     microbatches: Microbatches | PyTree, *,
                     mask: jax.typing.ArrayLike | None = None,
                     value_and_grad: Callable = jax.value_and_grad) -> AccumulatedGrads:
    """Returns the mean loss and its gradient over a stack of micro-batches, in one `lax.scan`.

    The scan carries the running sums ``sum_i loss_i``, ``sum_i grad loss_i`` and the count;
    after the last micro-batch both sums are divided by the count N (formula in the module
    docstring, which equals the full-batch gradient of the mean loss up to float rounding when
    each example's loss depends on that example alone: a loss coupled through the micro-batch
    warns once per trace, see `funcgrad.train.coupling`).
    Sums are kept in at least float32 (bfloat16/float16 gradients are accumulated in float32),
    and the mean is cast back to each leaf's dtype. Memory: the scan keeps one micro-batch's
    activations and one accumulator the size of `params`, so the compiled temporary memory does
    not grow with the number of micro-batches. Traceable: call it inside ``jax.jit``.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> losses`` of shape ``(m,)``, one per example
        (not their mean); `microbatch` is `microbatches` without its leading axis.
      params: the pytree to differentiate with respect to (floating leaves). An equinox
        module is taken as ``eqx.filter_grad`` takes it (grads None at its other leaves).
      microbatches: a `Microbatches` (from `stack_microbatches`, whose mask is used), or a
        pytree whose leaves all have shape ``(num_micro_batches, m, ...)``.
      mask: for a plain pytree only: bool ``(num_micro_batches, m)``, True for a real example
        and False for padding; None means every row is real. Padded rows are computed and
        then excluded with ``jnp.where``, so they must give finite losses (copies of real rows,
        as `stack_microbatches` makes them, do).
      value_and_grad: the differentiation transform, ``jax.value_and_grad`` or one with its
        signature, e.g. ``lambda f: funcgrad.train.masks.value_and_grad_trainable(f, mask)``.
    Returns:
      an `AccumulatedGrads`. When the mask selects no example, N = 0 and the loss and every
      gradient element are NaN (the mean over no examples is undefined).
    Raises:
      ValueError: if the leaves of `microbatches` disagree on their two leading axes, the mask
        has another shape, or `loss_fn` does not return shape ``(m,)``.
      TypeError: if the mask is not boolean, or a `Microbatches` comes with ``mask=`` too.
    Warns:
      funcgrad.train.coupling.CoupledExamplesWarning: once per trace, if `loss_fn` couples the
        examples of a micro-batch (the mean is then not the full-batch gradient).
    """
    # an equinox model: its floating arrays
    loss_fn, (params,) = split_equinox_args(loss_fn, (params,), "accumulate_grads")
    microbatches, mask = unpack_microbatches(microbatches, mask)
    num, size = leading_axes(microbatches)
    mask = checked_mask(mask, num, size)
    acc, _, _ = _accumulate(loss_fn, params, microbatches, mask, start=0, length=num,
                            value_and_grad=value_and_grad)
    # Once per trace, see funcgrad.train.coupling.
    warn_if_coupled(loss_fn, params, one_microbatch(microbatches))
    return acc


def _accumulate(loss_fn, params, microbatches, mask, *, start, length,
                value_and_grad=jax.value_and_grad, compute_dtype=None,
                scale=None, model_state=None, key=None, axis_name=None, axis_size=1):
    """`accumulate_grads` over micro-batches ``start .. start + length - 1`` (start may be traced).

    Returns ``(AccumulatedGrads, new_model_state, aux)``. `loss_fn` is a plain per-example loss
    or a `funcgrad.Loss` (per-example) under the contract of `funcgrad.train.loss`: its model state
    threads through the micro-batches in order (micro-batch j sees the state left by j - 1, as
    K forward passes in PyTorch would update running statistics K times), micro-batch j of
    the group gets the key ``fold_in(key, j)``, and its aux is stacked along a leading axis of
    length `length` (None without has_aux).

    Micro-batches are read by index (``dynamic_index_in_dim``) rather than sliced out first,
    so no copy of the group is made: temporary memory is one micro-batch, whatever `length`.
    With `compute_dtype` or `scale` (shape (), float32) each micro-batch's forward and backward
    pass run in `compute_dtype` on ``scale * summed loss / m`` (m: the padded micro-batch size;
    the cotangents of a mean loss) and its gradient is unscaled and multiplied by m in float32
    before it is added (`funcgrad.train.precision.scaled_value_and_grad`), so the sums only ever
    hold true, float32 gradients.

    With `axis_name` (inside ``shard_map`` over a data axis of `axis_size` devices, each
    holding its rows of every micro-batch) the scan runs on this device's rows alone: the params
    and model state are made per-device copies (``pcast`` to varying), so no gradient is summed
    across devices inside the scan, and the sums (loss, gradients, count, float model state)
    are summed over the devices by one ``psum`` after it: one all-reduce per update. Micro-batch
    j's key is ``fold_in(fold_in(key, j), device index)``; the model state that returns is the
    mean of the devices' (each threaded through its own rows); the compute-dtype pass divides by
    the global padded size ``m * axis_size`` (the cotangents of the one-device step).
    """
    from funcgrad.train.loss import as_loss

    loss = as_loss(loss_fn)
    one = one_microbatch(microbatches)
    start = jnp.asarray(start, jnp.int32)
    key_of = ((lambda j: None) if not loss.takes_key
              else (lambda j: jax.random.fold_in(key, j)))
    if axis_name is not None:  # per-device copies: their cotangents stay on the device
        vary = lambda tree: jax.tree.map(
            lambda a: jax.lax.pcast(a, axis_name, to="varying"), tree)
        params, model_state = vary(params), vary(model_state)
        if loss.takes_key:
            key_of = lambda j: jax.random.fold_in(jax.random.fold_in(key, j),
                                                  jax.lax.axis_index(axis_name))
    out = jax.eval_shape(lambda p, b: loss(p, b, model_state=model_state, key=key_of(0)).loss,
                         params, one)
    size = jax.tree.leaves(one)[0].shape[0]
    mean_size = size * axis_size  # the global padded micro-batch size (see the docstring)
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != (size,):
        got = (f"shape {out.shape}" if isinstance(out, jax.ShapeDtypeStruct)
               else f"a {type(out).__name__}")
        raise ValueError(f"accumulate: loss_fn returned {got}, expected shape ({size},): one "
                         f"loss per example of the micro-batch.\n{_PER_EXAMPLE_HELP}")

    def summed_loss(p, microbatch, real, state, k):
        result = loss(p, microbatch, model_state=state, key=k)
        losses = result.loss
        total = (jnp.sum(losses) if real is None
                 else jnp.sum(jnp.where(real, losses, jnp.zeros_like(losses))))
        return total, (result.model_state, result.aux)

    def differentiate(p, microbatch, real, state, k):
        if compute_dtype is None and scale is None:
            if not (loss.has_state or loss.has_aux):  # a plain transform needs no has_aux
                total, grads = value_and_grad(lambda *a: summed_loss(*a)[0])(
                    p, microbatch, real, state, k)
                return (total, (None, None)), grads
            return value_and_grad(summed_loss, has_aux=True)(p, microbatch, real, state, k)
        # The compute-dtype pass differentiates the micro-batch's summed loss divided by its
        # padded size m: per-example cotangents are then those of a mean loss (scale / m), as
        # in a step without accumulation, so float16 overflows no sooner and a dynamic loss
        # scale settles where it would without accumulation. The float32 result is multiplied
        # back by m (one rounding, ~6e-8 relative). The model state is not cast (see
        # funcgrad.train._stages.differentiate); its new value is cast back to the old dtypes.
        def mean_loss(p, batch):
            cast_microbatch, cast_real = batch  # (microbatch, real) in the compute dtype
            total, (new_state, aux) = summed_loss(p, cast_microbatch, cast_real, state, k)
            if new_state is not None:
                new_state = jax.tree.map(lambda n, o: jnp.asarray(n).astype(jnp.result_type(o)),
                                         new_state, state)
            return total / mean_size, (new_state, aux)

        scaled = scaled_value_and_grad(
            mean_loss, value_and_grad=value_and_grad, has_aux=True,
            compute_dtype=jnp.float32 if compute_dtype is None else compute_dtype)
        one_scale = jnp.ones((), jnp.float32) if scale is None else scale
        (loss_value, rest), grads = scaled(p, (microbatch, real), one_scale)
        return (loss_value * mean_size, rest), jax.tree.map(lambda g: g * mean_size, grads)

    acc_dtype = lambda dtype: jnp.promote_types(dtype, jnp.float32)
    zeros = (jnp.zeros((), acc_dtype(out.dtype)),
             jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), acc_dtype(jnp.result_type(p))),
                          params),
             jnp.zeros((), jnp.int32))
    if axis_name is not None:
        zeros = vary(zeros)

    def body(carry, _):
        index, loss_sum, grad_sum, count, state = carry
        take = lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False)
        microbatch = jax.tree.map(take, microbatches)
        real = None if mask is None else take(mask)
        (loss_value, (state, aux)), grads = differentiate(params, microbatch, real, state,
                                                          key_of(index - start))
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
        n = size if real is None else jnp.sum(real, dtype=jnp.int32)
        return (index + 1, loss_sum + loss_value.astype(loss_sum.dtype), grad_sum, count + n,
                state), aux

    # The index is carried, not scanned over: an xs of arange(length) would be a buffer of
    # `length` int32s, and temporary memory would grow (4 bytes) with each micro-batch.
    (_, loss_sum, grad_sum, count, model_state), aux = jax.lax.scan(
        body, (start, *zeros, model_state), None, length=length)
    if axis_name is not None:
        loss_sum, grad_sum, count, model_state = _summed_over_devices(
            loss_sum, grad_sum, count, model_state, axis_name, axis_size)
    mean = lambda s, like: (s / count.astype(s.dtype)).astype(jnp.result_type(like))
    return (AccumulatedGrads(loss_sum / count.astype(loss_sum.dtype),
                             jax.tree.map(mean, grad_sum, params), count),
            model_state, aux)


def _summed_over_devices(loss_sum, grad_sum, count, model_state, axis_name, axis_size):
    """The devices' sums added up, in one ``psum`` (one all-reduce: the count goes as float32,
    exact below 2**24 examples, so every operand shares the float reduction); the model state
    averaged (float leaves in that same ``psum``, divided by `axis_size`; other leaves by a
    ``psum`` of their own, integer-divided)."""
    leaves, tree = jax.tree.flatten(model_state)
    floating = [jnp.issubdtype(jnp.result_type(a), jnp.floating) for a in leaves]
    loss_sum, grad_sum, count, summed = jax.lax.psum(
        (loss_sum, grad_sum, count.astype(jnp.float32),
         [a for a, f in zip(leaves, floating) if f]), axis_name)
    integers = [a for a, f in zip(leaves, floating) if not f]
    float_sums, int_sums = iter(summed), iter(jax.lax.psum(integers, axis_name) if integers
                                               else [])
    leaves = [(next(float_sums) / axis_size).astype(jnp.result_type(a)) if f
              else next(int_sums) // axis_size for a, f in zip(leaves, floating)]
    return loss_sum, grad_sum, count.astype(jnp.int32), jax.tree.unflatten(tree, leaves)


def make_accumulating_step(
        loss_fn: PerExampleLossFn | Loss, apply_update: ApplyUpdate, *, accumulate: int,
        tail: str = "apply", value_and_grad: Callable = jax.value_and_grad,
        compute_dtype: Any = None, loss_scale_of: Callable[[Any], jax.Array] | None = None,
        jit: bool = True, mesh: Any = None,
        data_axis: str = "data") -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """Returns ``step(state, microbatches, mask=None) -> (state, metrics)``: one update per group.

    The micro-batches (leading axis, M of them) are taken in order in groups of `accumulate`
    (K). For each group the step computes the mean loss and gradient over the group's real
    examples (as `accumulate_grads`) and hands them to ``apply_update(state, loss, grads)``
    once: whatever optimizer, clipping or guard runs there runs once per update, never per
    micro-batch. The groups run in an outer ``lax.scan`` and each group's micro-batches in an
    inner one, so one call does all ``M // K`` updates and its compiled temporary memory does
    not grow with M or K (beyond the metrics, a few bytes per update). If M is not a multiple
    of K, the last ``M % K`` micro-batches form a partial group handled by `tail`
    (`TAIL_POLICIES`):

    * "apply" (default): one more update with the mean gradient over the partial group's
      examples, so every example is used exactly once;
    * "drop": no update from them; ``metrics["dropped_examples"]`` counts their real examples.

    M and K are static (shapes), so the policy costs nothing at run time. Calling the step once
    per group of K micro-batches (and once with the last, shorter group) is the usual loop;
    `group_microbatches` builds those groups.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> losses`` of shape ``(m,)``, one per example.
      apply_update: ``apply_update(state, loss, grads) -> (state, metrics)``, traceable;
        ``state.params`` are the params differentiated, `loss` has shape () and `grads` the
        structure of the params; `metrics` is a dict of arrays (usually shape ()).
      accumulate: K, micro-batches per update, a positive int.
      tail: "apply" or "drop", the policy for a final group of fewer than K micro-batches.
      value_and_grad: the differentiation transform, ``jax.value_and_grad`` or one with its
        signature, e.g. ``lambda f: funcgrad.train.masks.value_and_grad_trainable(f, mask)``.
      compute_dtype: if given (float16, bfloat16), each micro-batch's forward and backward
        pass runs in it over the float32 params; the sums and the update stay float32.
      loss_scale_of: if given, ``loss_scale_of(state)`` is the loss scale (shape (), float32)
        of the update about to be computed: every micro-batch of the group is differentiated
        at ``scale * loss`` and unscaled before it is summed (the scale changes only between
        updates, in `apply_update`).
      jit: if False the step is returned un-jitted (for debugging with prints).
      mesh: a ``jax.sharding.Mesh`` whose `data_axis` splits the rows of every micro-batch
        (axis 1 of the stacked micro-batches; ``funcgrad.data_parallel`` passes its own):
        each device accumulates its own rows of the group's micro-batches in a ``shard_map``
        and the sums are added over the devices once, after the group (one all-reduce per
        update, like PyTorch DDP's ``no_sync`` on all but the last micro-batch). The mean
        gradient is the one-device step's up to float summation order. A loss that couples
        the examples of a micro-batch (BatchNorm) sees each device's rows of it; the model
        state returned is the mean over the devices; a loss's key differs per device
        (`_accumulate`); a loss's aux gets a device axis after the micro-batch axis.
      data_axis: the mesh axis the rows are split over.
    Returns:
      ``step(state, microbatches, mask=None)`` with `microbatches` (a `Microbatches`, or a
      plain pytree) and `mask` as in `accumulate_grads`. It returns the state after U updates (U =
      ``M // K``, plus 1 for a partial group under "apply") and the metrics of `apply_update`
      stacked along a new leading axis of length U, plus ``"examples": (U,) int32`` (examples
      averaged by each update) and ``"dropped_examples": () int32``. A group without real examples
      gives a NaN loss and gradient (see `accumulate_grads`): the train step's guard skips that
      update (under a loss scale it also backs the scale off once).
    Raises:
      ValueError: if `accumulate` is not a positive int or `tail` not a policy; at the first
        call, for the shape errors of `accumulate_grads`.
    Warns:
      funcgrad.train.coupling.CoupledExamplesWarning: at the first call (once per trace), if
        `loss_fn` couples the examples of a micro-batch.
    """
    from funcgrad.train.loss import as_loss

    loss = as_loss(loss_fn)
    k = _positive_int(accumulate, "accumulate")
    if tail not in TAIL_POLICIES:
        raise ValueError(f"tail must be one of {list(TAIL_POLICIES)} (what to do with a final "
                         f"group of fewer than accumulate={k} micro-batches), got {tail!r}.")

    probed: set[str] = set()  # the shapes whose loss was probed for coupled examples

    def step(state, microbatches: Microbatches | PyTree,
             mask: jax.typing.ArrayLike | None = None):
        microbatches, mask = unpack_microbatches(microbatches, mask)
        num, size = leading_axes(microbatches)
        mask = checked_mask(mask, num, size)
        groups, rest = divmod(num, k)

        def update(state, start, length):
            model_state = state.model_state if loss.has_state else None
            key = _update_key(state) if loss.takes_key else None
            scale = None if loss_scale_of is None else loss_scale_of(state)
            options = dict(start=start, length=length, value_and_grad=value_and_grad,
                           compute_dtype=compute_dtype)
            if mesh is None:
                acc, model_state, aux = _accumulate(
                    loss, state.params, microbatches, mask, scale=scale,
                    model_state=model_state, key=key, **options)
            else:
                acc, model_state, aux = _accumulated_per_device(
                    loss, mesh, data_axis, state.params, microbatches, mask, scale=scale,
                    model_state=model_state, key=key, **options)
            if loss.has_state:
                state, metrics = apply_update(state, acc.loss, acc.grads, model_state=model_state)
            else:
                state, metrics = apply_update(state, acc.loss, acc.grads)
            return state, {**metrics, "examples": acc.count}, aux

        rows, auxes = [], []
        if groups:
            def group(carry, _):  # the group's first micro-batch is carried (see _accumulate)
                state, start = carry
                state, row, aux = update(state, start, k)
                return (state, start + k), (row, aux)
            (state, _), (row, aux) = jax.lax.scan(
                group, (state, jnp.zeros((), jnp.int32)), None, length=groups)
            rows.append(row)
            # (groups, K, ...) -> (groups * K, ...): one entry per micro-batch, in order
            auxes.append(jax.tree.map(lambda v: v.reshape(groups * k, *v.shape[2:]), aux))
        dropped = jnp.zeros((), jnp.int32)
        if rest and tail == "apply":
            state, row, aux = update(state, groups * k, rest)
            rows.append(jax.tree.map(lambda v: v[None], row))
            auxes.append(aux)
        elif rest:
            dropped = (jnp.asarray(rest * size, jnp.int32) if mask is None
                       else jnp.sum(mask[groups * k:], dtype=jnp.int32))
        if rows:
            metrics = jax.tree.map(lambda *v: jnp.concatenate(v), *rows)
        else:  # fewer than K micro-batches, dropped: no update, empty metrics of the right kind
            shapes = jax.eval_shape(lambda s: update(s, 0, rest)[1], state)
            metrics = jax.tree.map(lambda a: jnp.zeros((0, *a.shape), a.dtype), shapes)
        if loss.has_aux:
            metrics["aux"] = (jax.tree.map(lambda *v: jnp.concatenate(v), *auxes) if auxes
                              else jax.tree.map(lambda a: jnp.zeros((0, *a.shape[1:]), a.dtype),
                                                jax.eval_shape(lambda s: update(s, 0, rest)[2],
                                                               state)))
        probe = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)),
                             (one_microbatch(microbatches), state.params))
        if repr(probe) not in probed:  # once per shapes, also when not jitted (jit=False)
            probed.add(repr(probe))
            _warn_if_coupled(loss, state, one_microbatch(microbatches))
        return state, {**metrics, "dropped_examples": dropped}

    return jax.jit(step) if jit else step


def _accumulated_per_device(loss, mesh, axis, params, microbatches, mask, *, start, scale,
                            model_state, key, **options):
    """`_accumulate` with each device summing its own rows of the micro-batches, inside a
    ``shard_map`` over `axis` (the micro-batches' axis 1 split over it, everything else
    replicated), and one ``psum`` of the sums after the scan. The aux, per device, comes back
    as ``(length, devices, ...)``."""
    from jax.sharding import PartitionSpec as P

    size = int(mesh.shape[axis])
    rows = P(None, axis)

    def local(params, microbatches, mask, start, scale, model_state, key):
        acc, model_state, aux = _accumulate(
            loss, params, microbatches, mask, start=start, scale=scale,
            model_state=model_state, key=key, axis_name=axis, axis_size=size, **options)
        return acc, model_state, jax.tree.map(lambda a: a[None], aux)

    run = jax.shard_map(
        local, mesh=mesh,
        in_specs=(P(), jax.tree.map(lambda _: rows, microbatches),
                  None if mask is None else rows, P(), P(), P(), P()),
        out_specs=(P(), P(), P(axis)))
    acc, model_state, aux = run(params, microbatches, mask, start, scale, model_state, key)
    return acc, model_state, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), aux)


def _update_key(state) -> jax.Array:
    """The key of the update about to run: ``fold_in(state.key, state.step)``."""
    if getattr(state, "key", None) is None:
        raise ValueError("the loss takes a PRNG key, but the train state has none. Create it "
                         "with step.init(params) (seed=0 by default; or "
                         "key=jax.random.key(0)).")
    return jax.random.fold_in(state.key, state.step)


def _warn_if_coupled(loss, state, microbatch) -> None:
    """`warn_if_coupled` for a loss under the contract: the probe varies the params and the
    model state (a synthetic stand-in, like the params) and draws a probe key."""
    if not (loss.has_state or loss.takes_key):
        warn_if_coupled(loss.fn, state.params, microbatch)
        return
    model_state = state.model_state if loss.has_state else None
    key = _update_key(state) if loss.takes_key else None

    def probed(packed, batch):
        params, model_state, key = packed
        return loss(params, batch, model_state=model_state, key=key).loss
    cast(Any, probed).__wrapped__ = loss.fn  # the warning names the user's function and line
    warn_if_coupled(probed, (state.params, model_state, key), microbatch)
