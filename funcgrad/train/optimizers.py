"""Optimizers by name, and the learning rate an optimizer state says it applied."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from funcgrad import _user_line
from funcgrad._library_objects import check_optimizer
from funcgrad._paths import keystr

#: Optimizer names accepted wherever an optimizer is asked for, and what they build.
OPTIMIZERS: dict[str, str] = {
    "sgd": "optax.sgd(learning_rate)",
    "momentum": "optax.sgd(learning_rate, momentum=momentum)  # v = momentum*v + g; p -= lr*v",
    "adam": "optax.adam(learning_rate)",
}




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
        ``funcgrad.accumulate(loss, K)`` one per K micro-batches (not per micro-batch or
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


def warn_unreported_schedule(opt_state: optax.OptState) -> None:
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


