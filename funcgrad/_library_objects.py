"""How every funcgrad tool takes an equinox or flax nnx object passed whole (private).

One rule per kind of object, shared by all tools:

* An **equinox module** (anywhere in an argument) holds functions, strings and Python numbers
  as leaves next to its arrays. The analysis tools (check_grads, audit, explain_grads,
  find_nonfinite, trace, intermediate_grads, requires_grad, accumulate_grads) accept it: the
  argument is split as ``eqx.partition(arg, eqx.is_inexact_array)`` does it, the floating
  arrays are passed (and differentiated, as ``eqx.filter_grad`` does), everything else is
  closed over, and leaves are named by the module's own paths (``params.layers[2].weight``).
  `trainable_mask` and the monitor's ``init`` take the same floating leaves. The train state
  (`TrainStep.init`, and through it the step and `fit`) refuses it with the
  ``eqx.partition`` / ``eqx.combine`` fix: the state is a jitted, checkpointed pytree of arrays
  and the step is built before it sees the model, so it has no place to keep the rest.
* A **Python float field** of an equinox module (``self.scale = 0.5``) looks like a weight,
  but equinox treats it as static: the split leaves it out, so it is never differentiated and
  never trains. It is never dropped silently (`static_floats`): check_grads and audit list it
  in the report's ``skipped``, explain_grads gives it a row of status ``static``, the other
  tools warn (`funcgrad.interop.StaticFieldWarning`), and the train state's refusal gives the
  fix that trains it (``eqx.tree_at(lambda m: m.scale, model, jnp.asarray(0.5))``) before the
  partition. The Python floats of equinox's own layers (``eqx.nn.Dropout``'s rate ``p``) are
  settings, not listed; so is a field declared ``eqx.field(static=True)`` (not a leaf).
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._paths import is_nnx_variable, key_paths, keystr
from funcgrad._user_line import warn

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


def is_inexact_array(x: Any) -> bool:
    """``eqx.is_inexact_array``: a JAX or NumPy array (or tracer) of a floating/complex dtype."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and bool(
        jnp.issubdtype(x.dtype, jnp.inexact))


class _Split:
    """One argument split as ``eqx.partition(arg, eqx.is_inexact_array)``: `dynamic` has the
    argument's structure with None in place of every leaf that is not a floating array;
    ``combine(dynamic)`` puts the closed-over leaves back (``eqx.combine``)."""

    def __init__(self, arg: PyTree):
        leaves, self.treedef = jax.tree.flatten(arg)
        self.keep = [is_inexact_array(x) for x in leaves]
        self.static = [None if k else x for x, k in zip(leaves, self.keep)]
        self.dynamic = self.treedef.unflatten([x if k else None
                                               for x, k in zip(leaves, self.keep)])

    def combine(self, dynamic: PyTree) -> PyTree:
        arrays = iter(jax.tree.leaves(dynamic))
        return self.treedef.unflatten([next(arrays) if k else s
                                       for k, s in zip(self.keep, self.static)])


def split_equinox_args(fn: Callable, args: tuple, where: str | None = None) -> tuple[
        Callable, tuple]:
    """``(fn_of_arrays, array_args)``: every argument holding an equinox module replaced by
    its floating arrays (`_Split`), and `fn` wrapped to rebuild it before calling. Other
    arguments pass unchanged; with no equinox module, `fn` and `args` are returned as they are.

    The wrapper keeps `fn`'s signature and name (``functools.wraps``), so reports still name
    the arguments as `fn` does; keyword arguments are passed through. With `where` (the
    tool's name), a `StaticFieldWarning` names each Python float field the split leaves out
    (`static_floats`); a tool that lists them in its report passes None and calls
    `left_out_fields` itself."""
    if where is not None:
        warn_left_out(where, left_out_fields(fn, args))
    splits = [_Split(a) if holds_equinox_module(a) else None for a in args]
    if all(s is None for s in splits):
        return fn, tuple(args)

    @functools.wraps(fn)
    def of_arrays(*arrays, **kwargs):
        rebuilt = [a if s is None else s.combine(a) for a, s in zip(arrays, splits)]
        return fn(*rebuilt, *arrays[len(splits):], **kwargs)

    return of_arrays, tuple(a if s is None else s.dynamic for a, s in zip(args, splits))


def equinox_floating(tree: PyTree, where: str) -> PyTree:
    """``eqx.filter(tree, eqx.is_inexact_array)`` for a tree holding an equinox module, else
    `tree`: what `trainable_mask` and the monitor's ``init`` describe. A `StaticFieldWarning`
    (from `where`, the tool's name) names each Python float field left out."""
    if not holds_equinox_module(tree):
        return tree
    warn_left_out(where, [LeftOut(0, i, path, value, "params" + keystr(path))
                          for i, path, value in static_floats(tree)])
    return _Split(tree).dynamic


# --- Python float fields: left out by the split, never silently ------------------------------

class LeftOut(NamedTuple):
    """A Python float field of an equinox module that the split leaves out (`static_floats`).

    Attributes:
      arg: the position of the argument that holds it.
      position: its index in ``jax.tree.leaves(args[arg])`` (to list it in leaf order).
      path: its key path inside the argument (``(GetAttrKey('scale'),)``).
      value: the float.
      name: the argument's name and the path, as reports name leaves (``params.scale``).
    """
    arg: int
    position: int
    path: tuple
    value: Any
    name: str

    @property
    def reason(self) -> str:
        """Why it is left out and the fix, for a report's line."""
        kind = type(self.value).__name__
        return (f"Python {kind} {self.value!r}: equinox treats it as static, so it is not "
                f"differentiated and never trains; write jnp.asarray({self.value!r}) to train "
                "it, or declare it eqx.field(static=True) if it is a setting")


def _is_python_float(x: Any) -> bool:
    """A Python float or complex (not a NumPy scalar, which equinox keeps as an array)."""
    return isinstance(x, (float, complex)) and not isinstance(x, np.generic)


def _from_equinox_itself(module: Any) -> bool:
    """Whether `module`'s class is one of equinox's own layers (``eqx.nn.Dropout``)."""
    return type(module).__module__.split(".")[0] == "equinox"


def static_floats(tree: PyTree) -> list[tuple[int, tuple, Any]]:
    """``(index, path, value)`` of every Python float (or complex) leaf of `tree` that lies in
    an equinox module, or next to one, outside equinox's own layers: what
    ``eqx.partition(tree, eqx.is_inexact_array)`` leaves out although it looks like a weight.
    `index` is its position in ``jax.tree.leaves(tree)``. The floats of equinox's own layers
    (``eqx.nn.Dropout``'s rate) are settings and are not returned."""
    found: list[tuple[int, tuple, Any]] = []
    count = 0

    def walk(node: Any, prefix: tuple, settings: bool) -> None:
        # The node's leaves with its submodules as leaves, expanded in place: the same order
        # as jax.tree.leaves(tree) (a depth-first flatten).
        nonlocal count
        is_sub = lambda x: x is not node and is_equinox_module(x)
        for path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_sub)[0]:
            if is_sub(leaf):
                walk(leaf, prefix + path, _from_equinox_itself(leaf))
                continue
            if _is_python_float(leaf) and not settings:
                found.append((count, prefix + path, leaf))
            count += 1

    walk(tree, (), is_equinox_module(tree) and _from_equinox_itself(tree))
    return found


def left_out_fields(fn: Callable, args: tuple,
                    argnums: tuple[int, ...] | None = None) -> list[LeftOut]:
    """The `LeftOut` Python float fields of the arguments that hold an equinox module (those
    at `argnums` only, when given), named by `fn`'s parameter names."""
    from funcgrad._jaxpr import arg_names  # (funcgrad._jaxpr imports nothing of this module)

    holding = [i for i, a in enumerate(args) if holds_equinox_module(a)
               and (argnums is None or i in argnums)]
    if not holding:
        return []
    names = arg_names(fn, len(args))
    return [LeftOut(i, index, path, value, names[i] + keystr(path))
            for i in holding for index, path, value in static_floats(args[i])]


def warn_left_out(where: str, fields: list[LeftOut]) -> None:
    """One `funcgrad.interop.StaticFieldWarning` per field, at the user's line."""
    from funcgrad._adapter_warnings import StaticFieldWarning

    for field in fields:
        warn(f"{where} left out {field.name} ({field.reason}).", StaticFieldWarning)


def static_field_message(name: str, fields: list[tuple[tuple, Any]], what: str) -> str:
    """The long form, with the fix that trains them: `name` is the argument's name (``params``,
    ``model``), `fields` the ``(path, value)`` of its Python float fields, `what` the split
    that leaves them out (``"eqx.partition(...) leaves"``)."""
    shown = fields[:6]
    listed = ", ".join(f"{name}{keystr(p)} is a Python {type(v).__name__} ({v!r})"
                       for p, v in shown)
    if len(fields) > len(shown):
        listed += f" (and {len(fields) - len(shown)} more)"
    if len(fields) == 1:
        (path, value), = fields
        fix = f"eqx.tree_at(lambda m: m{keystr(path)}, model, jnp.asarray({value!r}))"
    else:
        fix = (f"eqx.tree_at(lambda m: ({', '.join(f'm{keystr(p)}' for p, _ in shown)}), "
               f"model, ({', '.join(f'jnp.asarray({v!r})' for _, v in shown)}))")
    it, it_is, trains, arrays, a_setting, field = (
        ("it", "it is", "trains", "an array", "it is a setting", "the field")
        if len(fields) == 1 else
        ("them", "they are", "train", "arrays", "one is a setting", "that field"))
    return (f"{listed}: equinox treats a Python float as static, so {what} {it} out and "
            f"{it_is} never differentiated and never {trains} (the value stays). To train "
            f"{it}, make {it} {arrays}: model = {fix} (or write jnp.asarray(...) where the "
            f"class sets {it}); if {a_setting}, declare {field} eqx.field(static=True).")


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
        "funcgrad.interop.from_nnx(module); step = funcgrad.make_train_step(model.loss(objective), "
        "optax.adam(1e-3)); state = model.init_state(step) "
        "(or graphdef, params, rest = nnx.split(module, nnx.Param, ...); "
        "step.init(params)).")


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
            "whose model.init_state(step) does this.")
    bad = _first_not_partitioned(params) if holds_equinox_module(params) else None
    if bad is not None:  # eqx.partition(params, eqx.is_inexact_array) leaves it out
        floats = [(path, value) for _, path, value in static_floats(params)]
        arrays_only = ("the train state holds arrays only (it is jitted and checkpointed, and "
                       "the optimizer updates every leaf)")
        head = (
            # A weight equinox treats as static: the fix that trains it comes first, since the
            # partition below alone would leave it at its value forever.
            static_field_message("params", floats, "eqx.partition(model, eqx.is_inexact_array) "
                                 "and funcgrad.interop.from_equinox leave")
            + f" Then, as {arrays_only}, train its floating arrays"
            if floats else
            f"its leaf params{keystr(bad[0])} is a {type(bad[1]).__name__}, and {arrays_only}. "
            "Train its floating arrays")
        raise TypeError(
            f"{where}: params is an equinox module ({type(params).__name__}); {head} and close "
            "over the rest: params, static = eqx.partition(model, eqx.is_inexact_array); "
            "loss_fn = lambda params, batch: loss(eqx.combine(params, static), batch); state = "
            "step.init(params); after training, model = "
            "eqx.combine(state.params, static). Or use "
            "funcgrad.interop.from_equinox(model), which also carries eqx.nn.State and keys.")
    collections = _linen_collections(params)
    if collections:  # a linen variables dict given whole: its statistics would be trained
        raise TypeError(
            f"{where}: params looks like a whole flax linen variables dict (top-level keys "
            f"'params' and {', '.join(repr(c) for c in collections)}). The optimizer would "
            f"treat {collections[0]!r} as weights: BatchNorm's running statistics would get "
            "zero gradients and never move. Pass variables['params'] as params and the other "
            "collections as model_state= (step.init(variables['params'], "
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
