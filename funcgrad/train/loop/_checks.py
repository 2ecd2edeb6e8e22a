"""`fit`'s checks of what it is given: the step and `evaluate` must be functions, the
step's first call must return ``(TrainState, metrics)`` with a loss and a norm, and an
accumulating step's groups must fit the data. Each error names the argument and the fix."""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from funcgrad.train.state import TrainState
from funcgrad.train.step import TrainStep


@dataclasses.dataclass(frozen=True, eq=False)
class ForeignStep:
    """A step `fit` was given that is not a `TrainStep` (a hand-written ``(state, batch) ->
    (state, metrics)`` function): the fields fit reads, none of a TrainStep's pieces. fit
    calls it once per batch (no compiled chunks, no re-run to explain a skip)."""
    fn: Callable
    loss: Any = None
    nonfinite: str | None = None
    detect_anomaly: bool = False
    accumulate: int | None = None
    tail: str | None = None
    unjitted: Callable | None = None
    unguarded: Callable | None = None
    mesh: Any = None
    data_axis: str | None = None
    shard_opt_state: bool = False

    def __call__(self, state: Any, *args: Any) -> Any:
        return self.fn(state, *args)

    def explain_skipped_update(self, state: Any, *args: Any) -> str:
        return ""


def as_step(step: Any) -> TrainStep | ForeignStep:
    """`step` itself when it is a `TrainStep`, else its `ForeignStep`."""
    return step if isinstance(step, (TrainStep, ForeignStep)) else ForeignStep(step)


def check_accumulation(n: int, batch_size: int, accumulate: int, tail: str | None) -> None:
    n_batches = math.ceil(n / batch_size)
    if accumulate > 1 and tail == "drop" and n_batches < accumulate:
        raise ValueError(
            f"fit: {n} examples in batches of {batch_size} make {n_batches} micro-batch"
            f"{'es' if n_batches > 1 else ''} per epoch, fewer than one group of "
            f"accumulate={accumulate}, and the step drops a partial group (tail='drop'): no "
            "update would ever be applied. Use a smaller batch_size or accumulate, or "
            "tail='apply'.")
    if accumulate > 1 and accumulate * batch_size > n:
        warnings.warn(
            f"fit: accumulate={accumulate} micro-batches of {batch_size} "
            f"({accumulate * batch_size} examples) exceed the {n} examples of x: each epoch is "
            f"one group of {n_batches} micro-batch{'es' if n_batches > 1 else ''}, so training "
            f"makes one update per epoch over all {n} examples (a full-batch step). For more "
            f"updates use accumulate <= {max(1, n_batches // 2)} or a smaller batch_size.",
            UserWarning, stacklevel=4)  # fit's caller (past fit's moved-keyword wrapper)


def called(step: Callable, state: TrainState, args: tuple, *, first: bool):
    """``step(state, *args)``; on the first call of a fit, a wrong kind of `step` is named."""
    if not first:
        return step(state, *args)
    ours = isinstance(step, TrainStep)
    fix = ("fit calls step(state, batch) with the TrainState and expects (TrainState, metrics) "
           "back; build it with step = funcgrad.make_train_step(loss_fn, optimizer) (a loss "
           "function is not a step).")
    try:
        out = step(state, *args)
    except Exception as error:
        if not ours:
            error.add_note(f"funcgrad.train.fit: `step` was not made by make_train_step. {fix}")
        raise
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], TrainState)):
        raise TypeError(f"funcgrad.train.fit: step returned {_kind(out)}, not "
                        f"(TrainState, metrics). {fix}")
    metrics = out[1]
    if not isinstance(metrics, Mapping):
        problem = f"its metrics are a {type(metrics).__name__}, not a dict"
    else:
        missing = [k for k in ("loss", "grad_norm") if k not in metrics]
        problem = (f"its metrics have no {' and no '.join(map(repr, missing))} "
                   f"(keys: {', '.join(map(repr, metrics)) or 'none'})") if missing else ""
    if problem:
        raise TypeError(
            f"funcgrad.train.fit: step returned (TrainState, metrics), but {problem}. fit records "
            "the loss and the pre-clip global gradient norm of every step and stops on a "
            "non-finite one, so a hand-written step returns metrics={'loss': loss, "
            "'grad_norm': optax.global_norm(grads)}; funcgrad.make_train_step(loss_fn, "
            "optimizer) builds such a step for you.")
    return out


def check_callables(step, evaluate) -> None:
    """A TypeError naming the argument when `step` or `evaluate` cannot be called (a string
    such as "adam" failed later as "'str' object is not callable")."""
    expected = {"step": "a function (state, batch) -> (TrainState, metrics), e.g. "
                        "funcgrad.make_train_step(loss_fn, optimizer)",
                "evaluate": "a function of the params returning {name: number}, e.g. "
                            "lambda params: {'accuracy': accuracy(params)}"}
    for name, value in (("step", step), ("evaluate", evaluate)):
        if value is not None and not callable(value) or name == "step" and value is None:
            shown = f" ({value!r})" if isinstance(value, str) else ""
            raise TypeError(f"fit: {name} must be {expected[name]}; got a "
                            f"{type(value).__name__}{shown}.")



def _kind(value: Any) -> str:
    """A short description of `value` for an error: an array's shape and dtype, else its type."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a {type(value).__name__}"
