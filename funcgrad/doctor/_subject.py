"""The model a doctor examines, normalised once at the door: the user's train step, the params,
model state and key of its state, the data as a source of batches, and the options' hints."""
from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funcgrad.doctor._model_file import EXPECTED_FILE, ModelFileError, user_line

PyTree = Any


class Data:
    """Batches of the user's data, taken in as `funcgrad.fit` takes it
    (`funcgrad.train.batching.as_source`): a `funcgrad.Batches`, arrays with a leading example
    axis (batched by doctor's `batch_size` and `seed`), or a loader (an iterable of batches, or
    a function ``epoch -> iterable of batches``)."""

    def __init__(self, data: Any, *, batch_size: int, seed: int):
        from funcgrad.train.batching import Batches, as_source, is_function

        leaves = ([] if isinstance(data, (list, Batches)) or is_function(data)
                  else jax.tree.leaves(data))
        if any(not hasattr(x, "shape") for x in leaves):  # numbers, strings: not a dataset
            raise ModelFileError(
                "data must be a pytree of arrays with a leading example axis (e.g. "
                "{'x': (n, 64), 'y': (n,)}), a list of batches or a function epoch -> "
                f"iterable of batches; got {_describe(data)}.\n\n{EXPECTED_FILE}")
        try:
            source = as_source(data, where="doctor", batch_size=batch_size, seed=seed)
        except (TypeError, ValueError) as error:
            raise ModelFileError(f"{error}\n\n{EXPECTED_FILE}") from None
        self.loader: Callable[[int], Any] | None = None
        if source.batches is None:
            self.loader = (source.loader if is_function(source.loader)
                           else lambda epoch, batches=source.loader: batches)
            self.batch_size, self.seed = batch_size, seed
        else:
            # Training batches keep one shape (a jitted step compiles once): the last, partial
            # batch of each epoch is dropped, and a batch is at most the whole data.
            b = source.batches
            self.arrays = jax.tree.map(np.asarray, b.data)  # rows are taken on the host
            self.batches = dataclasses.replace(b, data=self.arrays, drop_last=True,
                                               batch_size=min(b.batch_size, b.n))
            self.batch_size, self.seed, self.n = b.batch_size, b.seed, b.n
        self._cached: list[PyTree] = []

    def _loader_batches(self) -> Iterator[PyTree]:
        """The loader's batches, epoch after epoch (the first ones cached)."""
        yield from self._cached
        for epoch in itertools.count():
            produced = False
            for i, batch in enumerate(self.loader(epoch) if self.loader else ()):
                produced = True
                if epoch == 0 and i < len(self._cached):
                    continue
                batch = jax.tree.map(np.asarray, batch)
                if len(self._cached) < 64:
                    self._cached.append(batch)
                yield batch
            if not produced:
                raise ModelFileError("data: the loader gave no batches for epoch "
                                     f"{epoch}.\n\n{EXPECTED_FILE}")

    def rows(self, n: int, start: int = 0) -> PyTree:
        """Examples ``start .. start+n-1`` (fewer when the data has fewer), as one batch."""
        if self.loader is None:
            n = min(n, self.n)
            start = min(start, max(0, self.n - n))
            return jax.tree.map(lambda x: x[start:start + n], self.arrays)
        got: list[PyTree] = []
        count = 0
        for batch in self._loader_batches():
            got.append(batch)
            count += _rows(batch)
            if count >= start + n or len(got) >= 64:
                break
        joined = jax.tree.map(lambda *xs: np.concatenate(xs), *got)
        total = _rows(joined)
        start = min(start, max(0, total - n))
        return jax.tree.map(lambda x: x[start:start + n], joined)

    def sample(self, limit: int = 50_000) -> PyTree:
        """Up to `limit` examples for the data checks: all of array data, or the first batches
        of a loader (at most 16 of them)."""
        if self.loader is None:
            return self.rows(limit)
        batches = list(itertools.islice(self._loader_batches(), 16))
        return jax.tree.map(lambda *xs: np.concatenate(xs)[:limit], *batches)

    def train_batches(self) -> Iterator[PyTree]:
        """Training batches without end: the `Batches`' epochs one after another, as
        ``fit`` would take them (the last, partial batch of an epoch dropped, so shapes stay
        fixed), or the loader's own batches."""
        if self.loader is not None:
            yield from self._loader_batches()
            return
        for epoch in itertools.count():
            yield from self.batches.epoch(epoch)


def _rows(batch: PyTree) -> int:
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


def _describe(tree: Any) -> str:
    try:
        return str(jax.tree.map(lambda x: tuple(np.shape(x)) if hasattr(x, "shape")
                                else type(x).__name__, tree))
    except Exception:  # noqa: BLE001 - a description only
        return type(tree).__name__


class Subject:
    """Everything a check needs about the model; built once by `funcgrad.doctor.doctor` from
    the user's step, its state, the data and the options.

    Attributes:
      step: the `funcgrad.TrainStep` as the checks run it (`funcgrad.doctor._steps.working`);
      loss: its `funcgrad.Loss`; params, model_state, key: the state's (the key None for a loss
      that takes none); accumulate: K or None; classes, evaluate: the options'; eval_loss: the
      `funcgrad.Loss` in the inference mode, or None; data (`Data`); seed, batch_size;
      source: the model file, or None.
    """

    def __init__(self, step: Any, state: Any, data: Any, options: Any,
                 source: str | None = None):
        from funcgrad.doctor._steps import working
        from funcgrad.train.loss import Loss, as_loss

        self.step = working(step)
        self.loss = step.loss
        self._described = repr(step)
        self.params, self.model_state = state.params, state.model_state
        self.key = state.key if self.loss.takes_key else None
        self.accumulate = step.accumulate
        self.eval_loss = None
        if options.eval_loss is not None:
            flags = {"has_aux": self.loss.has_aux, "has_state": self.loss.has_state,
                     "takes_key": self.loss.takes_key}
            try:
                self.eval_loss = (as_loss(options.eval_loss) if isinstance(options.eval_loss,
                                                                           Loss)
                                  else Loss(options.eval_loss, **flags))
            except (TypeError, ValueError) as error:
                raise ModelFileError(f"eval_loss: {error}\n\n{EXPECTED_FILE}") from None
        self.classes, self.evaluate = options.classes, options.evaluate
        self.data = Data(data, batch_size=options.batch_size, seed=options.seed)
        # A funcgrad.Batches given as data brings its own batch size and order.
        self.batch_size, self.seed, self.source = self.data.batch_size, options.seed, source

    # --- the loss as the analysis tools take it ---------------------------------------------

    def scalar_loss(self, params_name: str = "params") -> Callable[[PyTree, PyTree], jax.Array]:
        """``loss(params, batch) -> scalar``: the loss with the model state and key fixed (the
        mean of per-example losses under ``accumulate``), aux and new state dropped."""
        bound = self.loss.bind(self.model_state, self.key)

        def loss(params, batch):
            out = bound(params, batch)
            return jnp.mean(out) if jnp.ndim(out) else out
        loss.__name__ = loss.__qualname__ = getattr(self.loss.fn, "__name__", "loss")
        return loss

    def per_example_loss(self) -> Callable[[PyTree, PyTree], jax.Array]:
        """The loss as bound, unreduced (shape (m,) under ``accumulate``, else ())."""
        return self.loss.bind(self.model_state, self.key)

    def trained(self) -> list[bool]:
        """For each leaf of params (``jax.tree.leaves`` order): does the step train it?"""
        from funcgrad.doctor._steps import trained_flags

        return trained_flags(self.step, self.params)

    # --- the train step -----------------------------------------------------------------------

    def init(self, step: Any) -> Any:
        """`step`'s initial `TrainState` at this model's params, model state and key."""
        return step.init(self.params, model_state=self.model_state, key=self.key)

    def make_step(self, *, monitor: bool = False) -> tuple[Any, Any]:
        """``(step, state)``: the user's step (with the gradient monitor when asked:
        `funcgrad.doctor._steps.monitored`) and its initial `TrainState`."""
        from funcgrad.doctor._steps import monitored

        step = monitored(self) if monitor else self.step
        return step, self.init(step)

    def step_batch(self, batches: Iterator[PyTree], accumulate: bool = True) -> Any:
        """The next argument of the step: one batch, or K stacked micro-batches."""
        if self.accumulate and accumulate:
            from funcgrad.train.accumulate import stack_microbatches

            return stack_microbatches([next(batches) for _ in range(int(self.accumulate))])
        return next(batches)

    def preflight(self, batch: PyTree) -> None:
        """ModelFileError when the loss does not run on `batch` (data of the wrong shape, a
        loss that raises), naming the error and its line in the model file."""
        try:
            out = jax.eval_shape(self.scalar_loss(), self.params, batch)
        except Exception as error:  # noqa: BLE001 - the user's loss: reported as usage error
            where = user_line(error, self.source)
            text = str(error).strip().splitlines()
            first = next((line for line in text if line.strip()), type(error).__name__)
            raise ModelFileError(
                f"the loss does not run on a batch of the data ({_describe(batch)}): "
                f"{type(error).__name__}: {first}{where}. Check that the data has the shapes "
                f"the model expects and that loss(params, batch) runs.\n\n{EXPECTED_FILE}"
            ) from None
        if getattr(out, "shape", None) != () or not jnp.issubdtype(out.dtype, jnp.floating):
            raise ModelFileError(
                f"the loss must return a real scalar (one loss per example, shape (m,), with "
                f"accumulate), got {getattr(out, 'dtype', type(out).__name__)}"
                f"{list(getattr(out, 'shape', ()))}.\n\n{EXPECTED_FILE}")

    def describe(self) -> str:
        leaves = [x for x in jax.tree.leaves(self.params) if hasattr(x, "size")]
        size = sum(int(x.size) for x in leaves)
        data = (f"{self.data.n} examples" if self.data.loader is None else "a loader")
        name = os.path.basename(self.source) if self.source else "model"
        return (f"{name}: {len(leaves)} params leaves ({size:,} elements), {data}, "
                f"{self._described}")

