"""Trainable masks: PyTorch's ``requires_grad`` as a pytree of bools over the params.

Concept 4 (article A §2.1). A mask has the structure of `params` (or a prefix of it: one bool
for a whole subtree), ``True`` where a leaf is trainable. Three tools use it:

* `trainable_mask` builds one from path patterns (``"0/*"``) or predicates, refusing a pattern
  that selects nothing, so a typo cannot silently train everything;
* `value_and_grad_trainable` differentiates the trainable leaves only: frozen leaves reach `fn`
  as plain values, so JAX builds no tangent and keeps no residual for them, and their gradient
  is returned as exact zeros;
* `train_only` wraps an optax optimizer so frozen leaves get exactly zero updates and no optimizer
  state (``optax.partition``, also known as ``optax.multi_transform``, with
  ``optax.set_to_zero``): Adam's moments and AdamW's weight decay never touch them. The
  result carries its mask, so `funcgrad.train.step.make_train_step` treats it as ``trainable=``
  (its gradient norm and clipping see only the trained leaves).

`requires_grad` reports, per output leaf, whether it depends on a trainable leaf through a
differentiable path: PyTorch's propagation rule, decided by JAX's own differentiation rules.

Path convention: a leaf's path is its keys joined by ``/``, relative to `params`: list and
tuple indices as numbers, dict keys and attribute names as text. The MLP of `funcgrad.demo.mlp`
(a list of ``{"w", "b"}`` dicts) has the paths ``0/b``, ``0/w``, ``1/b``, ``1/w`` (the leaf
``params[0]['w']`` is ``0/w``). Patterns are shell globs matched against the whole path with
`fnmatch.fnmatchcase`: ``*`` matches any run of characters, ``/`` included, ``?`` one
character, ``[01]`` one of a set; so ``"0/*"`` is the first layer and ``"*/b"`` every bias.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from funcgrad import _jax_internals as ji
from funcgrad._library_objects import equinox_floating, split_equinox_args
from funcgrad._paths import key_paths, keystr, slash_path

PyTree = Any
Predicate = Callable[[str, Any], bool]
Selector = Union[str, Predicate, Sequence[Union[str, Predicate]]]


def _paths_and_leaves(params: PyTree) -> tuple[list[str], list[Any]]:
    """The ``a/0/w`` path of every leaf (see the module docstring; an nnx Variable's ``.value``
    is not a level, `funcgrad._paths`) and the leaves."""
    return [slash_path(kp) for kp in key_paths(params)], jax.tree.leaves(params)


def _selectors(value: Selector | None, arg: str) -> list[str | Predicate]:
    if value is None:
        return []
    items: list[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not (isinstance(item, str) or callable(item)):
            raise TypeError(
                f"trainable_mask: {arg}= takes path patterns such as '0/*' or predicates "
                f"(path, leaf) -> bool, or a list of them; got {type(item).__name__} {item!r}.")
    return items


def _selected(item: str | Predicate, paths: list[str], leaves: list[Any], arg: str) -> list[bool]:
    if isinstance(item, str):
        hits = [fnmatch.fnmatchcase(p, item) for p in paths]
        what = f"pattern {item!r}"
    else:
        hits = []
        for p, leaf in zip(paths, leaves):
            hit = item(p, leaf)
            if not isinstance(hit, (bool, np.bool_)):
                raise TypeError(
                    f"trainable_mask: the {arg}= predicate returned {type(hit).__name__} for "
                    f"leaf {p}; it must return a Python bool (e.g. wrap it in bool(...)).")
            hits.append(bool(hit))
        what = f"predicate {getattr(item, '__name__', repr(item))}"
    if not any(hits):
        raise ValueError(
            f"trainable_mask: {arg}= {what} matches no leaf of params. Paths are keys joined "
            f"by '/', matched as globs over the whole path; the leaves are: "
            f"{', '.join(paths)}.")
    return hits


def trainable_mask(params: PyTree, *, train: Selector | None = None,
                   freeze: Selector | None = None) -> PyTree:
    """Returns a mask with the structure of `params`: ``True`` for trainable leaves.

    A leaf is trainable when it is selected by `train` (or `train` is None) and not selected by
    `freeze`; with neither given every leaf is trainable (PyTorch's default for parameters).
    So ``freeze="0/*"`` freezes the first layer, ``train="1/*"`` trains only the second, and
    ``train="*/w", freeze="0/*"`` trains the weights of every layer but the first.

    Args:
      params: the parameter pytree (arrays or anything else as leaves). An equinox module
        is described by its floating arrays: the mask has the structure of
        ``eqx.filter(model, eqx.is_inexact_array)`` (None elsewhere), the params it trains.
      train: the leaves to train: a glob pattern over leaf paths (see the module docstring:
        ``"0/w"``, ``"0/*"``, ``"*/b"``), a predicate ``(path: str, leaf) -> bool``, or a list
        of them (a leaf is selected when any item selects it); None selects every leaf.
      freeze: the leaves to freeze, selected as by `train`.
    Returns:
      a pytree with the structure of `params` whose leaves are Python bools.
    Raises:
      ValueError: if a pattern or predicate selects no leaf; the message lists every path.
      TypeError: if a selector is neither a string nor callable, or a predicate returns
        something other than a bool.
    Example:
      >>> params = [{"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}] * 2
      >>> trainable_mask(params, freeze="0/*")
      [{'b': False, 'w': False}, {'b': True, 'w': True}]
    """
    params = equinox_floating(params, "trainable_mask")  # an equinox model: floating arrays
    paths, leaves = _paths_and_leaves(params)
    trainable = [True] * len(paths)
    train_items = _selectors(train, "train")
    if train_items:
        chosen = [False] * len(paths)
        for item in train_items:
            chosen = [a or b for a, b in zip(chosen, _selected(item, paths, leaves, "train"))]
        trainable = chosen
    for item in _selectors(freeze, "freeze"):
        hits = _selected(item, paths, leaves, "freeze")
        trainable = [t and not h for t, h in zip(trainable, hits)]
    return jax.tree.unflatten(jax.tree.structure(params), trainable)


class _AllOf:
    """Several masks over the same params: a leaf is trainable when every one says so (the
    masks of nested `freeze` calls, or `make_train_step`'s ``trainable=`` over a frozen
    optimizer). Not a pytree, so `_leaf_flags` sees it whole."""

    def __init__(self, masks: Sequence[PyTree]):
        self.masks = tuple(masks)


def _leaf_flags(mask: PyTree, params: PyTree, where: str) -> list[bool]:
    """One bool per leaf of `params` (in ``jax.tree.leaves`` order), broadcasting a prefix mask."""
    if isinstance(mask, _AllOf):
        per_mask = [_leaf_flags(m, params, where) for m in mask.masks]
        return [all(flags) for flags in zip(*per_mask)]
    mask_def = jax.tree.structure(mask)
    try:
        subtrees = mask_def.flatten_up_to(params)
    except (ValueError, TypeError):
        raise ValueError(
            f"{where}: the mask's structure does not match params. The mask must have the "
            "structure of params (as trainable_mask(params, ...) makes it) or a prefix of it "
            f"(one bool for a whole subtree).\n  params: {jax.tree.structure(params)}\n"
            f"  mask:   {mask_def}") from None
    flat_mask = zip(key_paths(mask), jax.tree.leaves(mask))
    flags = []
    for (kp, flag), subtree in zip(flat_mask, subtrees):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"{where}: the mask leaf at {slash_path(kp) or '(root)'} is "
                f"{type(flag).__name__} {flag!r}; mask leaves must be Python bools (True = "
                "trainable). A traced or device array cannot be used: which leaves are "
                "differentiated must be known when the function is traced.")
        flags.extend([bool(flag)] * len(jax.tree.leaves(subtree)))
    return flags


def _split(params: PyTree, mask: PyTree, where: str):
    """(trainable leaves, frozen leaves, merge(trainable, frozen) -> params)."""
    flags = _leaf_flags(mask, params, where)
    leaves, treedef = jax.tree.flatten(params)
    trainable = [x for x, f in zip(leaves, flags) if f]
    frozen = [x for x, f in zip(leaves, flags) if not f]

    def merge(trainable_leaves, frozen_leaves):
        t, z = iter(trainable_leaves), iter(frozen_leaves)
        return jax.tree.unflatten(treedef, [next(t) if f else next(z) for f in flags])

    check_differentiable(params, where, flags)
    return trainable, frozen, merge


def check_differentiable(params: PyTree, where: str, flags: Sequence[bool] | None = None) -> None:
    """Raises TypeError, naming the leaf and the fix, if a trainable leaf has no gradient.

    JAX differentiates floating-point (and complex) leaves only; an integer or bool leaf in
    the differentiated params makes ``jax.grad`` fail with a message that names no leaf.

    Args:
      params: the parameter pytree.
      where: the tool's name, to start the message.
      flags: one bool per leaf, True where it is trainable (`_leaf_flags`); None: all.
    Raises:
      TypeError: for the first trainable leaf whose dtype is not inexact: its path
        (``params['count']``), its dtype, and the two fixes: make it floating point if it is a
        weight, or freeze it with `trainable_mask` if it is not trained.
    """
    flat = list(zip(key_paths(params), jax.tree.leaves(params)))
    flags = [True] * len(flat) if flags is None else flags
    for (kp, x), f in zip(flat, flags):
        dtype = jnp.result_type(x)
        if f and not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{where}: params{keystr(kp)} has dtype {dtype}, which has no "
                "gradient (JAX differentiates floating-point leaves only). If it is a weight, "
                "make it floating point (e.g. jnp.array(0.0) rather than jnp.array(0), or "
                ".astype(jnp.float32)); if it is not trained (a step counter, an index table), "
                f"freeze it: trainable = trainable_mask(params, freeze={slash_path(kp)!r}), given "
                "to make_train_step(..., trainable=trainable), or keep it out of params.")


def value_and_grad_trainable(fn: Callable, mask: PyTree, *,
                             has_aux: bool = False) -> Callable[..., tuple[Any, PyTree]]:
    """Like ``jax.value_and_grad(fn)``, differentiating only the trainable leaves of `params`.

    The params are partitioned by `mask`; ``jax.value_and_grad`` sees the trainable leaves
    alone and the frozen ones are closed over as constants, so JAX creates no tangent for them
    and saves no residual that only their gradient would need (e.g. with the first layer of an
    MLP frozen, neither ``dW0 = xᵀ dz`` nor ``dh = dlogits W1ᵀ`` is computed; see
    ``tests/train/test_masks.py``). This is the functional ``requires_grad=False``.

    Args:
      fn: ``fn(params, *args, **kwargs) -> scalar`` (or ``(scalar, aux)`` with `has_aux`).
        An equinox module in the arguments is split as ``eqx.filter_grad`` splits it (its
        floating arrays differentiated, the rest closed over); `grads` then has None elsewhere.
      mask: Python bools with the structure of `params` or a prefix of it (`trainable_mask`).
      has_aux: as in ``jax.value_and_grad``.
    Returns:
      ``f(params, *args, **kwargs) -> (value, grads)`` (``((value, aux), grads)`` with
      `has_aux`); `grads` has the structure of `params`, the gradient of `fn` for trainable
      leaves and ``jnp.zeros_like(leaf)`` (same shape and dtype, exact zeros) for frozen ones.
      It can be jitted; the mask is read when it is traced.
    Raises:
      ValueError: when called, if the mask's structure does not fit `params` (both shown).
      TypeError: when called, if a mask leaf is not a bool, or a trainable leaf is not
        floating point (integers have no gradient: freeze them).
    """
    def value_and_grads(params, *args, **kwargs):
        of_arrays, (params, *rest) = split_equinox_args(fn, (params, *args),
                                                        "value_and_grad_trainable")
        trainable, frozen, merge = _split(params, mask, "value_and_grad_trainable")

        def of_trainable(trainable_leaves):
            return of_arrays(merge(trainable_leaves, frozen), *rest, **kwargs)

        value, grads = jax.value_and_grad(of_trainable, has_aux=has_aux)(trainable)
        return value, merge(grads, [jnp.zeros_like(x) for x in frozen])

    return value_and_grads


def train_only(optimizer: optax.GradientTransformation,
               trainable: PyTree) -> optax.GradientTransformation:
    """Returns `optimizer` applied to the `trainable` leaves only; the others are left alone.

    Every mask in funcgrad means the same: True = trained (`trainable_mask`, the step's
    ``trainable=``). Note that ``optax.freeze(mask)`` reads its mask the other way round (True
    = frozen); hence this name.

    Built on ``optax.partition`` (``optax.multi_transform``): trainable leaves go through
    `optimizer`, frozen ones through ``optax.set_to_zero()``. So for a frozen leaf the update is
    exactly zero whatever the gradient, the optimizer keeps no state for it (Adam's moments
    hold an empty ``MaskedNode`` there), and decoupled weight decay (``optax.adamw``) never
    shrinks it. ``optax.apply_updates`` then adds exact zeros, so a frozen leaf keeps its value
    bit for bit (IEEE addition of +0.0 changes nothing but the sign of a -0.0).

    Given to `funcgrad.train.step.make_train_step`, it acts as the step's
    ``trainable=mask``: the frozen leaves are not differentiated, so the global norm (the
    "grad_norm" metric), the non-finite guard and the transformations of the chain see only
    the gradient that is applied. A frozen leaf with a large gradient does not shrink the
    clipped update of the others.

    Args:
      optimizer: any optax ``GradientTransformation`` (e.g. ``optax.adam(1e-3)``).
      trainable: Python bools (True = trained) with the structure of the params or a prefix
        of it (`trainable_mask`).
    Returns:
      a `FrozenOptimizer`: an optax ``GradientTransformationExtraArgs`` with the mask as its
      ``trainable`` attribute; its ``init`` and ``update`` check `mask` against the params and
      updates they receive.
    Raises:
      TypeError: if `optimizer` is not an optax GradientTransformation; at ``init``/``update``,
        if a mask leaf is not a bool.
      ValueError: at ``init``/``update``, if the mask's structure does not fit the params.
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"train_only: optimizer must be an optax GradientTransformation such "
                        f"as optax.adam(1e-3), got {type(optimizer).__name__}.")
    mask = trainable

    def labels(tree):
        flags = _leaf_flags(mask, tree, "train_only")
        return jax.tree.unflatten(jax.tree.structure(tree),
                                  ["trainable" if f else "frozen" for f in flags])

    frozen = FrozenOptimizer(
        *optax.partition({"trainable": optimizer, "frozen": optax.set_to_zero()}, labels))
    frozen.trainable = mask
    frozen._masks = (mask, *frozen_masks(optimizer))
    return frozen


class FrozenOptimizer(optax.GradientTransformationExtraArgs):
    """The optax transformation `train_only` returns; it also carries its mask as ``trainable``.

    An ``optax.GradientTransformationExtraArgs`` (``init``, ``update``) like any other; the
    mask lets `funcgrad.train.step.make_train_step` see the freeze and treat it as its own
    ``trainable=``: frozen leaves are not differentiated, and the global norm, the clipping,
    the non-finite guard and the monitor see only the gradient that is applied. (optax's
    own ``optax.partition``/``optax.masked`` cannot be seen into: with them the step's norm
    and clipping also count the gradients of the leaves they leave alone.)
    """


def frozen_masks(optimizer: Any) -> tuple[PyTree, ...]:
    """The masks of the `train_only` calls wrapped around `optimizer`, outermost first; () if it is
    not a `FrozenOptimizer` (a freeze hidden inside ``optax.chain`` is not seen)."""
    return getattr(optimizer, "_masks", ()) if isinstance(optimizer, FrozenOptimizer) else ()


def requires_grad(fn: Callable, mask: PyTree) -> Callable[..., PyTree]:
    """PyTorch's ``out.requires_grad`` for every output leaf of `fn`, decided by JAX.

    The propagation rule: an output needs a gradient iff it depends on some trainable input
    through a differentiable path. This traces ``jax.jvp`` of `fn` in the trainable leaves
    (abstractly: nothing is computed) and reports whether each output's tangent depends on an
    input tangent. Paths are cut by ``jax.lax.stop_gradient``, by integer or boolean results
    (comparisons, ``argmax``, casts to int) and by ops whose derivative JAX knows is zero
    everywhere (``round``, ``floor``, ``sign``): PyTorch would say ``requires_grad=True`` for
    ``round(x)`` and then give a zero gradient.

    Args:
      fn: ``fn(params, *args) -> pytree of arrays``; `args` are arrays or pytrees of them
        (an equinox module's floating arrays are its leaves, the rest is closed over).
      mask: Python bools with the structure of `params` or a prefix of it (`trainable_mask`).
    Returns:
      ``report(params, *args) -> pytree of Python bools`` with the structure of `fn`'s output.
    Raises:
      ValueError, TypeError: as `value_and_grad_trainable`, for a bad mask.
    Example:
      >>> f = lambda p: (p["a"] * p["b"], p["a"] + 1.0, jax.lax.stop_gradient(p["b"]) * 2.0)
      >>> requires_grad(f, {"a": False, "b": True})({"a": 1.0, "b": 2.0})
      (True, False, False)
    """
    def report(params, *args):
        of_arrays, (params, *rest) = split_equinox_args(fn, (params, *args), "requires_grad")
        trainable, frozen, merge = _split(params, mask, "requires_grad")

        def output_tangents(primals, tangents, frozen_leaves, args):
            _, out_tangents = jax.jvp(lambda t: of_arrays(merge(t, frozen_leaves), *args),
                                      (primals,), (tangents,))
            return out_tangents

        closed, out_shape = jax.make_jaxpr(output_tangents, return_shape=True)(
            trainable, trainable, frozen, rest)
        n = len(jax.tree.leaves(trainable))
        live = [n <= i < 2 * n for i in range(len(closed.jaxpr.invars))]
        flags = _depends_on(closed.jaxpr, live)
        return jax.tree.unflatten(jax.tree.structure(out_shape), flags)

    return report


def _depends_on(jaxpr: Any, live_in: list[bool]) -> list[bool]:
    """For each output of `jaxpr`: does it depend on an input flagged in `live_in`?

    Data flow over the equations; a call with one inner jaxpr of matching arity (``jit``) is
    followed inside (jit, checkpoint), any other (a scan, whose carry loops) counts as
    depending on all its inputs."""
    live = {v for v, flag in zip(jaxpr.invars, live_in) if flag}

    def is_live(v):
        return not ji.is_literal(v) and v in live

    for eqn in jaxpr.eqns:
        inner = ji.call_body(eqn)[0] if ji.kind(eqn) in ji.CALL_KINDS else None
        if (inner is not None and len(inner.invars) == len(eqn.invars)
                and len(inner.outvars) == len(eqn.outvars)):
            flags = _depends_on(inner, [is_live(v) for v in eqn.invars])
            live.update(v for v, f in zip(eqn.outvars, flags) if f)
        elif any(is_live(v) for v in eqn.invars):
            live.update(eqn.outvars)
    return [is_live(v) for v in jaxpr.outvars]
