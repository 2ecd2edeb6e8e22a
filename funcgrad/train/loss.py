"""The loss contract: one signature for losses with model state, a PRNG key and aux outputs.

Every part of funcgrad that trains (`funcgrad.make_train_step`, accumulation, mixed precision,
the monitor, ``detect_anomaly``, `funcgrad.train.fit`) and every adapter of `funcgrad.interop`
speaks this one contract. A loss is called as

    loss_fn(params, batch)                                  # the plain form
    loss_fn(params, batch, *, model_state=ms)               # has_state=True
    loss_fn(params, batch, *, key=k)                        # takes_key=True
    loss_fn(params, batch, *, model_state=ms, key=k)        # both

and returns

    loss                                  # neither aux nor state
    (loss, aux)                           # has_aux=True (as jax.value_and_grad(has_aux=True))
    (loss, new_model_state)               # has_state=True
    (loss, (new_model_state, aux))        # has_state=True and has_aux=True

* `params` are the differentiated leaves; `model_state` is carried but never differentiated
  (BatchNorm's running statistics, counters): the loss returns its new value, with the same
  structure, shapes and dtypes.
* `key` is a fresh PRNG key per step (dropout): the train step derives it from the
  `TrainState`'s base key and step count (``jax.random.fold_in(key, step)``), so a run is
  reproducible and a resumed run draws the same keys.
* `aux` is any pytree of arrays (logits, accuracy counts); the train step returns it as
  ``metrics["aux"]``.

`Loss` carries the flags with the function, so a loss is declared once and every tool reads
it the same way: ``make_train_step(Loss(fn, has_state=True), optimizer)``. The analysis tools
(`funcgrad.check_grads`, `funcgrad.explain_grads`, `funcgrad.find_nonfinite`, ...) take plain
``f(params, *args) -> scalar`` functions: `Loss.bind` fixes the model state and key and drops
the aux.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from funcgrad._paths import key_paths, keystr

PyTree = Any


class Precision(NamedTuple):
    """A loss's compute dtype and loss scale (`funcgrad.mixed_precision`)."""
    compute_dtype: Any
    loss_scale: Any = None  # a funcgrad.LossScale, or None

    def __repr__(self) -> str:  # a LossScale is two functions: named, not printed
        scale = "" if self.loss_scale is None else ", loss_scale"
        return f"mixed_precision({jnp.dtype(self.compute_dtype).name}{scale})"


class Accumulation(NamedTuple):
    """A loss's accumulation over micro-batches (`funcgrad.accumulate`)."""
    k: int
    tail: str = "apply"

    def __repr__(self) -> str:
        return f"accumulate({self.k}, tail={self.tail!r})"


class LossOutput(NamedTuple):
    """A loss's outputs in one form: `loss` (shape () or (m,)), the new `model_state` (None
    without has_state) and `aux` (None without has_aux)."""
    loss: jax.Array
    model_state: PyTree = None
    aux: PyTree = None


def _flags(has_aux: bool, has_state: bool, takes_key: bool) -> str:
    named = [n for n, v in (("has_aux", has_aux), ("has_state", has_state),
                            ("takes_key", takes_key)) if v]
    return ", ".join(f"{n}=True" for n in named) or "no flags (the plain form)"


class Loss:
    """A loss function with its contract: whether it has aux outputs, model state, a key.

    Args:
      fn: the loss, called and returning as in the module docstring.
      has_aux: `fn` returns ``(loss, aux)`` (with state: ``(loss, (new_model_state, aux))``).
      has_state: `fn` takes ``model_state=`` and returns the new model state.
      takes_key: `fn` takes ``key=``, a PRNG key (shape (), a typed key array, or a uint32
        ``(2,)`` raw key, as the state was created with).
    Raises:
      TypeError: if `fn` is not callable or a flag is not a bool, or if `fn`'s signature
        contradicts a flag (``has_state=True`` for a function without a ``model_state``
        parameter, a required ``key`` parameter without ``takes_key=True``, ...).
    """

    def __init__(self, fn: Callable, *, has_aux: bool = False, has_state: bool = False,
                 takes_key: bool = False):
        if isinstance(fn, Loss):
            raise TypeError("Loss(fn): fn is already a funcgrad.Loss; use funcgrad.as_loss(fn) "
                            "to accept either.")
        if getattr(fn, "_is_train_step", False):
            raise TypeError("a TrainStep was given where a loss is expected: the loss pieces "
                            "(funcgrad.Loss, mixed_precision, accumulate) and make_train_step "
                            "take the loss function; apply them to it, then build the step "
                            "(make_train_step(fg.mixed_precision(loss_fn, ...), optimizer)).")
        if not callable(fn):
            raise TypeError(f"Loss(fn): fn must be the loss function, got "
                            f"{type(fn).__name__}.")
        for name, value in (("has_aux", has_aux), ("has_state", has_state),
                            ("takes_key", takes_key)):
            if not isinstance(value, bool):
                raise TypeError(f"Loss: {name} must be True or False, got {value!r}.")
        self.fn, self.has_aux, self.has_state, self.takes_key = fn, has_aux, has_state, takes_key
        _check_signature(fn, has_state=has_state, takes_key=takes_key)
        functools.update_wrapper(self, fn, updated=())

    #: How the train step evaluates the loss, set by the pieces that transform it:
    #: `funcgrad.mixed_precision` (a `Precision`) and `funcgrad.accumulate` (an
    #: `Accumulation`). None: in the params' own dtype, one update per batch.
    precision: Precision | None = None
    accumulation: Accumulation | None = None

    def _marked(self, **marks: Any) -> Loss:
        """A copy of this loss with `precision` and/or `accumulation` set (the function and
        its flags shared)."""
        out = Loss(self.fn, has_aux=self.has_aux, has_state=self.has_state,
                   takes_key=self.takes_key)
        out.precision, out.accumulation = self.precision, self.accumulation
        for name, value in marks.items():
            setattr(out, name, value)
        return out

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        pieces = "".join(f", {piece!r}" for piece in (self.precision, self.accumulation)
                         if piece is not None)
        return f"Loss({name}, {_flags(self.has_aux, self.has_state, self.takes_key)}{pieces})"

    def __call__(self, params: PyTree, batch: Any, *, model_state: PyTree = None,
                 key: jax.Array | None = None) -> LossOutput:
        """Calls the loss under its contract and returns a validated `LossOutput`.

        Raises:
          ValueError: if a declared model state or key is missing (None), or the returned
            value does not have the declared form (a tuple where a scalar was declared, or
            the other way round; a new model state whose structure, shapes or dtypes differ
            from `model_state`).
          TypeError: if the aux holds something that is not an array.
        """
        kwargs = {}
        if self.has_state:
            if model_state is None:
                raise ValueError(f"{self!r} declares model state, but none was given. In a "
                                 "train step, create the state with step.init(params, "
                                 "model_state=...); for check_grads and the other "
                                 "analysis tools pass loss.bind(model_state, key); or declare "
                                 "has_state=False.")
            kwargs["model_state"] = model_state
        if self.takes_key:
            if key is None:
                raise ValueError(f"{self!r} takes a PRNG key, but none was given. In a train "
                                 "step, create the state with step.init(params) (seed=0 "
                                 "by default, or key=jax.random.key(0)); for the "
                                 "analysis tools pass loss.bind(model_state, key=jax.random."
                                 "key(0)).")
            kwargs["key"] = key
        out = self.fn(params, batch, **kwargs)
        return self._unpacked(out, model_state, check_state=self._check_state)

    #: Whether a call checks the new model state's layout (`bind` does not: it drops it, and
    #: an analysis tool may evaluate the loss in float64, which widens the statistics).
    _check_state = True

    def _unpacked(self, out: Any, model_state: PyTree, *, check_state: bool = True
                  ) -> LossOutput:
        paired = self.has_aux or self.has_state
        if not paired:
            if isinstance(out, (tuple, list)):
                raise ValueError(
                    f"loss_fn returned a {type(out).__name__} of {len(out)}, but it was "
                    f"declared with {_flags(False, False, self.takes_key)}, which returns the "
                    "loss alone. If the second item is auxiliary output, declare has_aux=True; "
                    "if it is the new model state (e.g. BatchNorm statistics), declare "
                    "has_state=True (funcgrad.Loss(loss_fn, has_state=True)) and create the "
                    "state with step.init(params, model_state=...).")
            return LossOutput(out)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            form = ("(loss, (new_model_state, aux))" if self.has_aux and self.has_state
                    else "(loss, new_model_state)" if self.has_state else "(loss, aux)")
            got = (f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list))
                   else f"a single array of shape {jnp.shape(out)}" if hasattr(out, "dtype")
                   else f"a single {type(out).__name__}")
            raise ValueError(f"{self!r} must return {form}, got {got}. Return the declared "
                             "form, or change the flags.")
        loss, rest = out
        aux, new_state = None, None
        if self.has_state and self.has_aux:
            if not (isinstance(rest, (tuple, list)) and len(rest) == 2):
                raise ValueError(f"{self!r} must return (loss, (new_model_state, aux)); the "
                                 f"second item is a {type(rest).__name__}, not a pair.")
            new_state, aux = rest
        elif self.has_state:
            new_state = rest
        else:
            aux = rest
        if self.has_state and check_state:
            _check_same_state(model_state, new_state)
        if self.has_aux:
            _check_aux(aux)
        return LossOutput(loss, new_state, aux)

    def bind(self, model_state: PyTree = None, key: jax.Array | None = None
             ) -> Callable[[PyTree, Any], jax.Array]:
        """Returns ``f(params, batch) -> loss``: this loss with `model_state` and `key` fixed
        and the aux and new model state dropped, for the analysis tools (`check_grads`,
        `explain_grads`, `find_nonfinite`, `trace`, taps), which differentiate plain functions.
        Raises ValueError at the call if a declared state or key is None."""
        unchecked = Loss(self.fn, has_aux=self.has_aux, has_state=self.has_state,
                         takes_key=self.takes_key)
        unchecked._check_state = False

        def bound(params, batch):
            return unchecked(params, batch, model_state=model_state, key=key).loss
        bound.__name__ = getattr(self.fn, "__name__", "loss")
        bound.__qualname__ = getattr(self.fn, "__qualname__", bound.__name__)
        return bound


def _check_signature(fn: Callable, *, has_state: bool, takes_key: bool) -> None:
    """TypeError when `fn`'s parameters contradict the declared flags (the call would fail
    with Python's bare "unexpected keyword argument" deep inside a trace)."""
    import inspect

    try:
        params = inspect.signature(fn, follow_wrapped=False).parameters
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    name = getattr(fn, "__qualname__", type(fn).__name__)
    for arg, flag, declared in (("model_state", "has_state", has_state),
                                ("key", "takes_key", takes_key)):
        param = params.get(arg)
        accepts = open_kwargs or (param is not None and param.kind in kinds)
        required = (param is not None and param.kind in kinds
                    and param.default is inspect.Parameter.empty)
        if declared and not accepts:
            raise TypeError(f"{flag}=True, but {name} takes no {arg}= argument. Add the "
                            f"parameter (def {name}(params, batch, *, {arg}): ...) or drop "
                            f"{flag}=True.")
        if not declared and required:
            raise TypeError(f"{name} requires {arg}=, but the loss is not declared with "
                            f"{flag}=True, so it would never be passed. Pass {flag}=True to "
                            "make_train_step (or funcgrad.Loss), or give the parameter a "
                            "default.")


def as_loss(fn: Callable | Loss, *, has_aux: bool = False, has_state: bool = False,
            takes_key: bool = False) -> Loss:
    """`fn` as a `Loss`: returned as is when it already is one (a flag given as True must then
    agree with it), else ``Loss(fn, has_aux=..., has_state=..., takes_key=...)``.

    Raises:
      ValueError: if `fn` is a Loss and a flag set here contradicts it.
    """
    if isinstance(fn, Loss):
        asked = {"has_aux": has_aux, "has_state": has_state, "takes_key": takes_key}
        clash = [n for n, v in asked.items() if v and not getattr(fn, n)]
        if clash:
            raise ValueError(f"{fn!r} was declared without {', '.join(clash)}, but "
                             f"{', '.join(f'{n}=True' for n in clash)} was passed here. Declare "
                             "the loss once: in Loss(...) or here, not both.")
        return fn
    return Loss(fn, has_aux=has_aux, has_state=has_state, takes_key=takes_key)


def _describe(tree: PyTree) -> dict[str, tuple]:
    flat = zip(key_paths(tree), jax.tree.leaves(tree))  # nnx: no .value level (_paths)
    return {keystr(p): (jnp.shape(x), jnp.result_type(x)) for p, x in flat}


def _check_same_state(old: PyTree, new: PyTree) -> None:
    """ValueError naming the leaves where `new` differs from `old` in structure, shape or
    dtype: a model state must keep its layout from step to step (it is a jit and scan carry)."""
    if jax.tree.structure(old) == jax.tree.structure(new):
        pairs = zip(jax.tree.leaves(old), jax.tree.leaves(new))
        if all(jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
               for a, b in pairs):
            return
    before, after = _describe(old), _describe(new)
    lines = [f"  model_state{p}: missing from the new state" for p in before if p not in after]
    lines += [f"  model_state{p}: new, not in the state given" for p in after if p not in before]
    lines += [f"  model_state{p}: {before[p][0]} {before[p][1]} -> {after[p][0]} {after[p][1]}"
              for p in before if p in after and before[p] != after[p]]
    if not lines:
        lines = [f"  structure {jax.tree.structure(old)} -> {jax.tree.structure(new)}"]
    raise ValueError(
        "the loss returned a model state that differs from the one it was given:\n"
        + "\n".join(lines[:12]) + ("\n  ..." if len(lines) > 12 else "")
        + "\nThe new model state must keep the structure, shapes and dtypes of the old one "
        "(cast updated statistics back, e.g. new.astype(old.dtype)); return the whole state, "
        "not only the part that changed.")


def _check_aux(aux: PyTree) -> None:
    for path, leaf in zip(key_paths(aux), jax.tree.leaves(aux)):
        if not hasattr(leaf, "dtype") and not isinstance(leaf, (int, float, bool, complex)):
            raise TypeError(
                f"the loss's aux must be a pytree of arrays; aux{keystr(path)} "
                f"is a {type(leaf).__name__}. Return arrays (e.g. jnp.asarray(x)) and keep "
                "other values out of the loss.")
