"""`fit`'s ``evaluate``: a function of the params, or an evaluation split, run once per epoch;
its numbers go into the epoch's row under `EVAL_PREFIX`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.train.batching import Batches, rows

#: What `fit` puts before each name `evaluate` returns, in the epoch rows, the log and
#: metrics.json: evaluation numbers never share a key with the training numbers.
EVAL_PREFIX = "eval/"


def evaluator_of(evaluate: Any, step: Any, batch_size: int | None):
    """``evaluator(state) -> {name: number}`` for `evaluate` (a function, or an evaluation
    split whose mean loss under the step's loss is "loss": a pytree of arrays, taken
    `batch_size` rows at a time, or a `Batches`, taken its own batch size at a time, every
    row in order), or None."""
    if evaluate is None:
        return None
    if callable(evaluate):
        return lambda state: (evaluate(state.params) if getattr(state, "model_state", None)
                              is None else evaluate(state.params, state.model_state))
    loss = step.loss
    if loss is None or loss.has_state or loss.takes_key:
        raise TypeError(
            "fit: evaluate is an evaluation split, whose loss fit computes with the step's loss "
            "function; that needs a step from make_train_step whose loss takes no model state "
            "and no key (dropout and BatchNorm must run in evaluation mode: pass a function "
            "evaluate(params, model_state) -> {'loss': ..., 'accuracy': ...} instead).")
    tree = evaluate
    if isinstance(evaluate, Batches):
        tree, batch_size = evaluate.data, evaluate.batch_size
    try:
        n = rows(tree, "evaluate")
    except ValueError as error:
        raise ValueError(f"fit: {error}") from None
    size = batch_size or n

    @jax.jit
    def batch_loss(params, batch):
        value = loss.fn(params, batch)
        value = value[0] if loss.has_aux else value
        return jnp.sum(value) if jnp.ndim(value) else value * _rows_of(batch)

    def evaluator(state):
        total = 0.0
        for start in range(0, n, size):
            part = jax.tree.map(lambda a, start=start: a[start:start + size], tree)
            total += float(batch_loss(state.params, part))
        return {"loss": total / n}
    return evaluator


def _rows_of(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


def evaluated(scores: Any) -> dict[str, float]:
    """`evaluate`'s ``{name: number}`` as ``{"eval/name": float}``, checked."""
    if not isinstance(scores, Mapping):
        raise TypeError("fit: evaluate(params) must return a mapping such as "
                        f"{{'test_accuracy': 0.97}}, got {type(scores).__name__}.")
    out = {}
    for name, value in scores.items():
        if not isinstance(name, str):
            raise TypeError(f"fit: evaluate(params) returned the key {name!r}; use strings "
                            "such as 'test_accuracy'.")
        if np.size(value) != 1:
            raise TypeError(f"fit: evaluate(params)[{name!r}] has shape {np.shape(value)}; "
                            "each value must be one number (reduce it, e.g. with .mean()).")
        out[EVAL_PREFIX + name] = float(np.asarray(value).reshape(()))
    return out
