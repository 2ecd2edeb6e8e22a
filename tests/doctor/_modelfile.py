"""Loads a planted-fault model file (tests/doctor/models/*.py) the way a reader of the
model-file contract would, independently of funcgrad.doctor, for the suite's own checks.

A model file defines ``init(key)`` -> params or (params, model_state) and ``loss`` (a function
or a ``funcgrad.Loss``), or ``model`` (from funcgrad.interop) and ``objective``; ``data`` (a
pytree of arrays with a leading example axis, or ``epoch -> iterable of batches``); optionally
``optimizer``, ``step`` (the ``funcgrad.TrainStep`` it trains with; else
``make_train_step(loss, optimizer)``), ``classes``, ``evaluate``; and ``EXPECT``.
"""
import functools
import importlib.util
import pathlib
import sys
import types
from collections.abc import Iterator

import jax
import numpy as np

import funcgrad as fg

MODELS = pathlib.Path(__file__).parent / "models"


def model_files() -> list[pathlib.Path]:
    """Every model file, sorted by name (files starting with '_' are not models)."""
    return sorted(p for p in MODELS.glob("*.py") if not p.name.startswith("_"))


def import_file(path: pathlib.Path) -> types.ModuleType:
    """Imports a model file as a fresh module (a new object on every call)."""
    name = f"_planted_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses/flax look modules up by name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


@functools.cache
def module_of(path: pathlib.Path) -> types.ModuleType:
    """The model file imported once per process (`load` and the EXPECT readers share it)."""
    return import_file(path)


class Loaded(types.SimpleNamespace):
    """A model file's pieces in one form: params, model_state, loss (a funcgrad.Loss),
    optimizer, step (the file's TrainStep, or make_train_step(loss, optimizer or Adam 1e-3)),
    classes, expect, and the data as batches."""

    def batches(self, size: int, epoch: int = 0) -> Iterator[dict]:
        """Batches of `size` examples (a data function's own batches, cut or joined to
        `size` rows when they differ)."""
        if callable(self.data):
            rows: list = []
            for e in range(epoch, epoch + 1000):
                for batch in self.data(e):
                    rows.append(jax.tree.map(np.asarray, batch))
                    have = sum(int(jax.tree.leaves(b)[0].shape[0]) for b in rows)
                    if have >= size:
                        joined = jax.tree.map(lambda *a: np.concatenate(a), *rows)
                        yield jax.tree.map(lambda a: a[:size], joined)
                        rows = []
            return
        tree = jax.tree.map(np.asarray, self.data)
        n = int(jax.tree.leaves(tree)[0].shape[0])
        order = np.random.default_rng(epoch).permutation(n)
        for i in range(0, n - size + 1, size):
            yield jax.tree.map(lambda a, r=order[i:i + size]: a[r], tree)

    def batch(self, size: int = 32) -> dict:
        """The first batch of `size` examples (of the unshuffled data for a pytree)."""
        if callable(self.data):
            return next(self.batches(size))
        return jax.tree.map(lambda a: np.asarray(a)[:size], self.data)

    def all_data(self) -> dict:
        """The whole data set as one pytree (a data function's first epoch, joined)."""
        if callable(self.data):
            parts = [jax.tree.map(np.asarray, b) for b in self.data(0)]
            return jax.tree.map(lambda *a: np.concatenate(a), *parts)
        return jax.tree.map(np.asarray, self.data)

    def bound(self, key: jax.Array | None = None):
        """The plain ``f(params, batch) -> scalar`` (the mean for a per-example loss), with the
        initial model state and a fixed key."""
        key = jax.random.key(1) if key is None and self.loss.takes_key else key
        f = self.loss.bind(self.model_state, key)
        return lambda p, b: f(p, b).mean()


def load(path: pathlib.Path) -> Loaded:
    module = module_of(path)
    if hasattr(module, "model"):
        m = module.model
        params, model_state = m.params, m.model_state
        loss = m.loss(module.objective, train=True)
    else:
        out = module.init(jax.random.key(0))
        params, model_state = out if isinstance(out, tuple) else (out, None)
        loss = fg.as_loss(module.loss) if not isinstance(module.loss, fg.Loss) else module.loss
    import optax

    optimizer = getattr(module, "optimizer", None)
    step = getattr(module, "step", None)
    if step is None:
        step = fg.make_train_step(loss, optimizer or optax.adam(1e-3))
    return Loaded(path=path, module=module, params=params, model_state=model_state, loss=loss,
                  data=module.data, optimizer=optimizer, step=step,
                  classes=getattr(module, "classes", None), expect=module.EXPECT)


def train(m: Loaded, steps: int, *, batch_size: int = 64, optimizer=None, seed: int = 0):
    """Runs `steps` train steps of the file's step (with its loss under `optimizer` instead,
    when given); returns (losses per step, final TrainState)."""
    step = m.step if optimizer is None else fg.make_train_step(m.step.loss, optimizer)
    state = step.init(m.params, model_state=m.model_state,
                      seed=seed if m.loss.takes_key else None)
    k = step.accumulate
    losses = []
    epoch = 0
    while len(losses) < steps:
        for batch in m.batches(batch_size, epoch):
            if k:
                batch = jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]),
                                     batch)
            state, metrics = step(state, batch)
            losses.append(float(np.mean(metrics["loss"])))
            if len(losses) >= steps:
                break
        epoch += 1
    return losses, state
