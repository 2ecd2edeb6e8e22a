"""`Model`: a flax or equinox model split into funcgrad's pieces (params, model state, apply).

The three adapters (`funcgrad.interop.from_linen`, `from_nnx`, `from_equinox`) differ only in
how they split the library's object and call it; everything a user does with the result
(`Model.apply`, `Model.loss`, `Model.rebuild`, `Model.init_state`) is defined once here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad._paths import key_paths, keystr

if TYPE_CHECKING:
    from funcgrad.train.loss import Loss

PyTree = Any

#: ``apply(params, model_state, args, kwargs, key, train) -> (outputs, new_model_state)``
ApplyFn = Callable[[PyTree, PyTree, tuple, dict, Any, Any], tuple[Any, PyTree]]


class Model:
    """A flax (linen, nnx) or equinox model as funcgrad's pieces; made by the `from_*` adapters.

    Attributes:
      params: the trainable leaves (floating arrays), a pytree named by the library's own
        paths: linen ``params['Conv_0']['kernel']`` (the ``"params"`` collection), nnx
        ``params['bn1']['scale']`` (every ``nnx.Param``, as a plain dict of arrays: no
        ``.value`` level), equinox ``params.layers[2].weight`` (the floating arrays of
        ``eqx.partition(model, eqx.is_inexact_array)``, None elsewhere).
      model_state: what the forward pass reads and updates but is not differentiated, or None
        when the model has none: linen, every collection but ``"params"`` (``{"batch_stats":
        ...}``); nnx, every Variable that is not an ``nnx.Param`` as a plain dict (BatchNorm's
        ``mean``/``var``, the ``Rngs`` streams' ``key`` and integer ``count``); equinox, the
        ``eqx.nn.State``.
      library: "flax.linen", "flax.nnx" or "equinox".
    """

    def __init__(self, *, library: str, params: PyTree, model_state: PyTree | None,
                 apply: ApplyFn, rebuild: Callable[[PyTree, PyTree], Any], takes_key: bool,
                 key_note: str, state_in_compute_dtype: bool = False,
                 mode_layers: Sequence[str] = (), mode_calls: tuple[str, str] = ("", ""),
                 state_names: Sequence[str] | None = None):
        self.library = library
        self.params = params
        self.model_state = model_state
        self._apply = apply
        self._rebuild = rebuild
        self._takes_key = takes_key
        self._key_note = key_note  # why the model takes no key (the error of takes_key=True)
        self._state_in_compute_dtype = state_in_compute_dtype  # see `apply`
        # The layers whose behaviour depends on the mode ("model.bn (eqx.nn.BatchNorm)"): with
        # any, `apply` and `loss` need train=; `mode_calls` are the library's own ways to set
        # each mode (for the message).
        self._mode_layers = tuple(mode_layers)
        self._mode_calls = mode_calls
        # One name per leaf of model_state (jax.tree.leaves order), for the EvalModeWarning.
        self._state_names = (list(state_names) if state_names is not None else
                             ["model_state" + keystr(p) for p in key_paths(model_state)])

    def __repr__(self) -> str:
        leaves = jax.tree.leaves(self.params)
        size = sum(int(jnp.size(x)) for x in leaves)
        state = "None" if self.model_state is None else (
            f"{len(jax.tree.leaves(self.model_state))} leaves")
        return (f"Model({self.library}: {len(leaves)} params leaves, {size} elements; "
                f"model_state: {state})")

    def apply(self, params: PyTree, model_state: PyTree | None, *args: Any,
              key: jax.Array | None = None, train: bool | None = None,
              **kwargs: Any) -> tuple[Any, PyTree | None]:
        """Runs the model's forward pass: ``(outputs, new_model_state)``. Pure; jits.

        Args:
          params: same structure, shapes and dtypes as `Model.params` (e.g. ``state.params``).
          model_state: same structure as `Model.model_state` (None when it is None).
          *args: the model's inputs, as the library's own call takes them (linen
            ``module.apply(variables, *args)``, nnx ``model(*args)``, equinox
            ``model(*args[, state])``, one example at a time under ``jax.vmap`` unless
            ``from_equinox(..., axis_name=None)``).
          key: a PRNG key (``jax.random.key``) for dropout and other randomness: linen gets
            ``rngs={stream: key}``, equinox ``key=`` (split into one key per example under
            the vmap). nnx models draw from their own ``Rngs`` in `model_state`, so `key` must
            be None there.
          train: linen passes it to the module like any keyword (``train=True`` for a module
            whose ``__call__`` takes ``train``). nnx and equinox: True runs the model in
            training mode (nnx ``model.train()``, ``eqx.nn.inference_mode(model, False)``),
            False in evaluation mode (``model.eval()``, ``inference_mode(model, True)``: dropout
            off, BatchNorm uses its running statistics), None as the model was given, which
            only a model without mode-dependent layers may take (see Raises). An evaluation
            call (``train=False``) that changes `model_state` warns
            (`funcgrad.interop.EvalModeWarning`).
          **kwargs: passed to the model's call (linen: to ``module.apply``, e.g. ``method=``).
        Returns:
          ``(outputs, new_model_state)``; `new_model_state` has the structure, shapes and
          dtypes of `model_state` (None when the model has none). When `params` are a wider
          float than `model_state` (float64 params, float32 running statistics, as under
          ``check_grads``' float64 lifting) the model runs on the state widened to the
          params' dtype; an equinox model also runs on it narrowed to bfloat16/float16
          params (the train step's ``compute_dtype``), as its BatchNorm needs. The new state
          is cast back to `model_state`'s dtypes (float32 statistics stay float32).
        Raises:
          ValueError: if `params` or `model_state` do not have the model's structure and
            shapes (the message names the first differing leaf), for a key the library
            cannot use, or without `train` for an nnx or equinox model with layers that
            behave differently in training and evaluation (BatchNorm, dropout, a module with
            an ``inference`` field or a ``deterministic`` / ``use_running_average``
            attribute): the message names them.
        """
        if train is None and self._mode_layers:
            raise ValueError(self._mode_error("m.apply"))
        _check_like(params, self.params, "params", f"{self.library} model's")
        _check_like(model_state, self.model_state, "model_state", f"{self.library} model's")
        if model_state is None:
            return self._apply(params, model_state, args, kwargs, key, train)
        # Params wider than the state (float64 under check_grads' precision lifting): the
        # state is widened too, so that the library's in-place update (nnx writes
        # `mean[...] = ...` into the float32 buffer) never narrows a float64 value. equinox's
        # BatchNorm also needs it narrowed to bfloat16/float16 params (compute_dtype): its
        # lax.select refuses mixed dtypes. The new state comes back in the state's own
        # dtypes, as the train step's contract needs.
        state = _state_for_call(model_state, params, narrow=self._state_in_compute_dtype)
        outputs, new_state = self._apply(params, state, args, kwargs, key, train)
        if train is False:
            self._warn_if_changed(state, new_state)
        return outputs, _cast_like(new_state, model_state)

    def _mode_error(self, where: str) -> str:
        """The ValueError of `apply` / `loss` without train= on a mode-dependent model."""
        train_call, eval_call = self._mode_calls
        loss = (" For the train step: m.loss(objective, train=True)." if where == "m.loss"
                else "")
        return (f"{where}: the {self.library} model has layers that behave differently in "
                f"training and evaluation, so pass train=True or train=False: "
                f"{', '.join(self._mode_layers)}. train=True trains (as after {train_call}: "
                "BatchNorm normalizes with the batch statistics and updates its running "
                "statistics, dropout drops); train=False evaluates (as after "
                f"{eval_call}: BatchNorm uses its running statistics and leaves them, no "
                "dropout). Without train= the model would run in the mode it was built in "
                "(training, for a model fresh from its constructor), so an evaluation call "
                f"would update the statistics and draw dropout masks unseen.{loss}")

    def _warn_if_changed(self, state: PyTree, new_state: PyTree) -> None:
        """`funcgrad.interop.EvalModeWarning` when an evaluation call changed the model state.

        Eagerly the values are compared; under a trace (jit, grad) the new leaf being the
        very tracer passed in says the library left it alone (nnx, equinox and linen return
        an untouched leaf as it was given), so a written leaf is reported at trace time."""
        from funcgrad._adapter_warnings import EvalModeWarning
        from funcgrad._user_line import warn

        traced = False
        changed = []
        for name, old, new in zip(self._state_names, jax.tree.leaves(state),
                                  jax.tree.leaves(new_state)):
            if new is old:
                continue
            if isinstance(new, jax.core.Tracer) or isinstance(old, jax.core.Tracer):
                traced = True
                changed.append(name)
            elif not _same_values(old, new):
                changed.append(name)
        if not changed:
            return
        how = ("wrote new values into the model state (found while tracing, so the values "
               "themselves are not known)" if traced else "changed the model state")
        warn(f"m.apply(..., train=False) {how}: {', '.join(changed)}. An evaluation call "
             "should leave it as it is; a layer of the model ignores the mode (BatchNorm built "
             "with use_running_average=False, or the mode passed at its call: "
             "inference=False, use_running_average=False, deterministic=False), so its "
             "statistics or rng counts moved with this batch. Make that layer follow the "
             "mode, and evaluate with the state you passed in (not the one returned).",
             EvalModeWarning)

    def loss(self, objective: Callable[..., Any], *, inputs: str | Sequence[str] | Callable = "x",
             has_aux: bool = False, takes_key: bool | None = None, train: bool | None = None,
             **kwargs: Any) -> Loss:
        """Returns a `funcgrad.Loss` under funcgrad's loss contract for this model.

        The loss is ``objective(outputs, batch)``, where ``outputs, new_model_state =
        self.apply(params, model_state, *inputs(batch), key=key, train=train, **kwargs)``;
        it returns ``loss`` or ``(loss, aux)`` (with `has_aux`) and the new model state when
        the model has one (``has_state=True``), as ``make_train_step`` and ``fit`` expect.

        Args:
          objective: ``objective(outputs, batch) -> loss`` (a scalar, or one loss per example,
            shape ``(m,)``, for ``funcgrad.accumulate(loss, K)``), or ``(loss, aux)``
            with `has_aux` (aux: a pytree of arrays, e.g. ``{"accuracy": ...}``).
          inputs: how the model's inputs come from the batch: a key (``"x"``: the model gets
            ``batch["x"]``), a sequence of keys (several positional inputs) or a function
            ``batch -> args`` (a tuple, or one input).
          has_aux: whether `objective` returns ``(loss, aux)``.
          takes_key: whether the loss takes the train step's per-step key (``fold_in(seed
            key, step)``) and passes it to the model. Default: linen, True when the adapter has
            rng streams (``rngs=("dropout",)`` by default); equinox, True; nnx, False (and
            True is refused: nnx draws from the model's own ``Rngs``).
          train: as in `apply` (linen: passed to the module as its ``train`` keyword);
            ``train=True`` for the train step. Required for an nnx or equinox model with
            BatchNorm, dropout or other mode-dependent layers.
          **kwargs: passed to the model's call at every step.
        Returns:
          a ``funcgrad.Loss`` with ``has_state = model_state is not None``.
        Raises:
          ValueError: for ``takes_key=True`` on a model that takes no key (nnx; linen with
            ``rngs=()``; equinox whose ``__call__`` has no ``key``); without `train` on a
            model with mode-dependent layers (as `apply`); at the first call, if
            `objective` returns a tuple without `has_aux` or not a pair with it.
          TypeError: if `objective` is not callable or `inputs` is none of the forms above.
        """
        from funcgrad.train.loss import Loss  # the contract's own type (funcgrad/train/loss.py)

        fn, has_state, takes_key = self._loss_function(
            objective, inputs=inputs, has_aux=has_aux, takes_key=takes_key, train=train,
            **kwargs)
        return Loss(fn, has_aux=has_aux, has_state=has_state, takes_key=takes_key)

    def _loss_function(self, objective, *, inputs="x", has_aux=False, takes_key=None,
                       train=None, **kwargs):
        """The plain function behind `loss`, with its flags ``(fn, has_state, takes_key)``."""
        if not callable(objective):
            raise TypeError(f"{self.library} Model.loss: objective must be a function "
                            f"(outputs, batch) -> loss, got {type(objective).__name__}.")
        if takes_key is None:
            takes_key = self._takes_key
        elif takes_key and not self._takes_key:
            raise ValueError(f"Model.loss(takes_key=True): {self._key_note}")
        if train is None and self._mode_layers:
            raise ValueError(self._mode_error("m.loss"))
        args_of = _inputs(inputs)
        has_state = self.model_state is not None
        if train is not None:
            kwargs["train"] = train

        def loss_fn(params, batch, *, model_state=None, key=None):
            outputs, new_state = self.apply(params, model_state, *args_of(batch),
                                            key=key if takes_key else None, **kwargs)
            result = objective(outputs, batch)
            if has_aux:
                if not (isinstance(result, (tuple, list)) and len(result) == 2):
                    raise ValueError(
                        "Model.loss(has_aux=True): objective must return (loss, aux), got "
                        f"{_kind(result)}.")
                loss, aux = result
                return (loss, (new_state, aux)) if has_state else (loss, aux)
            if isinstance(result, (tuple, list)):
                raise ValueError(
                    f"Model.loss: objective returned {_kind(result)}; return the loss alone, "
                    "or (loss, aux) with Model.loss(objective, has_aux=True).")
            return (result, new_state) if has_state else result

        loss_fn.__name__ = getattr(objective, "__name__", "objective")
        loss_fn.__qualname__ = loss_fn.__name__
        # Warnings and errors name the user's objective line.
        cast(Any, loss_fn).__wrapped__ = objective
        return loss_fn, has_state, bool(takes_key)

    def rebuild(self, params: PyTree, model_state: PyTree | None = None) -> Any:
        """Returns the library's own object holding `params` and `model_state`, bit for bit.

        linen: the variables dict ``{"params": params, **model_state}`` (for
        ``module.apply``); nnx: a new module (``nnx.merge``) in the mode it was given in;
        equinox: the module (``eqx.combine``), or ``(module, state)`` when it has a state.
        ``m.rebuild(m.params, m.model_state)`` equals what the adapter was given.

        Raises:
          ValueError: if `params` or `model_state` do not have the model's structure and
            shapes (e.g. model_state left out for a model that has one).
        """
        _check_like(params, self.params, "params", f"{self.library} model's")
        _check_like(model_state, self.model_state, "model_state", f"{self.library} model's")
        return self._rebuild(params, model_state)

    def init_state(self, step: Any, *, seed: int | None = 0):
        """``step.init(self.params, model_state=self.model_state, seed=seed)``: the train
        state at step 0 of a `funcgrad.TrainStep` made from `Model.loss`.

        `seed` makes the state's base key (the key of step s is ``fold_in(key, s)``); nnx
        models draw from their own ``Rngs`` and get no key.

        Raises:
          TypeError: if `step` is not a `funcgrad.TrainStep` (an optax optimizer: make the
            step first, ``funcgrad.make_train_step(model.loss(objective), optimizer)``).
        Example:
          >>> step = fg.make_train_step(model.loss(cross_entropy, train=True), optax.adam(1e-3))
          >>> state = model.init_state(step)
        """
        if not getattr(step, "_is_train_step", False):
            raise TypeError(f"init_state takes the funcgrad.TrainStep to train with, got "
                            f"{type(step).__name__}: make it first, step = funcgrad."
                            "make_train_step(model.loss(objective, train=True), optimizer).")
        takes_key = step.loss.takes_key
        return step.init(self.params, model_state=self.model_state,
                         **({"seed": seed} if takes_key and seed is not None else {}))


def _floating(x: Any) -> bool:
    return jnp.issubdtype(_dtype(x), jnp.floating)


def _state_for_call(model_state: PyTree, params: PyTree, *, narrow: bool) -> PyTree:
    """`model_state` with its floating leaves cast to the widest floating dtype of `params`
    where they are narrower (float32 statistics, float64 params under check_grads' lifting),
    and also where they are wider when `narrow` (float32 statistics, bfloat16 params under
    the train step's ``compute_dtype``: for a library whose layers need the state in the
    dtype they compute in). The rest is unchanged."""
    dtypes = [_dtype(p) for p in jax.tree.leaves(params) if _floating(p)]
    if not dtypes:
        return model_state
    target = max(dtypes, key=lambda d: jnp.finfo(d).bits)
    bits = jnp.finfo(target).bits

    def cast(s):
        if not _floating(s) or _dtype(s) == target:
            return s
        wider = jnp.finfo(_dtype(s)).bits > bits
        return s.astype(target) if (narrow or not wider) else s

    return jax.tree.map(cast, model_state)


def _same_values(a: Any, b: Any) -> bool:
    """Whether two concrete leaves hold the same values (PRNG keys by their key data)."""
    if _dtype(a) != _dtype(b) or jnp.shape(a) != jnp.shape(b):
        return False
    if jax.dtypes.issubdtype(_dtype(a), jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


def momentum_note(name: str, layer: str, momentum: float, library: str) -> str:
    """The `funcgrad.interop.MomentumWarning` message for a BatchNorm momentum below 0.5."""
    return (f"{name}: {layer}(momentum={momentum!r}) keeps {momentum:.0%} of the running "
            f"statistics at each step and takes {1 - momentum:.0%} from the batch. In "
            f"{library}, momentum is the decay of the running average (running = momentum * "
            "running + (1 - momentum) * batch; default 0.99); in PyTorch it is the weight of "
            "the new batch (default 0.1). A port that kept PyTorch's value gets running "
            "statistics that follow each batch: PyTorch's momentum=m is "
            f"{library}'s 1 - m (0.9 for PyTorch's 0.1), or keep {library}'s default 0.99.")


#: Below this, a BatchNorm momentum is taken for PyTorch's meaning and noted.
MOMENTUM_NOTE_BELOW = 0.5


def _cast_like(new_state: PyTree, model_state: PyTree) -> PyTree:
    """`new_state` with each floating leaf cast to the dtype of its leaf in `model_state`."""
    return jax.tree.map(lambda n, s: n.astype(_dtype(s)) if _floating(s) else n,
                        new_state, model_state)


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _inputs(inputs: str | Sequence[str] | Callable) -> Callable[[Any], tuple]:
    """``batch -> args`` from `Model.loss`'s `inputs`."""
    if isinstance(inputs, str):
        return lambda batch: (_get(batch, inputs),)
    if callable(inputs):
        def args_of(batch):
            args = inputs(batch)
            return tuple(args) if isinstance(args, tuple) else (args,)
        return args_of
    if isinstance(inputs, Sequence) and inputs and all(isinstance(k, str) for k in inputs):
        return lambda batch: tuple(_get(batch, k) for k in inputs)
    raise TypeError(
        "Model.loss: inputs must be a batch key ('x'), a sequence of keys (('x', 'mask')) or "
        f"a function batch -> args; got {inputs!r}.")


def _get(batch: Any, key: str) -> Any:
    try:
        return batch[key]
    except (KeyError, TypeError, IndexError):
        keys = list(batch) if hasattr(batch, "keys") else type(batch).__name__
        raise ValueError(
            f"Model.loss: the batch has no {key!r} for the model's input (batch keys: {keys}). "
            "Pass inputs= the key of the model's input, or a function batch -> args.") from None


def _check_like(tree: PyTree, reference: PyTree, name: str, whose: str) -> None:
    """ValueError unless `tree` has the structure and shapes of `reference`, and its leaves
    the same kinds (floating, integer, PRNG key). Floating dtypes may differ (the train
    step's ``compute_dtype`` casts them). Static: runs at trace time only."""
    if reference is None or tree is None:
        if tree is None and reference is not None:
            raise ValueError(f"{name} is None, but the {whose} {name} is not: pass m.{name} "
                             f"(or state.{name} from the train state).")
        if tree is not None and reference is None:
            raise ValueError(f"{name} is given, but the {whose} {name} is None (it has "
                             "none): pass None.")
        return
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    ref_flat, ref_treedef = jax.tree_util.tree_flatten_with_path(reference)
    if treedef != ref_treedef:
        paths = {jax.tree_util.keystr(p) for p, _ in flat}
        ref_paths = {jax.tree_util.keystr(p) for p, _ in ref_flat}
        missing, extra = sorted(ref_paths - paths), sorted(paths - ref_paths)
        raise ValueError(
            f"{name} does not have the {whose} structure"
            + (f"; missing: {name}{missing[0]}" if missing else "")
            + (f"; not in the model: {name}{extra[0]}" if extra else "")
            + f". Pass a pytree like m.{name} (e.g. state.{name} from the train state).")
    for (path, leaf), (_, ref) in zip(flat, ref_flat):
        if jnp.shape(leaf) != jnp.shape(ref) or _leaf_kind(leaf) != _leaf_kind(ref):
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)} and dtype "
                f"{_dtype(leaf)}, but the {whose} has shape {jnp.shape(ref)} and dtype "
                f"{_dtype(ref)}.")


def _dtype(leaf: Any) -> Any:
    return getattr(leaf, "dtype", None) or jnp.result_type(leaf)


def _leaf_kind(leaf: Any) -> str:
    dtype = _dtype(leaf)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "key"
    return "floating" if jnp.issubdtype(dtype, jnp.inexact) else str(dtype)


#: The adapter for each library, by the module its base classes come from.
_ADAPTERS = {"flax.linen": "from_linen(module, variables)", "flax.nnx": "from_nnx(model)",
             "equinox": "from_equinox(model, state)"}


def _library_of(obj: Any) -> str | None:
    """"flax.linen", "flax.nnx" or "equinox" when `obj` is a module of that library (read
    from its classes' modules, so nothing is imported), else None."""
    for cls in type(obj).__mro__:
        name = cls.__module__
        if name.startswith("flax.linen"):
            return "flax.linen"
        if name.startswith("flax.nnx"):
            return "flax.nnx"
        if name.startswith("equinox"):
            return "equinox"
    return None


def _wrong_module(adapter: str, expected: str, obj: Any) -> str:
    """The TypeError message of an adapter given something that is not its library's module."""
    library = _library_of(obj)
    if library is not None and library != expected:
        return (f"{adapter} got a {library} module ({type(obj).__name__}); use "
                f"funcgrad.interop.{_ADAPTERS[library]}.")
    article = "an" if expected[0] in "aeiou" else "a"
    return f"{adapter}: expected {article} {expected} module, got {type(obj).__name__}."


def _call_takes(fn: Callable, name: str) -> bool:
    """Whether `fn` has a parameter called `name` (not merely ``**kwargs``)."""
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read
        return False
