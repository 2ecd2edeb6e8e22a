"""`from_linen`: a flax linen module and its variables as a `funcgrad.interop.Model`.

flax is imported here only when the adapter is called, so ``import funcgrad`` never needs it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from funcgrad._adapter_warnings import MomentumWarning
from funcgrad._user_line import warn
from funcgrad.interop._model import MOMENTUM_NOTE_BELOW, Model, _wrong_module, momentum_note

_NEEDS_VARIABLES = (
    "from_linen needs the module and its variables, as module.init returns them:\n"
    "    variables = module.init(jax.random.key(0), x)      # {'params': ..., 'batch_stats': ...}\n"
    "    m = funcgrad.interop.from_linen(module, variables)")


def from_linen(module: Any, variables: Mapping[str, Any], *,
               rngs: Sequence[str] = ("dropout",)) -> Model:
    """Returns a `Model` for a flax linen module and its variables.

    ``m.params`` is ``variables["params"]`` (leaves named ``params['Conv_0']['kernel']``);
    ``m.model_state`` every other collection (``{"batch_stats": ...}``), or None when there
    is none. ``m.apply(params, model_state, *args, key=k, **kwargs)`` runs
    ``module.apply({"params": params, **model_state}, *args, rngs=..., mutable=[the
    model_state collections], **kwargs)``, the call of flax's own training loop, and returns
    the outputs and the updated collections. `kwargs` reach the module (``train=True``).

    Modes: linen has no mode of its own; ``train=`` reaches the module's ``__call__`` like
    any keyword. An evaluation call (``train=False``) that changes the model state warns
    (`funcgrad.interop.EvalModeWarning`): a BatchNorm whose ``use_running_average`` does not
    follow ``train``.

    Warns:
      funcgrad.interop.MomentumWarning: once per BatchNorm, at the first ``m.apply`` that
        runs it (a compact module's layers exist only then), when its ``momentum`` is below
        0.5: flax's momentum is the decay of the running average (0.99 by default), PyTorch's
        (0.1) the weight of the new batch.

    Args:
      module: a ``flax.linen.Module`` (unbound, as written: ``CNN()``).
      variables: the dict ``module.init(key, *args)`` returned, with a ``"params"``
        collection; a ``FrozenDict`` is accepted and rebuilt as one.
      rngs: the rng streams the module draws from in training (``nn.Dropout`` uses
        ``"dropout"``). With one stream it gets the step's key itself, as in flax's loop
        (``rngs={"dropout": fold_in(key, step)}``); with several, stream i gets
        ``jax.random.fold_in(key, i)``. ``()`` for a module with no randomness: its loss
        then takes no key.
    Returns:
      a `funcgrad.interop.Model`; ``m.rebuild(params, model_state)`` is the variables dict.
    Raises:
      TypeError: if `module` is not a linen Module (an nnx or equinox module is pointed to its
        adapter), or `variables` is missing or not a dict of collections.
      ValueError: if `variables` has no ``"params"`` collection (e.g. ``variables["params"]``
        was passed instead of the whole dict).
    """
    import flax.core
    import flax.linen as nn

    if not isinstance(module, nn.Module):
        raise TypeError(_wrong_module("from_linen", "flax.linen", module))
    if variables is None:
        raise TypeError(_NEEDS_VARIABLES)
    if not isinstance(variables, Mapping):
        extra = (" (a flax TrainState: pass {'params': state.params, 'batch_stats': "
                 "state.batch_stats})" if hasattr(variables, "apply_fn") else "")
        raise TypeError(f"from_linen: variables must be the dict of collections module.init "
                        f"returned, got {type(variables).__name__}{extra}.\n" + _NEEDS_VARIABLES)
    if "params" not in variables:
        keys = list(variables)
        hint = (" These look like the contents of variables['params'] (layer names): pass the "
                "whole dict module.init returned." if any(not k.islower() or "_" in k
                                                          for k in map(str, keys)) else "")
        raise ValueError(f"from_linen: variables has no 'params' collection (it has "
                         f"{keys}).{hint}\n" + _NEEDS_VARIABLES)
    if isinstance(rngs, str) or not all(isinstance(s, str) for s in rngs):
        raise TypeError(f"from_linen: rngs must be a sequence of stream names such as "
                        f"('dropout',), got {rngs!r}.")
    rngs = tuple(rngs)
    frozen = isinstance(variables, flax.core.FrozenDict)
    if isinstance(variables, flax.core.FrozenDict):  # frozen: a plain dict from here on
        variables = flax.core.unfreeze(variables)
    params = variables["params"]
    collections = [c for c in variables if c != "params"]
    model_state = {c: variables[c] for c in collections} or None

    noted: set[tuple] = set()  # the BatchNorms whose momentum was noted (once each)

    def note_momentum(next_fun, args, kwargs, context):
        """A method interceptor: notes a BatchNorm's momentum in PyTorch's meaning."""
        layer = context.module
        if isinstance(layer, nn.BatchNorm) and context.method_name == "__call__":
            try:
                path = tuple(layer.path)
            except (AttributeError, ValueError):  # an unbound layer: no path to name it by
                path = (layer.name,)
            momentum = layer.momentum
            if (path not in noted and isinstance(momentum, (int, float))
                    and momentum < MOMENTUM_NOTE_BELOW):
                noted.add(path)
                name = "model_state['batch_stats']" + "".join(f"[{p!r}]" for p in path)
                warn(momentum_note(name, "nn.BatchNorm", momentum, "flax"), MomentumWarning)
        return next_fun(*args, **kwargs)

    def apply(params, model_state, args, kwargs, key, train):
        if train is not None:
            kwargs = {**kwargs, "train": train}
        variables = {"params": params, **(model_state or {})}
        streams = {} if key is None else (
            {rngs[0]: key} if len(rngs) == 1
            else {s: jax.random.fold_in(key, i) for i, s in enumerate(rngs)})
        try:
            with nn.intercept_methods(note_momentum):
                if model_state is None:
                    return module.apply(variables, *args, rngs=streams, **kwargs), None
                outputs, updated = module.apply(variables, *args, rngs=streams,
                                                mutable=collections, **kwargs)
        except flax.errors.InvalidRngError as e:
            raise ValueError(_rng_message(e, key, rngs)) from None
        return outputs, {c: updated[c] for c in collections}

    def rebuild(params, model_state):
        variables = {"params": params, **(model_state or {})}
        return flax.core.freeze(variables) if frozen else variables

    return Model(library="flax.linen", params=params, model_state=model_state, apply=apply,
                 rebuild=rebuild, takes_key=bool(rngs),
                 key_note="from_linen(..., rngs=()) gives the module no rng stream; name "
                          "the streams it draws from, e.g. rngs=('dropout',).")


def _rng_message(error: Exception, key: Any, rngs: tuple[str, ...]) -> str:
    text = str(error).split(" (https://")[0]
    if key is None:
        return (f"the linen module needs a PRNG key: {text}. Pass key= to m.apply (e.g. "
                "key=jax.random.key(0)), or apply it in evaluation mode (train=False); "
                "a loss from m.loss gets the train step's key when it takes one "
                "(m.init_state(step, seed=0) gives the state its key).")
    return (f"the linen module draws from an rng stream the adapter does not give it: {text}. "
            f"The adapter gives {list(rngs)}: pass from_linen(module, variables, "
            "rngs=(...every stream the module uses...)).")

