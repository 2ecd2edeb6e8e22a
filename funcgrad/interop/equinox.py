"""`from_equinox`: an equinox module (and its ``eqx.nn.State``) as a `funcgrad.interop.Model`.

equinox is imported here only when the adapter is called, so ``import funcgrad`` never needs it.
"""
from __future__ import annotations

import inspect
from collections.abc import Hashable
from typing import Any

import jax

from funcgrad._adapter_warnings import MomentumWarning, StaticFieldWarning
from funcgrad._library_objects import static_field_message, static_floats
from funcgrad._paths import keystr
from funcgrad._user_line import warn
from funcgrad.interop._model import (
    MOMENTUM_NOTE_BELOW,
    Model,
    _call_takes,
    _wrong_module,
    momentum_note,
)


def from_equinox(model: Any, state: Any = None, *,
                 axis_name: Hashable | None = "batch") -> Model:
    """Returns a `Model` for an equinox module and, for a stateful one, its ``eqx.nn.State``.

    ``m.params`` is ``eqx.partition(model, eqx.is_inexact_array)[0]``: the module with its
    floating arrays and None elsewhere (leaves named ``params.layers[2].weight``); the rest
    (activation functions, integer arrays, flags) is closed over. ``m.model_state`` is
    `state` (BatchNorm's running statistics), or None.

    ``m.apply(params, model_state, *args, key=k)`` calls the model as equinox's own examples
    do: one example at a time under ``jax.vmap(model, axis_name=axis_name, in_axes=(0,
    None), out_axes=(0, None))`` over the leading (batch) axis of `args`, so that
    ``eqx.nn.BatchNorm(..., axis_name="batch")`` averages over the batch; a stateful model
    is called ``model(*args, state, key=...)`` and returns ``(outputs, state)``, a stateless
    one ``model(*args, key=...)``. The key is split into one key per example
    (``jax.random.split(key, batch)``); it is not passed when None, nor to a model whose
    ``__call__`` has no ``key`` argument (its loss then takes no key). With ``axis_name=None``
    the model is called once on the whole batch with the key itself (a model that batches
    itself).

    Modes: ``m.apply(..., train=False)`` runs ``eqx.nn.inference_mode(model, True)``
    (dropout off, BatchNorm on its running statistics), ``train=True`` ``inference_mode(model,
    False)``; a model whose ``__call__`` takes ``train`` also gets it as an argument. A model
    with an ``eqx.nn.BatchNorm``, an ``eqx.nn.Dropout`` or any module with an ``inference``
    field needs one of them (``m.apply`` and ``m.loss`` refuse None, naming the layers); a
    model without runs as given. An evaluation call that changes the state warns
    (`funcgrad.interop.EvalModeWarning`).

    Warns:
      funcgrad.interop.StaticFieldWarning: once per Python float field (``self.scale =
        0.5``) outside equinox's own layers: equinox treats it as static, so it is not in
        ``m.params`` and never trains; the message gives the fix (``eqx.tree_at(lambda m:
        m.scale, model, jnp.asarray(0.5))``, or ``eqx.field(static=True)`` for a setting).
      funcgrad.interop.MomentumWarning: for an ``eqx.nn.BatchNorm`` with ``momentum`` below
        0.5 (equinox's momentum is the decay of the running average, 0.99 by default;
        PyTorch's 0.1 is the weight of the new batch).

    Args:
      model: an ``eqx.Module`` with at least one floating array.
      state: the ``eqx.nn.State`` of ``eqx.nn.make_with_state(Model)(...)``, or None for a
        stateless model.
      axis_name: the vmap axis name the model's BatchNorm uses, or None (see above).
    Returns:
      a `funcgrad.interop.Model`; ``m.rebuild(params, model_state)`` is the module, or
      ``(module, state)`` for a stateful one.
    Raises:
      TypeError: if `model` is not an equinox module (a ``(model, state)`` pair is pointed to
        ``from_equinox(model, state)``; a flax module to its adapter), or `state` is not an
        ``eqx.nn.State``.
      ValueError: if the model holds no floating array (nothing to differentiate).
    """
    import equinox as eqx

    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[1], eqx.nn.State):
        raise TypeError("from_equinox got a (model, state) pair, as eqx.nn.make_with_state "
                        "returns it; pass them separately: from_equinox(model, state).")
    if not isinstance(model, eqx.Module):
        raise TypeError(_wrong_module("from_equinox", "equinox", model))
    if state is not None and not isinstance(state, eqx.nn.State):
        raise TypeError(f"from_equinox: state must be the eqx.nn.State of "
                        f"eqx.nn.make_with_state(Model)(...), or None; got "
                        f"{type(state).__name__}.")
    accepts_key = _accepts_key(model)
    # eqx.Module declares no __call__; the model's class does (`def __call__(self, x, *, train)`).
    takes_train = _call_takes(model.__call__, "train")  # type: ignore[operator]
    params, static = eqx.partition(model, eqx.is_inexact_array)
    if not jax.tree.leaves(params):
        raise ValueError(f"from_equinox: {type(model).__name__} holds no floating arrays, so "
                         "there is nothing to differentiate.")
    for _, path, value in static_floats(model):
        warn(static_field_message("model", [(path, value)], "from_equinox (as eqx.partition("
                                  "model, eqx.is_inexact_array)) leaves"), StaticFieldWarning)
    modules = _modules(model, eqx)
    for path, module in modules:
        if (isinstance(module, eqx.nn.BatchNorm)
                and float(module.momentum) < MOMENTUM_NOTE_BELOW):
            warn(momentum_note(f"model{keystr(path)}", "eqx.nn.BatchNorm", module.momentum,
                               "equinox"), MomentumWarning)

    def call(model, args, state, key, kwargs):
        if key is not None:
            kwargs = {**kwargs, "key": key}
        if state is None:
            return model(*args, **kwargs), None
        result = model(*args, state, **kwargs)
        if not (isinstance(result, tuple) and len(result) == 2
                and isinstance(result[1], eqx.nn.State)):
            raise ValueError(
                f"from_equinox: the model was given a state, so model(*args, state) must "
                f"return (outputs, new_state), as eqx.nn.BatchNorm's callers do; it returned "
                f"{type(result).__name__}.")
        return result

    def apply(params, model_state, args, kwargs, key, train):
        if key is not None and not accepts_key:
            raise ValueError(f"m.apply(key=...): {type(model).__name__}.__call__ takes no "
                             "key= argument; pass key=None (m.loss takes no key for it).")
        module = eqx.combine(params, static)
        if train is not None:
            module = eqx.nn.inference_mode(module, not train)
            if takes_train:
                kwargs = {**kwargs, "train": train}
        if axis_name is None:
            return call(module, args, model_state, key, kwargs)
        sizes = {jax.numpy.shape(x)[0] for x in jax.tree.leaves(args) if jax.numpy.ndim(x)}
        if len(sizes) != 1:
            raise ValueError(
                f"from_equinox: the model runs per example under jax.vmap over the leading "
                f"axis of its inputs, which must all have the same length; got leading "
                f"lengths {sorted(sizes)}. For a model that batches itself pass "
                "from_equinox(model, state, axis_name=None).")
        keys = None if key is None else jax.random.split(key, sizes.pop())
        return jax.vmap(lambda a, s, k: call(module, a, s, k, kwargs), axis_name=axis_name,
                        in_axes=(0, None, None if keys is None else 0),
                        out_axes=(0, None))(args, model_state, keys)

    def rebuild(params, model_state):
        module = eqx.combine(params, static)
        return module if model_state is None else (module, model_state)

    return Model(library="equinox", params=params, model_state=state, apply=apply,
                 rebuild=rebuild, takes_key=accepts_key,
                 key_note=f"{type(model).__name__}.__call__ takes no key= argument.",
                 state_in_compute_dtype=True,  # eqx.nn.BatchNorm: lax.select of one dtype
                 mode_layers=_mode_layers(modules, eqx),
                 mode_calls=("eqx.nn.inference_mode(model, False)",
                             "eqx.nn.inference_mode(model)"),
                 state_names=None if state is None else _state_names(model, state, eqx))


def _modules(model: Any, eqx: Any) -> list[tuple[tuple, Any]]:
    """``(path, module)`` of `model` and every equinox module inside it, depth first."""
    found = []

    def walk(node, prefix):
        found.append((prefix, node))
        is_sub = lambda x: x is not node and isinstance(x, eqx.Module)
        for path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_sub)[0]:
            if is_sub(leaf):
                walk(leaf, prefix + path)

    walk(model, ())
    return found


def _mode_layers(modules: list[tuple[tuple, Any]], eqx: Any) -> list[str]:
    """The modules whose behaviour `eqx.nn.inference_mode` changes: ``model.bn
    (eqx.nn.BatchNorm)``, ``model.gate (Gate, its inference field)``."""
    found = []
    for path, module in modules:
        name = f"model{keystr(path)}"
        if isinstance(module, (eqx.nn.BatchNorm, eqx.nn.Dropout)):
            found.append(f"{name} (eqx.nn.{type(module).__name__})")
        elif hasattr(module, "inference"):
            found.append(f"{name} ({type(module).__name__}, its inference field)")
    return found


def _state_names(model: Any, state: Any, eqx: Any) -> list[str] | None:
    """One name per leaf of `state` by the module path of its ``eqx.nn.StateIndex``
    (``model.bn.ema_state_index[0]``); None (generic names) where that cannot be read."""
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)
    names: dict[int, str] = {}
    try:
        for path, index in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_index)[0]:
            if is_index(index):
                for inner, leaf in jax.tree_util.tree_flatten_with_path(state.get(index))[0]:
                    names[id(leaf)] = f"model{keystr(path)}{keystr(inner)}"
    except (AttributeError, KeyError, TypeError, ValueError):  # generic names, then
        return None
    leaves = jax.tree.leaves(state)
    if not all(id(leaf) in names for leaf in leaves):
        return None
    return [names[id(leaf)] for leaf in leaves]


def _accepts_key(model: Any) -> bool:
    """Whether ``model.__call__`` takes a ``key=`` argument (or ``**kwargs``)."""
    try:
        parameters = inspect.signature(model.__call__).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume equinox's convention
        return True
    return any(p.name == "key" or p.kind is p.VAR_KEYWORD for p in parameters)
