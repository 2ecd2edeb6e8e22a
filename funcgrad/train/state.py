"""The train state: everything that persists from one step to the next, as one pytree."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from funcgrad._library_objects import check_optimizer, check_params
from funcgrad._paths import key_paths, keystr
from funcgrad._platform import require_dtype_compiles
from funcgrad.train.loss import Loss
from funcgrad.train.masks import _AllOf, _leaf_flags, frozen_masks, train_only
from funcgrad.train.optimizers import make_optimizer
from funcgrad.train.precision import LossScale, LossScaleState, first_half_leaf

PyTree = Any

class TrainState(NamedTuple):
    """Everything that persists from one step to the next, as one pytree.

    Attributes:
      params: the model's parameter pytree.
      opt_state: the optax optimizer state for `params`.
      step: shape (), int32; number of step calls so far, skipped steps included (a skipped
        step leaves params and optimizer state, hence e.g. Adam's own count, unchanged).
      loss_scale: the `funcgrad.train.precision.LossScaleState` of a step whose loss has a loss
        scale (`funcgrad.mixed_precision`), else None.
      model_state: the model's non-differentiated state (BatchNorm running statistics,
        counters), passed to a loss declared with ``has_state=True`` and replaced by the
        state it returns (`funcgrad.train.loss`); None without.
      key: the run's base PRNG key (``step.init(params, seed=)``); the step draws
        ``jax.random.fold_in(key, step)`` for a loss declared with ``takes_key=True``, so
        every step has a fresh key and a rerun or resume draws the same ones. None without.
    """
    params: PyTree
    opt_state: optax.OptState
    step: jax.Array
    loss_scale: LossScaleState | None = None
    model_state: PyTree = None
    key: jax.Array | None = None




def _check_kinds(loss_scale: Any) -> None:
    """TypeError for a `loss_scale` of the wrong kind (True, an uncalled factory)."""
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        raise TypeError(f"loss_scale must be a LossScale, e.g. "
                        f"loss_scale=funcgrad.dynamic_loss_scale() (called), got "
                        f"{type(loss_scale).__name__}.")


def _initial_state(params: PyTree, optimizer: str | optax.GradientTransformation, *,
                     trainable: PyTree | None = None, loss_scale: LossScale | None = None,
                     model_state: PyTree = None,
                     seed: int | None = None, key: jax.Array | None = None,
                     _where: str = "TrainState.init") -> TrainState:
    """Returns the `TrainState` at step 0: `params`, ``optimizer.init(params)`` and step 0.

    `optimizer` is an optax transformation or a name for `make_optimizer` (default settings).
    With `trainable` (a mask from `funcgrad.trainable_mask`) the optimizer is wrapped in
    ``funcgrad.train_only(optimizer, trainable)``, as `make_train_step` does with the same
    mask: frozen leaves keep no optimizer state (an optimizer from ``funcgrad.train_only`` is
    already wrapped: give the step the same one). `loss_scale` (e.g.
    ``funcgrad.dynamic_loss_scale()``) adds its initial state; give `make_train_step` the same.
    A `funcgrad.grad_monitor` in the optimizer's chain sees the trained leaves only.
    `model_state` (a pytree of arrays: BatchNorm's running statistics) is the initial model
    state for a loss declared with ``has_state=True``; `seed` (an int) or `key` (a PRNG key,
    typed ``jax.random.key(0)`` or raw ``jax.random.PRNGKey(0)``) is the base key of a loss
    declared with ``takes_key=True`` (`funcgrad.train.loss`; step s draws ``fold_in(key, s)``).
    Raises TypeError for a `loss_scale` of the wrong kind, a
    `key` that is not a PRNG key or a `seed` that is not an int; ValueError if both `seed` and
    `key` are given. Raises TypeError for an ``nnx.Optimizer``, and for params that are an
    equinox module, an nnx Module, an nnx State with Variables other than ``nnx.Param``
    (BatchStat, RngCount...) or hold a non-array leaf: the message gives the split that fixes
    it (`funcgrad._library_objects`). Raises RuntimeError for float16 params where XLA cannot
    compile float16 (an x86 CPU without F16C: `funcgrad._platform`).
    """
    _check_kinds(loss_scale)
    check_optimizer(_where, optimizer)
    check_params(_where, params)  # equinox / nnx objects: the fix, not optax's error
    base_key = _base_key(seed, key, _where)
    half = first_half_leaf(params)
    if half is not None:
        require_dtype_compiles(half[1], _where, f"params{half[0]}")
    if model_state is not None:
        _check_model_state(model_state, _where)
    optimizer = make_optimizer(optimizer)
    if trainable is not None:
        optimizer = train_only(optimizer, trainable)
    return TrainState(params=params, opt_state=optimizer.init(params),
                      step=jnp.zeros((), jnp.int32),
                      loss_scale=None if loss_scale is None else loss_scale.init(),
                      model_state=model_state, key=base_key)


def _watch_trainable(opt_state: PyTree, params: PyTree, trainable: PyTree) -> PyTree:
    """`opt_state` with each `funcgrad.MonitorState` that covers the whole of `params` made
    again with the `trainable` mask, so that its frozen layers are not called vanishing (a
    monitor chained outside the step's `funcgrad.train_only` sees their zero gradients; one
    inside it sees the trained leaves only and is left as it is)."""
    from funcgrad.train.monitor import MonitorState

    def watched(node: Any) -> Any:
        if not isinstance(node, MonitorState) or node.monitor is None:
            return node
        mask = jax.tree.unflatten(jax.tree.structure(params),
                                  _leaf_flags(trainable, params, "TrainStep.init"))
        fresh = node.monitor.init(params, trainable=mask)
        return fresh if fresh.names == node.names else node
    return jax.tree.map(watched, opt_state, is_leaf=lambda x: isinstance(x, MonitorState))


def _base_key(seed: Any, key: Any, where: str = "TrainState.init") -> jax.Array | None:
    """The state's base PRNG key from `seed` or `key` (at most one)."""
    if seed is not None and key is not None:
        raise ValueError(f"{where}: give seed= or key=, not both.")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"{where}: seed must be an int, got {seed!r}; or pass "
                            "key=jax.random.key(seed).")
        return jax.random.key(int(seed))
    if key is None:
        return None
    dtype = jnp.result_type(key)
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == jnp.uint32 and jnp.shape(key)[-1:] == (2,)
    if not (typed and jnp.shape(key) == ()) and not (raw and jnp.ndim(key) == 1):
        raise TypeError(f"{where}: key must be one PRNG key (jax.random.key(0), or "
                        f"a raw jax.random.PRNGKey(0)), got {dtype} of shape {jnp.shape(key)}.")
    return jnp.asarray(key)


def _check_model_state(model_state: PyTree, where: str = "TrainState.init") -> None:
    """TypeError naming a model-state leaf that is not an array (it is a jit and scan carry)."""
    for path, leaf in zip(key_paths(model_state), jax.tree.leaves(model_state)):
        if not hasattr(leaf, "dtype") and not isinstance(leaf, (int, float, bool)):
            raise TypeError(f"{where}: model_state{keystr(path)} is a "
                            f"{type(leaf).__name__}; the model state must be a pytree of "
                            "arrays (keep functions and settings out of it, in the loss).")


def _trainable_of(optimizer: optax.GradientTransformation) -> PyTree | None:
    """The trainable mask of an optimizer wrapped by `funcgrad.train_only` (all its masks
    together when nested), or None."""
    masks = frozen_masks(optimizer)
    return None if not masks else masks[0] if len(masks) == 1 else _AllOf(masks)




def _check_state(state: TrainState, optimizer: optax.GradientTransformation,
                 loss_scale: LossScale | None = None, loss: Loss | None = None) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"the step takes a TrainState (from step.init(params)), got "
                        f"{type(state).__name__}.")
    if loss is not None:
        if loss.has_state and state.model_state is None:
            raise ValueError(f"the loss is declared with model state ({loss!r}) but the "
                             "TrainState has none. Create it with step.init(params, "
                             "model_state=...).")
        if not loss.has_state and state.model_state is not None:
            raise ValueError("the TrainState has a model state but the loss is not declared "
                             "with has_state=True: the state would never update (BatchNorm "
                             "statistics frozen at their init). Declare "
                             "funcgrad.Loss(loss_fn, has_state=True), the loss taking "
                             "model_state= and returning (loss, new_model_state).")
        if loss.takes_key and state.key is None:
            raise ValueError(f"the loss takes a PRNG key ({loss!r}) but the TrainState has "
                             "none. Create it with step.init(params) (seed=0 by default; "
                             "or key=jax.random.key(0)).")
    if loss_scale is not None and state.loss_scale is None:
        raise ValueError("this step scales the loss but the TrainState has no loss-scale state. "
                         "Create it with step.init(params): the step makes the state its "
                         "pieces need (funcgrad.mixed_precision's loss scale).")
    # The other way round the step would carry the state along unchanged: a loss scale
    # that never moves. Almost surely two different steps mixed.
    if loss_scale is None and state.loss_scale is not None:
        raise ValueError("the TrainState has a loss-scale state but this step scales no loss: "
                         "it would never update. Create the state with this step's "
                         "step.init(params).")
    shapes = lambda tree: [(jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(tree)]
    expected = jax.eval_shape(optimizer.init, state.params)
    got = state.opt_state
    if jax.tree.structure(expected) != jax.tree.structure(got) or shapes(expected) != shapes(got):
        frozen = lambda tree: "MaskedNode" in repr(jax.tree.structure(tree))
        cause = ("The step freezes leaves (trainable= or funcgrad.train_only) but the state was "
                 "created without the same mask: create it with this step's "
                 "step.init(params). " if frozen(expected) and not frozen(got) else
                 "The state was created with a trainable= mask (or funcgrad.train_only) that "
                 "this step does not have: pass the same trainable= to make_train_step. "
                 if frozen(got) and not frozen(expected) else "")
        short = lambda tree: (text if len(text := str(jax.tree.structure(tree))) <= 300
                              else text[:300] + " ...")
        raise ValueError(
            "the optimizer state in the TrainState was not made by this optimizer for these "
            f"params (structure or leaf shapes differ). {cause}\n  expected: {short(expected)}"
            f"\n  got: {short(got)}\nCreate the state with the step's own "
            "step.init(params).")


