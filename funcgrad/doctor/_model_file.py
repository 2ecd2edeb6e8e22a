"""Model files: a Python file that defines a model, its loss and data for `funcgrad doctor`."""
from __future__ import annotations

import importlib.util
import os
import sys
import traceback
import types
import uuid
from typing import Any

#: The layout of a model file, shown by ``funcgrad doctor --help`` and by every usage error.
EXPECTED_FILE = '''\
A model file defines, at module level:

    import jax, optax, funcgrad as fg

    def init(key):                   # -> params, or (params, model_state)
        return fg.mlp_init(key, (64, 32, 10))

    def loss(params, batch):         # a function, or fg.Loss(fn, has_state=, takes_key=,
        logits = fg.mlp_apply(params, batch["x"])            # has_aux=) as for the train step
        return fg.softmax_cross_entropy(logits, batch["y"])

    data = {"x": x, "y": y}          # arrays with a leading example axis, or a function
                                     # epoch -> iterable of batches
    # optional:
    optimizer = optax.adam(1e-3)     # any optax optimizer (default: Adam 1e-3)
    step = fg.make_train_step(loss, optax.chain(fg.clip_by_global_norm(1.0), optimizer))
                                     # (default: make_train_step(loss, optimizer)); its loss
                                     # may carry fg.accumulate, fg.mixed_precision
    classes = 10                     # K, for the loss at init against log(K)
    def evaluate(params): ...        # (params[, model_state]) -> {name: number}

For flax and equinox, define `model` and `objective` instead of `init` and `loss`:

    model = funcgrad.interop.from_linen(module, variables)   # or from_nnx, from_equinox
    def objective(outputs, batch):                           # the model's outputs -> loss
        return fg.softmax_cross_entropy(outputs, batch["y"])
    # optional: step = fg.make_train_step(model.loss(objective, train=True), optimizer, ...)
'''


class ModelFileError(ValueError):
    """A model file (or the pieces given to `funcgrad.doctor`) that cannot be examined: a missing
    name, a file that raises on import, a loss that does not run on the data, data of the wrong
    shape. The message names the piece and shows the expected layout; ``funcgrad doctor``
    prints it and exits with status 2."""


def load_model_file(path: str | os.PathLike, *, seed: int = 0) -> dict[str, Any]:
    """Imports the model file at `path` and returns what `funcgrad.doctor` takes.

    The file's `step` (a `funcgrad.TrainStep`) is the step examined; without one, the step is
    ``make_train_step(loss, optimizer)`` (Adam, learning rate 1e-3, without `optimizer`). A
    file with `model` and `objective` has the loss ``model.loss(objective, train=True)``
    (plainly for a linen module whose call takes no ``train``) and the inference-mode loss
    ``model.loss(objective, train=False)`` for the held-out loss.

    Args:
      path: the model file.
      seed: the seed of the state's PRNG key, for a loss that takes a key.
    Returns:
      a dict with "step" (a `funcgrad.TrainStep`), "state" (its `funcgrad.TrainState` at the
      params of ``init(jax.random.key(0))`` or the model's), "data", "classes", "evaluate",
      "eval_loss" (None where the file does not define them) and "source" (the file's path).
    Raises:
      ModelFileError: the file is missing or not Python, raises on import (the message gives
        the exception and the file's line), lacks `init`/`loss` (or `model`/`objective`) or
        `data`, defines a `step` that is not a TrainStep or the former `step_kwargs`, or
        `init(key)` raises or returns something that is not params (or no model state for a
        loss that has one).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelFileError(f"funcgrad doctor: no model file {path!r}.\n\n{EXPECTED_FILE}")
    module = _import(path)
    names = vars(module)
    if "step_kwargs" in names:
        raise ModelFileError(
            f"{path}: step_kwargs is no longer read; define the step you train with instead: "
            "step = fg.make_train_step(loss, optimizer), with clipping in the optimizer's chain, "
            "accumulate and "
            "mixed precision as pieces of the loss (fg.accumulate(loss, 4), "
            f"fg.mixed_precision(loss, jnp.bfloat16)).\n\n{EXPECTED_FILE}")
    step = names.get("step")
    if step is not None and not _is_train_step(step):
        raise ModelFileError(f"{path}: `step` must be a funcgrad.TrainStep "
                             "(fg.make_train_step(loss, optimizer, ...)); got "
                             f"{type(step).__name__}.\n\n{EXPECTED_FILE}")
    pieces: dict[str, Any] = {name: names.get(name) for name in
                              ("data", "classes", "evaluate")}
    pieces["source"] = path
    if "model" in names or "objective" in names:
        loss, params, model_state, pieces["eval_loss"] = _from_adapter(path, names)
    else:
        needed = ("init",) if step is not None else ("init", "loss")
        missing = [name for name in needed if not callable(names.get(name))]
        if missing:
            raise ModelFileError(
                f"{path}: the model file does not define {' and '.join(missing)} (a "
                f"function{'s' if len(missing) > 1 else ''} at module level); found "
                f"{_defined(names)}.\n\n{EXPECTED_FILE}")
        loss, pieces["eval_loss"] = names.get("loss"), None
        params, model_state = _initialised(path, names["init"])
    if pieces["data"] is None:
        raise ModelFileError(f"{path}: the model file does not define data (arrays with a "
                             f"leading example axis, or a function epoch -> iterable of "
                             f"batches); found {_defined(names)}.\n\n{EXPECTED_FILE}")
    pieces["step"] = step if step is not None else _step_of(path, loss, names.get("optimizer"))
    pieces["state"] = _state_of(path, pieces["step"], params, model_state, seed)
    return pieces


def _is_train_step(value: Any) -> bool:
    from funcgrad.train.step import TrainStep

    return isinstance(value, TrainStep)


def _step_of(path: str, loss: Any, optimizer: Any) -> Any:
    """``make_train_step(loss, optimizer)`` (Adam 1e-3 without one), its errors the file's."""
    from funcgrad.train.optimizers import make_optimizer
    from funcgrad.train.step import make_train_step

    try:
        return make_train_step(loss, make_optimizer("adam", 1e-3) if optimizer is None
                               else optimizer)
    except (TypeError, ValueError) as error:
        raise ModelFileError(f"{path}: make_train_step(loss, optimizer) raised: "
                             f"{_first_line(error)}\n\n{EXPECTED_FILE}") from None


def _state_of(path: str, step: Any, params: Any, model_state: Any, seed: int) -> Any:
    """``step.init`` at the file's params and model state (a key from `seed` for a loss that
    takes one), its errors the file's."""
    if step.loss.has_state and model_state is None:
        raise ModelFileError(f"{path}: the loss {step.loss!r} declares model state, but "
                             "init(key) returned no model state: return (params, model_state)."
                             f"\n\n{EXPECTED_FILE}")
    try:
        return step.init(params, model_state=model_state,
                         seed=seed if step.loss.takes_key else None)
    except (TypeError, ValueError) as error:
        raise ModelFileError(f"{path}: step.init(params) raised: {_first_line(error)}\n\n"
                             f"{EXPECTED_FILE}") from None


def _import(path: str) -> types.ModuleType:
    """The module of `path`, imported under a fresh name (the file's folder on sys.path while
    it imports, for its own helper modules)."""
    name = f"_funcgrad_model_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path}: not a Python file that can be imported (give a .py "
                             f"file).\n\n{EXPECTED_FILE}")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # SystemExit and KeyboardInterrupt from a file too
        if isinstance(error, KeyboardInterrupt):
            raise
        raise ModelFileError(f"{path}: importing the model file raised "
                             f"{type(error).__name__}: {error}{user_line(error, path)}.\n\n"
                             f"{EXPECTED_FILE}") from None
    finally:
        sys.path.remove(folder)
    return module


def user_line(error: BaseException, path: str | None) -> str:
    """" (at model.py:12, in loss)": the innermost frame of `error`'s traceback in the file
    `path` (else in any file outside funcgrad, jax and the standard library), or ""."""
    frames = traceback.extract_tb(error.__traceback__)
    inside = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # funcgrad/
    for frame in reversed(frames):
        if path is not None and os.path.abspath(frame.filename) == os.path.abspath(path):
            return f" (at {os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})"
    for frame in reversed(frames):
        file = os.path.abspath(frame.filename)
        if not (file.startswith(inside) or "site-packages" in file or "/lib/python" in file
                or file.startswith("<")):
            return f" (at {os.path.basename(file)}:{frame.lineno}, in {frame.name})"
    return ""


def _defined(names: dict[str, Any]) -> str:
    public = sorted(n for n, v in names.items()
                    if not n.startswith("_") and not isinstance(v, types.ModuleType))
    return ", ".join(public) if public else "nothing"


def _initialised(path: str, init: Any) -> tuple[Any, Any]:
    """``init(key)`` as ``(params, model_state)``."""
    import jax

    try:
        out = init(jax.random.key(0))
    except Exception as error:  # noqa: BLE001 - reported as the file's fault
        raise ModelFileError(f"{path}: init(key) raised {type(error).__name__}: "
                             f"{_first_line(error)}{user_line(error, path)}.\n\n"
                             f"{EXPECTED_FILE}") from None
    if isinstance(out, tuple) and len(out) == 2:
        params, model_state = out
    else:
        params, model_state = out, None
    if not jax.tree.leaves(params):
        raise ModelFileError(f"{path}: init(key) returned {type(out).__name__} with no array "
                             "leaves; it must return the params (a pytree of arrays), or "
                             f"(params, model_state).\n\n{EXPECTED_FILE}")
    return params, model_state


def _from_adapter(path: str, names: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """`model` (from `funcgrad.interop`) and `objective` as (loss, params, model state,
    inference-mode loss or None)."""
    from funcgrad.interop import Model

    model, objective = names.get("model"), names.get("objective")
    if not isinstance(model, Model) or not callable(objective):
        wrong = ("model" if not isinstance(model, Model) else "objective")
        got = type(names.get(wrong)).__name__ if wrong in names else "nothing"
        want = ("the result of funcgrad.interop.from_linen, from_nnx or from_equinox"
                if wrong == "model" else "a function (outputs, batch) -> loss")
        raise ModelFileError(f"{path}: `{wrong}` must be {want}; got {got}.\n\n"
                             f"{EXPECTED_FILE}")
    # The training mode (BatchNorm's batch statistics, dropout), as the train step uses the
    # model; a model whose call takes no `train` (a linen module without the keyword) plainly.
    try:
        loss = model.loss(objective, train=True)
    except ValueError as error:
        raise ModelFileError(f"{path}: model.loss(objective, train=True) raised: "
                             f"{_first_line(error)}\n\n{EXPECTED_FILE}") from None
    if model.library == "flax.linen" and not _runs(loss, model, names.get("data")):
        plain = model.loss(objective)
        if _runs(plain, model, names.get("data")):
            return plain, model.params, model.model_state, None
    try:  # evaluation (the baseline's held-out loss) in the inference mode
        eval_loss = model.loss(objective, train=False, takes_key=False)
    except (TypeError, ValueError):
        eval_loss = None
    return loss, model.params, model.model_state, eval_loss


def _runs(loss: Any, model: Any, data: Any) -> bool:
    """Whether `loss` traces on two examples of `data` (True when that cannot be told: a
    loader, data of another kind; the doctor's preflight then names any error)."""
    import jax
    import numpy as np

    leaves = jax.tree.leaves(data) if data is not None and not callable(data) \
        and not isinstance(data, list) else []
    if not leaves or not all(hasattr(x, "shape") and np.ndim(x) >= 1 for x in leaves):
        return True
    batch = jax.tree.map(lambda x: np.asarray(x[:2]), data)
    key = jax.random.key(0) if loss.takes_key else None
    try:
        jax.eval_shape(loss.bind(model.model_state, key), model.params, batch)
    except TypeError:
        return False
    except Exception:  # noqa: BLE001 - another error: the preflight reports it with its line
        return True
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
