"""`from_nnx`: a flax nnx module as a `funcgrad.interop.Model`.

flax is imported here only when the adapter is called, so ``import funcgrad`` never needs it.
"""
from __future__ import annotations

from typing import Any

import jax

from funcgrad._adapter_warnings import MomentumWarning
from funcgrad._user_line import warn
from funcgrad.interop._model import (
    MOMENTUM_NOTE_BELOW,
    Model,
    _call_takes,
    _wrong_module,
    momentum_note,
)

_OPTIMIZER = (
    "from_nnx got an nnx.Optimizer; funcgrad keeps the optimizer state itself. Pass the model "
    "and the optax transformation separately:\n"
    "    m = funcgrad.interop.from_nnx(model)\n"
    "    step = funcgrad.make_train_step(m.loss(objective), optax.adam(1e-3))"
    "  # not nnx.Optimizer\n"
    "    state = m.init_state(step)")


def from_nnx(model: Any) -> Model:
    """Returns a `Model` for a flax nnx module (``nnx.split`` into params and the rest).

    ``m.params`` holds every ``nnx.Param`` as a plain nested dict of arrays (leaves named
    ``params['bn1']['scale']``, no Variable ``.value`` level); ``m.model_state`` every other
    Variable the same way (BatchNorm's ``mean``/``var``, each ``Rngs`` stream's ``key`` and
    integer ``count``), or None when there is none. ``m.apply(params, model_state, *args)``
    merges them into the module (``nnx.merge``), calls ``model(*args, **kwargs)`` and splits
    the state again, so BatchNorm's statistics and the dropout streams' counts advance
    exactly as in nnx's own loop (``nnx.Optimizer`` + ``nnx.value_and_grad``). The loss
    therefore takes no key from funcgrad (``takes_key=False``): dropout masks come from the
    model's own ``nnx.Rngs``, reproducibly.

    Modes: ``m.apply(..., train=True)`` runs the module as after ``model.train()``,
    ``train=False`` as after ``model.eval()`` (dropout off, BatchNorm on its running
    statistics); a module whose ``__call__`` takes ``train`` also gets it as an argument. A
    module with an ``nnx.BatchNorm``, an ``nnx.Dropout`` or any submodule with a
    ``deterministic`` or ``use_running_average`` attribute (what ``train()``/``eval()`` set)
    needs one of them (``m.apply`` and ``m.loss`` refuse None, naming the layers); one
    without runs in the mode it was given in. An evaluation call that changes the state
    warns (`funcgrad.interop.EvalModeWarning`). The given module is never modified.

    Warns:
      funcgrad.interop.MomentumWarning: for an ``nnx.BatchNorm`` with ``momentum`` below 0.5
        (flax's momentum is the decay of the running average, 0.99 by default; PyTorch's 0.1
        is the weight of the new batch).

    Args:
      model: an ``nnx.Module`` with at least one ``nnx.Param``.
    Returns:
      a `funcgrad.interop.Model`; ``m.rebuild(params, model_state)`` is a new module.
    Raises:
      TypeError: for an ``nnx.Optimizer`` (the message says what to pass instead), a linen or
        equinox module (pointed to its adapter), a module without ``__call__``, or anything
        else that is not an nnx module.
      ValueError: if the module has no ``nnx.Param``.
    """
    from flax import nnx

    if isinstance(model, nnx.Optimizer):
        raise TypeError(_OPTIMIZER)
    if not isinstance(model, nnx.Module):
        raise TypeError(_wrong_module("from_nnx", "flax.nnx", model))
    if not callable(model):
        # funcgrad calls the module itself (`model(x)`), as nnx's own loop does.
        raise TypeError(f"from_nnx: {type(model).__name__} has no __call__, and funcgrad "
                        "runs the module as model(*args). Define __call__ (it may just "
                        "return self.forward(x)), or pass the submodule that is called.")
    # nnx.split returns one State per filter; its stubs type them a variadic tuple.
    graphdef, param_state, rest_state = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    params = nnx.to_pure_dict(param_state)
    if not jax.tree.leaves(params):
        raise ValueError(f"from_nnx: {type(model).__name__} has no nnx.Param, so there is "
                         "nothing to differentiate.")
    model_state = nnx.to_pure_dict(rest_state) or None
    # One graphdef per mode: train()/eval() set static attributes (Dropout.deterministic,
    # BatchNorm.use_running_average), which live in the graphdef, not in the state.
    copy = nnx.merge(graphdef, param_state, rest_state)
    copy.train()
    train_graphdef = nnx.split(copy, nnx.Param, ...)[0]
    copy.eval()
    eval_graphdef = nnx.split(copy, nnx.Param, ...)[0]
    graphdefs = {None: graphdef, True: train_graphdef, False: eval_graphdef}
    takes_train = _call_takes(model.__call__, "train")  # `def __call__(self, x, train)`
    modules = _modules(model, nnx)
    for name, module in modules:
        if (isinstance(module, nnx.BatchNorm)
                and float(module.momentum) < MOMENTUM_NOTE_BELOW):
            warn(momentum_note(name, "nnx.BatchNorm", module.momentum, "flax"),
                 MomentumWarning)

    def module_of(params, model_state, graphdef):
        """A new module holding `params` and `model_state` (plain dicts), by the templates'
        Variable types."""
        states = [_filled(param_state, params, nnx)]
        if model_state is not None:
            states.append(_filled(rest_state, model_state, nnx))
        else:
            states.append(rest_state)
        return nnx.merge(graphdef, *states)

    def apply(params, model_state, args, kwargs, key, train):
        if key is not None:
            raise ValueError("m.apply(key=...): nnx models draw their randomness from their "
                             "own nnx.Rngs, held in model_state; pass key=None.")
        module = module_of(params, model_state, graphdefs[None if train is None else
                                                           bool(train)])
        if takes_train and train is not None:
            kwargs = {**kwargs, "train": train}
        outputs = module(*args, **kwargs)
        if model_state is None:
            return outputs, None
        _, _, new_rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
        return outputs, nnx.to_pure_dict(new_rest)

    def rebuild(params, model_state):
        return module_of(params, model_state, graphdef)

    return Model(library="flax.nnx", params=params, model_state=model_state, apply=apply,
                 rebuild=rebuild, takes_key=False,
                 key_note="nnx models draw their randomness from their own nnx.Rngs (in "
                          "model_state), which advance as in nnx's own loop; the loss takes "
                          "no key. Seed them with the model's nnx.Rngs(...).",
                 mode_layers=_mode_layers(modules, nnx),
                 mode_calls=("model.train()", "model.eval()"))


def _modules(model: Any, nnx: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of `model` and every nnx module inside it (``model.blocks[0].bn``)."""
    iter_modules = getattr(nnx, "iter_modules", None)
    found = iter_modules(model) if iter_modules is not None else model.iter_modules()
    return [("model" + "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in path),
             module) for path, module in found]


def _mode_layers(modules: list[tuple[str, Any]], nnx: Any) -> list[str]:
    """The modules whose behaviour ``model.train()``/``model.eval()`` change: ``model.bn1
    (nnx.BatchNorm)``, ``model.attn (Attention, its deterministic attribute)``."""
    found = []
    for name, module in modules:
        if isinstance(module, (nnx.BatchNorm, nnx.Dropout)):
            found.append(f"{name} (nnx.{type(module).__name__})")
        else:
            for attribute in ("use_running_average", "deterministic"):
                if hasattr(module, attribute):
                    found.append(f"{name} ({type(module).__name__}, its {attribute} "
                                 "attribute)")
                    break
    return found


def _filled(template: Any, values: dict, nnx: Any) -> Any:
    """A copy of the nnx State `template` with the values of the plain dict `values`."""
    state = jax.tree.map(lambda x: x, template)  # new Variables; the template is not touched
    nnx.replace_by_pure_dict(state, values)
    return state
