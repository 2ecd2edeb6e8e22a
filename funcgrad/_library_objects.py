"""How every funcgrad tool takes an equinox or flax nnx object passed whole (private).

One rule per kind of object, shared by all tools:

* An **equinox module** (anywhere in an argument) holds functions, strings and Python numbers
  as leaves next to its arrays. The analysis tools (check_grads, audit, explain_grads,
  find_nonfinite, trace, intermediate_grads, requires_grad, accumulate_grads) accept it: the
  argument is split as ``eqx.partition(arg, eqx.is_inexact_array)`` does it, the floating
  arrays are passed (and differentiated, as ``eqx.filter_grad`` does), everything else is
  closed over, and leaves are named by the module's own paths (``params.layers[2].weight``).
  `trainable_mask` and the monitor's ``init`` take the same floating leaves. The train state
  (`init_train_state`, and through it `make_train_step` and `fit`) refuses it with the
  ``eqx.partition`` / ``eqx.combine`` fix: the state is a jitted, checkpointed pytree of arrays
  and the step is built before it sees the model, so it has no place to keep the rest.
* A flax **nnx Module** is a pytree of its Variables: the analysis tools take it as it is. The
  train state refuses it (the step is pure; the module is updated in place), naming
  ``nnx.split(model, nnx.Param, ...)`` and `funcgrad.interop.from_nnx`.
* An **nnx State** (``nnx.state(model)``, ``nnx.split``): in the analysis tools its integer
  ``RngCount`` and key ``RngKey`` leaves are not differentiated, as any non-floating leaf. The
  train state takes a state of ``nnx.Param`` only: a ``BatchStat`` given to the optimizer
  would never be updated as running statistics (its gradient is zero), and a counter or key
  has no gradient, so a state with other Variables is refused with the split that fixes it.
* An **nnx.Optimizer** given as the optimizer is refused with the optax transformation it
  wraps and the model adapter to use instead.

equinox and flax are never imported here: an object of theirs can only exist once the user
has imported them, so their modules are looked up in ``sys.modules``.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._paths import is_nnx_variable, key_paths, keystr

PyTree = Any


def is_equinox_module(x: Any) -> bool:
    """Whether `x` is an ``eqx.Module`` (False when equinox is not imported)."""
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def _nnx_type(name: str) -> type | None:
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, name, None) if nnx is not None else None


def _is(x: Any, name: str) -> bool:
    cls = _nnx_type(name)
    return cls is not None and isinstance(x, cls)


def holds_equinox_module(tree: PyTree) -> bool:
    """Whether `tree` is or contains an ``eqx.Module``."""
    return any(is_equinox_module(n) for n in jax.tree.leaves(tree, is_leaf=is_equinox_module))


def _is_inexact_array(x: Any) -> bool:
    """``eqx.is_inexact_array``: a JAX or NumPy array (or tracer) of a floating/complex dtype."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and bool(
        jnp.issubdtype(x.dtype, jnp.inexact))


class _Split:
    """One argument split as ``eqx.partition(arg, eqx.is_inexact_array)``: `dynamic` has the
    argument's structure with None in place of every leaf that is not a floating array;
    ``combine(dynamic)`` puts the closed-over leaves back (``eqx.combine``)."""

    def __init__(self, arg: PyTree):
        leaves, self.treedef = jax.tree.flatten(arg)
        self.keep = [_is_inexact_array(x) for x in leaves]
        self.static = [None if k else x for x, k in zip(leaves, self.keep)]
        self.dynamic = self.treedef.unflatten([x if k else None
                                               for x, k in zip(leaves, self.keep)])

    def combine(self, dynamic: PyTree) -> PyTree:
        arrays = iter(jax.tree.leaves(dynamic))
        return self.treedef.unflatten([next(arrays) if k else s
                                       for k, s in zip(self.keep, self.static)])


def split_equinox_args(fn: Callable, args: tuple) -> tuple[Callable, tuple]:
    """``(fn_of_arrays, array_args)``: every argument holding an equinox module replaced by
    its floating arrays (`_Split`), and `fn` wrapped to rebuild it before calling. Other
    arguments pass unchanged; with no equinox module, `fn` and `args` are returned as they are.

    The wrapper keeps `fn`'s signature and name (``functools.wraps``), so reports still name
    the arguments as `fn` does; keyword arguments are passed through."""
    splits = [_Split(a) if holds_equinox_module(a) else None for a in args]
    if all(s is None for s in splits):
        return fn, tuple(args)

    @functools.wraps(fn)
    def of_arrays(*arrays, **kwargs):
        rebuilt = [a if s is None else s.combine(a) for a, s in zip(arrays, splits)]
        return fn(*rebuilt, *arrays[len(splits):], **kwargs)

    return of_arrays, tuple(a if s is None else s.dynamic for a, s in zip(args, splits))


def equinox_floating(tree: PyTree) -> PyTree:
    """``eqx.filter(tree, eqx.is_inexact_array)`` for a tree holding an equinox module, else
    `tree`: what `trainable_mask` and the monitor's ``init`` describe."""
    return _Split(tree).dynamic if holds_equinox_module(tree) else tree


# --- the train state: refusals -------------------------------------------------------------

def check_optimizer(where: str, optimizer: Any) -> None:
    """TypeError for an ``nnx.Optimizer`` given where an optax transformation is expected."""
    if not _is(optimizer, "Optimizer"):
        return
    tx = getattr(optimizer, "tx", None)
    raise TypeError(
        f"{where}: optimizer is an nnx.Optimizer, which holds the model and updates it in "
        "place; funcgrad's step is a pure function of a TrainState and takes the optax "
        "transformation the nnx.Optimizer wraps"
        + (f" (its .tx here: {type(tx).__name__})" if tx is not None else "")
        + ", e.g. optax.adam(1e-3), with the model's params: model = "
        "funcgrad.interop.from_nnx(module); state = model.init_train_state(optax.adam(1e-3)) "
        "(or graphdef, params, rest = nnx.split(module, nnx.Param, ...); "
        "init_train_state(params, optax.adam(1e-3))).")


def check_params(where: str, params: PyTree) -> None:
    """TypeError, naming the leaf and the fix, when `params` cannot be a train state's params:
    an equinox module, an nnx Module, an nnx State with Variables other than ``nnx.Param``, or
    any leaf that is not an array or a number (see the module docstring)."""
    if _is(params, "Module"):
        raise TypeError(
            f"{where}: params is an nnx Module ({type(params).__name__}), which nnx updates "
            "in place; the train state holds its arrays. Split it: graphdef, params, "
            "model_state = nnx.split(module, nnx.Param, ...), pass params (and model_state= "
            "with a loss that returns the new model state), and nnx.merge(graphdef, params, "
            "model_state) after training; or use model = funcgrad.interop.from_nnx(module), "
            "whose model.init_train_state(optimizer) does this.")
    bad = _first_not_partitioned(params) if holds_equinox_module(params) else None
    if bad is not None:  # eqx.partition(params, eqx.is_inexact_array) leaves it out
        raise TypeError(
            f"{where}: params is an equinox module ({type(params).__name__}); its leaf "
            f"params{keystr(bad[0])} is a {type(bad[1]).__name__}, and the train state "
            "holds arrays only (it is jitted and checkpointed, and the optimizer "
            "updates every leaf). Train its floating arrays and close over the rest: params, "
            "static = eqx.partition(model, eqx.is_inexact_array); loss_fn = lambda params, "
            "batch: loss(eqx.combine(params, static), batch); state = init_train_state(params, "
            "optimizer); after training, model = eqx.combine(state.params, static). Or use "
            "funcgrad.interop.from_equinox(model), which also carries eqx.nn.State and keys.")
    collections = _linen_collections(params)
    if collections:  # a linen variables dict given whole: its statistics would be trained
        raise TypeError(
            f"{where}: params looks like a whole flax linen variables dict (top-level keys "
            f"'params' and {', '.join(repr(c) for c in collections)}). The optimizer would "
            f"treat {collections[0]!r} as weights: BatchNorm's running statistics would get "
            "zero gradients and never move. Pass variables['params'] as params and the other "
            "collections as model_state= (init_train_state(variables['params'], optimizer, "
            "model_state={k: v for k, v in variables.items() if k != 'params'})) with a loss "
            "that applies the module with mutable=[...] and returns the new model state; or "
            "use model = funcgrad.interop.from_linen(module, variables).")
    others = _non_param_variables(params)
    if others:
        listed = ", ".join(f"params{keystr(p)} ({kind})" for p, kind in others[:6])
        more = f" and {len(others) - 6} more" if len(others) > 6 else ""
        raise TypeError(
            f"{where}: params holds nnx Variables that are not nnx.Param: {listed}{more}. The "
            "optimizer would treat them as weights: a BatchStat would never move as running "
            "statistics (its gradient is zero) and an RngCount or RngKey has no gradient. "
            "Keep only the params: graphdef, params, model_state = nnx.split(module, "
            "nnx.Param, ...), and pass model_state= with a loss that returns the new model "
            "state; or use model = funcgrad.interop.from_nnx(module).")
    bad = _first_non_array(params)
    if bad is not None:
        raise TypeError(
            f"{where}: params{keystr(bad[0])} is a {type(bad[1]).__name__}, not an array or a "
            "number; the train state holds arrays only. Close over it in the loss (e.g. "
            "functools.partial(loss_fn, name=value)) and pass the arrays as params.")


def _first_not_partitioned(tree: PyTree) -> tuple[tuple, Any] | None:
    """The first leaf (path, leaf) of an equinox module that is not an array: a function, a
    string, or a Python number such as a dropout rate, which an optimizer would change. (An
    integer array is left to the step's own check, which names it and the way to freeze it.)"""
    for path, leaf in zip(key_paths(tree), jax.tree.leaves(tree)):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            return path, leaf
    return None


def _first_non_array(tree: PyTree) -> tuple[tuple, Any] | None:
    for path, leaf in zip(key_paths(tree), jax.tree.leaves(tree)):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
            return path, leaf
    return None


def _non_param_variables(tree: PyTree) -> list[tuple[tuple, str]]:
    """``(path, Variable type name)`` of every nnx Variable in `tree` that is not a Param."""
    param = _nnx_type("Param")
    if param is None:
        return []
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_nnx_variable)[0]
    return [(path, type(v).__name__) for path, v in flat
            if is_nnx_variable(v) and not isinstance(v, param)]


#: Collections flax linen keeps beside "params" that hold no weights.
_LINEN_COLLECTIONS = ("batch_stats", "cache", "intermediates", "losses", "spectral_stats")


def _linen_collections(params: PyTree) -> list[str]:
    """The non-weight linen collections at the top of a mapping that also has "params"."""
    if not hasattr(params, "keys") or "params" not in params.keys():
        return []
    return [k for k in params.keys() if k in _LINEN_COLLECTIONS]
