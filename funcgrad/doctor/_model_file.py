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

    import jax, funcgrad as fg

    def init(key):                   # -> params, or (params, model_state)
        return fg.mlp_init(key, (64, 32, 10))

    def loss(params, batch):         # a function, or fg.Loss(fn, has_state=, takes_key=,
        logits = fg.mlp_apply(params, batch["x"])            # has_aux=) as for the train step
        return fg.softmax_cross_entropy(logits, batch["y"])

    data = {"x": x, "y": y}          # arrays with a leading example axis, or a function
                                     # epoch -> iterable of batches
    # optional:
    optimizer = fg.make_optimizer("adam", 1e-3)   # any optax optimizer (default: Adam 1e-3)
    step_kwargs = {"clip_norm": 1.0}              # make_train_step keywords: accumulate,
                                                  # clip_norm, loss_scale, compute_dtype, trainable
    classes = 10                                  # K, for the loss at init against log(K)
    def evaluate(params): ...                     # (params[, model_state]) -> {name: number}

For flax and equinox, define `model` and `objective` instead of `init` and `loss`:

    model = funcgrad.interop.from_linen(module, variables)   # or from_nnx, from_equinox
    def objective(outputs, batch):                           # the model's outputs -> loss
        return fg.softmax_cross_entropy(outputs, batch["y"])
'''


class ModelFileError(ValueError):
    """A model file (or the pieces given to `funcgrad.doctor`) that cannot be examined: a missing
    name, a file that raises on import, a loss that does not run on the data, data of the wrong
    shape. The message names the piece and shows the expected layout; ``funcgrad doctor``
    prints it and exits with status 2."""


def load_model_file(path: str | os.PathLike) -> dict[str, Any]:
    """Imports the model file at `path` and returns its pieces.

    Returns:
      a dict with "loss" (a function or `funcgrad.Loss`), "params", "model_state" (None when
      the model has none), "data", "optimizer", "step_kwargs", "classes", "evaluate" (None
      where the file does not define them) and "source" (the file's path). A file with
      `model` and `objective` gives ``model.loss(objective, train=True)`` (plainly for a
      linen module whose call takes no ``train``), "eval_loss" (``train=False``, for the
      held-out loss) and the model's params and model state.
    Raises:
      ModelFileError: the file is missing or not Python, raises on import (the message gives
        the exception and the file's line), lacks `init`/`loss` (or `model`/`objective`) or
        `data`, or `init(key)` raises or returns something that is not params.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelFileError(f"funcgrad doctor: no model file {path!r}.\n\n{EXPECTED_FILE}")
    module = _import(path)
    names = vars(module)
    pieces: dict[str, Any] = {name: names.get(name) for name in
                              ("data", "optimizer", "step_kwargs", "classes", "evaluate")}
    pieces["source"] = path
    if "model" in names or "objective" in names:
        pieces.update(_from_adapter(path, names))
    else:
        missing = [name for name in ("init", "loss") if not callable(names.get(name))]
        if missing:
            raise ModelFileError(
                f"{path}: the model file does not define {' and '.join(missing)} (a "
                f"function{'s' if len(missing) > 1 else ''} at module level); found "
                f"{_defined(names)}.\n\n{EXPECTED_FILE}")
        pieces["loss"] = names["loss"]
        pieces["params"], pieces["model_state"] = _initialised(path, names["init"])
    if pieces["data"] is None:
        raise ModelFileError(f"{path}: the model file does not define data (arrays with a "
                             f"leading example axis, or a function epoch -> iterable of "
                             f"batches); found {_defined(names)}.\n\n{EXPECTED_FILE}")
    return pieces


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


def _from_adapter(path: str, names: dict[str, Any]) -> dict[str, Any]:
    """`model` (from `funcgrad.interop`) and `objective` as loss, params and model state."""
    from funcgrad.interop._model import Model

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
            return {"loss": plain, "params": model.params, "model_state": model.model_state}
    try:  # evaluation (the baseline's held-out loss) in the inference mode
        eval_loss = model.loss(objective, train=False, takes_key=False)
    except (TypeError, ValueError):
        eval_loss = None
    return {"loss": loss, "params": model.params, "model_state": model.model_state,
            "eval_loss": eval_loss}


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
