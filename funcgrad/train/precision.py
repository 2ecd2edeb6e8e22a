"""Dynamic loss scaling, so float16 gradients neither underflow to zero nor overflow unseen.

Mixed precision runs the forward and backward pass in a narrow compute dtype (float16 or
bfloat16) over float32 *master* parameters that the optimizer updates. float16 has 5 exponent
bits: its smallest subnormal is 2**-24 (~6.0e-8) and its largest value 65504, so small
gradients flush to zero. Multiplying the loss by a *loss scale* S multiplies every cotangent of
the backward pass by S and lifts them into range; the float32 gradients are divided by S again
("unscaled") before anything else looks at them (Micikevicius et al. 2018, "Mixed Precision
Training", arXiv:1710.03740, section 3.2). A dynamic loss scale looks for the largest S that
keeps the gradients finite: a step whose gradients are NaN/inf is skipped and S shrinks; after a
run of finite steps S grows. bfloat16 has float32's 8 exponent bits and rarely needs scaling.

The pieces: `dynamic_loss_scale` (an ``(init, update)`` pair over `LossScaleState`),
`scaled_value_and_grad` (forward and backward in the compute dtype, gradients unscaled in
float32), `all_finite` and `cast_floating`. To train with them use
``step = funcgrad.make_train_step(mixed_precision(loss_fn, jnp.float16, loss_scale=ls),
optimizer)`` and ``step.init(params)`` (``ls = dynamic_loss_scale()``): the step unscales,
then measures the global norm, then clips, then applies the update only if finite, and
`funcgrad.train.fit` counts the skipped steps in ``History.skipped_steps``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._paths import key_paths, keystr

PyTree = Any
Batch = Any  # a pytree: a dict, or accumulation's (micro-batch, mask) pair


class LossScaleState(NamedTuple):
    """What a dynamic loss scale carries from one step to the next (a pytree of four scalars).

    The hyperparameters (factors, interval, floor, ceiling) are not here: they are Python
    constants of the `LossScale` that made the state, as optax keeps them in its
    transformations, so no flatten/unflatten or ``jit`` boundary can drop or reset them.

    Attributes:
      scale: shape (), float32; the loss is multiplied by it in the next step.
      good_steps: shape (), int32; consecutive finite steps since the last skipped step or
        the last growth (a growth resets it to 0, also at the ceiling where the scale stays).
      skipped: shape (), bool; True if the last update saw non-finite gradients (that step's
        parameters and optimizer state were kept as they were).
      skipped_total: shape (), int32; steps skipped since `init` because their gradients
        were not finite (the ones that back the scale off). The train step also skips a step
        whose update is not finite from finite gradients; that one is not counted here.
    """
    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array
    skipped_total: jax.Array


class LossScale(NamedTuple):
    """A loss scale as a pair of pure functions, like an optax ``GradientTransformation``.

    Attributes:
      init: ``init() -> LossScaleState``, the state before the first step.
      update: ``update(state, grads_finite) -> state``; `grads_finite` is a bool of shape ()
        saying whether every unscaled gradient of the step was finite. Jits and vmaps.
    """
    init: Callable[[], LossScaleState]
    update: Callable[[LossScaleState, jax.typing.ArrayLike], LossScaleState]


def dynamic_loss_scale(*, init_scale: float = 2.0**15, growth_factor: float = 2.0,
                       backoff_factor: float = 0.5, growth_interval: int = 2000,
                       min_scale: float = 1.0, max_scale: float = 2.0**24) -> LossScale:
    """Returns the ``(init, update)`` pair of a dynamic loss scale.

    ``update(state, grads_finite)``:

    - non-finite step: ``scale = max(scale * backoff_factor, min_scale)``, ``good_steps = 0``,
      ``skipped = True``, ``skipped_total += 1``;
    - finite step: ``skipped = False``, ``good_steps += 1``; when that makes it
      ``growth_interval``, ``scale = min(scale * growth_factor, max_scale)`` and
      ``good_steps = 0`` (also at the ceiling, where the scale stays).

    Counter convention: the scale grows *on* the `growth_interval`-th consecutive finite step,
    as in PyTorch's ``GradScaler`` (``torch._amp_update_scale_``; checked against it in
    ``tests/train/test_precision.py``), NVIDIA apex's ``LossScaler`` and jmp's
    ``DynamicLossScale.adjust`` (which compares ``counter == period - 1`` before counting).
    Flax's ``DynamicScale`` compares ``fin_steps == growth_interval`` before counting, so it
    grows one step later, on the (interval + 1)-th finite step.

    Defaults and their sources: growth_factor 2, backoff_factor 0.5, growth_interval 2000 are
    PyTorch ``GradScaler``'s (also apex's and, for 2 and 2000, jmp's). init_scale is 2**15, the
    value of jmp's docstring, not PyTorch's 2**16: 2**16 = 65536 is above float16's largest
    value 65504, so when the loss itself is float16 the cotangent that seeds the backward pass
    overflows and the first step is always skipped (PyTorch's autocast computes losses in
    float32, where 2**16 fits). min_scale 1 is jmp's floor (PyTorch has none; below 1 the scale
    shrinks gradients, trading underflow for overflow: lower it if that is what you need).
    max_scale 2**24 is apex's ``max_loss_scale``; PyTorch only refuses a non-finite grown scale.
    With bfloat16 or float32 compute an overflow is rare, so without a ceiling the scale would
    double every interval towards float32's own limit.

    Args:
      init_scale: the first scale, in [min_scale, max_scale] (dimensionless).
      growth_factor: > 1; the scale is multiplied by it after `growth_interval` finite steps.
      backoff_factor: in (0, 1); the scale is multiplied by it after a non-finite step.
      growth_interval: a positive int, in steps.
      min_scale: the floor of the scale, finite and positive in float32, <= max_scale. If
        gradients are non-finite even at the floor (a NaN from the model, not from the scale)
        every step is skipped; `skipped_total` shows it.
      max_scale: the ceiling of the scale, finite and positive in float32, >= min_scale.
    Returns:
      a `LossScale`. Powers of two (all the defaults) keep scaling exact: x * 2**k only shifts
      the exponent.
    Raises:
      ValueError: if a value is outside its range; the message names it and the range.
    """
    f32_max = float(jnp.finfo(jnp.float32).max)

    def positive_finite(name, value):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise ValueError(f"dynamic_loss_scale: {name} must be a number, got {value!r}.")
        if not (math.isfinite(value) and 0 < value <= f32_max):
            raise ValueError(f"dynamic_loss_scale: {name} must be positive and finite in float32 "
                             f"(at most {f32_max:.4g}), got {value!r}.")
        return float(value)

    init_scale, growth_factor, backoff_factor, min_scale, max_scale = (
        positive_finite(n, v) for n, v in [("init_scale", init_scale),
                                           ("growth_factor", growth_factor),
                                           ("backoff_factor", backoff_factor),
                                           ("min_scale", min_scale), ("max_scale", max_scale)])
    if growth_factor <= 1:
        raise ValueError(f"dynamic_loss_scale: growth_factor must be > 1 (the scale grows after a "
                         f"run of finite steps), got {growth_factor!r}. The usual value is 2.")
    if backoff_factor >= 1:
        raise ValueError(f"dynamic_loss_scale: backoff_factor must be in (0, 1) (the scale shrinks "
                         f"after an overflow), got {backoff_factor!r}. The usual value is 0.5.")
    if (isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer))
            or not 1 <= growth_interval < 2**31):
        raise ValueError(f"dynamic_loss_scale: growth_interval must be a positive int (steps), "
                         f"got {growth_interval!r}. The usual value is 2000.")
    if not min_scale <= init_scale <= max_scale:
        raise ValueError(f"dynamic_loss_scale: need min_scale <= init_scale <= max_scale, got "
                         f"{min_scale!r} <= {init_scale!r} <= {max_scale!r}. Widen the range or "
                         "move init_scale into it.")
    interval = int(growth_interval)

    def init() -> LossScaleState:
        zero = jnp.zeros((), jnp.int32)
        return LossScaleState(jnp.asarray(init_scale, jnp.float32), zero,
                              jnp.zeros((), jnp.bool_), zero)

    def update(state: LossScaleState, grads_finite: jax.typing.ArrayLike) -> LossScaleState:
        finite = _bool_scalar(grads_finite)
        good = state.good_steps + 1
        grow = finite & (good >= interval)
        grown = jnp.where(grow, jnp.minimum(state.scale * growth_factor, max_scale), state.scale)
        backed_off = jnp.maximum(state.scale * backoff_factor, min_scale)
        return LossScaleState(
            scale=jnp.where(finite, grown, backed_off).astype(jnp.float32),
            good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
            skipped=~finite,
            skipped_total=state.skipped_total + (~finite).astype(jnp.int32))

    return LossScale(init, update)


def _bool_scalar(value: jax.typing.ArrayLike) -> jax.Array:
    value = jnp.asarray(value)
    if value.shape != () or value.dtype != jnp.bool_:
        raise ValueError(
            f"grads_finite must be a bool of shape (), got dtype {value.dtype} and shape "
            f"{value.shape}. Pass all_finite(grads), one flag for the whole gradient pytree.")
    return value


def all_finite(tree: PyTree) -> jax.Array:
    """Returns whether every element of every leaf of `tree` is finite (not NaN, not +-inf).

    Args:
      tree: a pytree of arrays (integer and bool leaves count as finite); may be empty.
    Returns:
      a bool array of shape (); True for an empty tree. One reduction per leaf, no host
      round-trip, so it can guard a step inside ``jit``.
    """
    flags = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.ones((), jnp.bool_)


def cast_floating(tree: PyTree, dtype: jax.typing.DTypeLike) -> PyTree:
    """Returns `tree` with its floating-point leaves cast to `dtype` and the others unchanged.

    Integer labels and masks keep their dtypes, so ``cast_floating(batch, jnp.float16)`` is
    safe on ``{"x": float32 images, "y": int32 labels}``.

    Args:
      tree: a pytree of arrays or array-likes (NumPy arrays are converted).
      dtype: a floating dtype, e.g. ``jnp.float16``, ``jnp.bfloat16``.
    Raises:
      TypeError: if `dtype` is not floating (an integer dtype would truncate the values).
    """
    dtype = _floating_dtype(dtype, "cast_floating", "dtype")

    def cast(leaf):
        leaf = jnp.asarray(leaf)
        return leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf
    return jax.tree.map(cast, tree)


def scaled_value_and_grad(loss_fn: Callable[[PyTree, Batch], jax.Array], *,
                          compute_dtype: jax.typing.DTypeLike,
                          value_and_grad: Callable[..., Callable] = jax.value_and_grad,
                          has_aux: bool = False
                          ) -> Callable[[PyTree, Batch, jax.Array], tuple[jax.Array, PyTree]]:
    """Returns ``f(params, batch, scale) -> (loss, grads)``: scaled backward, unscaled result.

    `f` casts the floating leaves of `params` and `batch` to `compute_dtype`, evaluates
    `loss_fn` on them, casts the loss to float32 and differentiates ``loss * scale`` with
    respect to the float32 `params`. So the forward and the backward pass run in the compute
    dtype (every cotangent is ``scale`` times its true value there), the gradient reaches the
    master params through the cast and arrives in float32, and it is divided by `scale` in
    float32. A power-of-two scale makes that division exact.

    If `loss_fn` returns a float16 loss, the backward pass starts from the cotangent `scale`
    in float16, which overflows for scale >= 65520: a dynamic scale then settles at 2**15.
    Cast the logits to float32 before the loss (as PyTorch's autocast does) to lift that limit.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, a pure function.
      compute_dtype: floating dtype of the forward and backward pass (float16, bfloat16, or
        float32 for loss scaling without mixed precision).
      value_and_grad: what differentiates, called as ``value_and_grad(fn, has_aux=True)`` and
        then with ``(params, batch, scale)``; e.g. ``functools.partial(
        funcgrad.train.masks.value_and_grad_trainable, mask=trainable)`` to differentiate only the
        trainable leaves (frozen leaves get exact zeros, which unscale to zeros).
      has_aux: `loss_fn` returns ``(loss, aux)``; `f` then returns ``((loss, aux), grads)``
        (the aux as computed, in the compute dtype), as ``jax.value_and_grad(has_aux=True)``.
    Returns:
      ``f(params, batch, scale)`` with `params` a pytree of float32 (or wider) leaves, `scale`
      a float32 array of shape (); it returns the loss as float32 shape () (unscaled, nats for
      cross-entropy) and the unscaled gradients, float32, same structure as `params`. A
      gradient element that overflowed is inf or NaN; test with `all_finite`.
    Raises:
      TypeError: if `compute_dtype` is not floating; at the first call, if a params leaf is
        narrower than float32 (the message names its path).
      ValueError: at the first call, if the loss is not a scalar.
    """
    compute_dtype = _floating_dtype(compute_dtype, "scaled_value_and_grad")

    def scaled_loss(params, batch, scale):
        loss = loss_fn(cast_floating(params, compute_dtype), cast_floating(batch, compute_dtype))
        aux = None
        if has_aux:
            loss, aux = loss
        elif isinstance(loss, (tuple, list)):
            raise ValueError(f"loss_fn must return a scalar, got a {type(loss).__name__} of "
                             f"{len(loss)}. Return the loss alone (no auxiliary outputs).")
        if jnp.shape(loss) != ():
            raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}. "
                             "Reduce it, e.g. return per_example_loss.mean().")
        loss = jnp.asarray(loss).astype(jnp.float32)
        return loss * scale, (loss, aux)

    differentiate = value_and_grad(scaled_loss, has_aux=True)

    def unscaled_value_and_grad(params, batch, scale):
        _check_master_params(params)
        scale = jnp.asarray(scale, jnp.float32)
        (_, (loss, aux)), grads = differentiate(params, batch, scale)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
        return ((loss, aux) if has_aux else loss), grads

    return unscaled_value_and_grad


def _floating_dtype(dtype, where: str, name: str = "compute_dtype") -> np.dtype:
    try:
        parsed = jnp.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed is None or not jnp.issubdtype(parsed, jnp.floating):
        raise TypeError(f"{where}: {name} must be a floating dtype such as jnp.float16 or "
                        f"jnp.bfloat16, got {dtype!r}.")
    return parsed


def first_half_leaf(params: PyTree) -> tuple[str, np.dtype] | None:
    """``(path, dtype)`` of the first float16/bfloat16 leaf of `params` (path as ``['w']``),
    or None when every floating leaf is at least float32."""
    for path, leaf in zip(key_paths(params), jax.tree.leaves(params)):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
            return keystr(path), dtype
    return None


def _check_master_params(params: PyTree) -> None:
    half = first_half_leaf(params)
    if half is not None:
        path, dtype = half
        raise TypeError(
            f"params{path} is {dtype}; mixed precision keeps float32 master params and casts "
            "them to the compute dtype inside the step, so small updates are not rounded away. "
            "Make them float32: jax.tree.map(lambda p: p.astype(jnp.float32), params).")


def mixed_precision(loss_fn: Any, compute_dtype: Any, *,
                    loss_scale: LossScale | None = None) -> Any:
    """The loss, marked to be evaluated in `compute_dtype` over float32 params (a piece of
    `funcgrad.make_train_step`).

    The train step casts the params and the batch's floating leaves to `compute_dtype` for
    the forward and backward pass (`scaled_value_and_grad`); the gradients come back float32,
    and the norm, clipping, guard and update stay float32 (NVIDIA's mixed-precision recipe,
    Micikevicius et al. 2018, arXiv:1710.03740). The model state is not cast (BatchNorm's
    statistics keep their dtype, as PyTorch's autocast keeps BatchNorm in float32).

    With `loss_scale` (`dynamic_loss_scale()`: PyTorch's ``GradScaler``) the loss is
    multiplied by ``state.loss_scale.scale`` before the backward pass and the gradients divided
    by it in float32 before the norm and the clipping; a step whose scaled gradients overflow
    is skipped and backs the scale off (metrics gain "loss_scale" and "skipped_total").
    ``step.init`` creates the scale's state.

    Args:
      loss_fn: the loss: a function ``(params, batch) -> scalar`` or a `funcgrad.Loss`.
      compute_dtype: jnp.float16 or jnp.bfloat16 (float32 is accepted without a loss scale).
      loss_scale: a `LossScale` (``funcgrad.dynamic_loss_scale()``), or None.
    Returns:
      a `funcgrad.Loss` whose ``precision`` is ``Precision(compute_dtype, loss_scale)``.
    Raises:
      TypeError: if `compute_dtype` is not a floating dtype, or `loss_scale` is not a
        `LossScale` (``loss_scale=True``, the uncalled ``dynamic_loss_scale``).
      ValueError: if the loss already has a precision, or `loss_scale` comes with a float32 or
        float64 compute dtype, where scaling changes nothing (float32 gradients underflow below
        1e-38, not 6e-8).
      RuntimeError: if `compute_dtype` is float16 and XLA on this machine cannot compile
        float16 (an x86 CPU without F16C: `funcgrad._platform`); the message points to bfloat16.
    Example:
      >>> loss = fg.mixed_precision(loss_fn, jnp.bfloat16)
      >>> step = fg.make_train_step(loss, optax.adam(1e-3))
    """
    from funcgrad._platform import require_dtype_compiles
    from funcgrad.train.loss import Precision, as_loss

    loss = as_loss(loss_fn)
    if compute_dtype is None:
        raise TypeError("mixed_precision: compute_dtype is None; pass jnp.bfloat16 or "
                        "jnp.float16 (or leave the loss as it is for the params' own dtype).")
    dtype = _floating_dtype(compute_dtype, "mixed_precision")
    if jnp.finfo(dtype).bits > 32:
        raise ValueError(f"mixed_precision: compute dtype {dtype.name} is wider than the "
                         "float32 params it would be cast from; mixed precision computes in "
                         "jnp.bfloat16 or jnp.float16 (float64 checks are check_grads', "
                         "scoped with jax.experimental.enable_x64).")
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        raise TypeError(f"mixed_precision: loss_scale must be a LossScale, e.g. "
                        f"loss_scale=funcgrad.dynamic_loss_scale() (called), got "
                        f"{type(loss_scale).__name__}.")
    if loss_scale is not None and jnp.finfo(dtype).bits >= 32:
        raise ValueError(
            f"mixed_precision: a loss scale with compute dtype {dtype.name} changes nothing: "
            "scaling keeps small float16/bfloat16 gradients from flushing to zero, and "
            f"{dtype.name} gradients do not. Pass compute_dtype=jnp.float16 (or jnp.bfloat16) "
            "with the loss scale, or drop loss_scale=.")
    if loss.precision is not None:
        raise ValueError(f"mixed_precision: {loss!r} already has a precision; apply "
                         "mixed_precision once.")
    require_dtype_compiles(dtype, "mixed_precision", "compute_dtype")
    return loss._marked(precision=Precision(dtype, loss_scale))
