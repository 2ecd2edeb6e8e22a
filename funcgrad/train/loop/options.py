"""What `fit` is told besides its step, state and data, each as one value: where it checkpoints
(`Checkpointing`), what it shows as it runs (`Progress`) and how it runs its steps
(`FitOptions`); and where each of fit's former keywords went (`MOVED_KEYWORDS`)."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

#: fit's former keywords (and its second positional argument) and the value that holds each.
MOVED_KEYWORDS = {
    "y": "pass the batching as data: fit(step, state, fg.Batches(x, y, batch_size=32), ...)",
    "batch_size": "it belongs to the data: fit(step, state, fg.Batches(data, "
                  "batch_size=32), ...)",
    "seed": "it belongs to the data: fit(step, state, fg.Batches(data, batch_size=32, "
            "seed=0), ...)",
    "checkpoint_dir": "checkpoint=fg.Checkpointing('runs/ck', every=1, resume=False)",
    "every": "checkpoint=fg.Checkpointing(directory, every=5)",
    "resume": "checkpoint=fg.Checkpointing(directory, resume=True)",
    "log": "progress=print (each epoch's line, no bar), or progress=fg.Progress(print, "
           "bar=True) (the line and the bar)",
    "on_nonfinite": "options=fg.FitOptions(on_nonfinite='skip')",
    "chunk": "options=fg.FitOptions(chunk=1)",
    "optimistic": "options=fg.FitOptions(optimistic=False)",
}


def _positive_int(value: Any) -> bool:
    return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and bool(value >= 1))


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Where and when `funcgrad.fit` checkpoints its run, and whether it resumes from there.

    The whole state (params, optimizer state, model state, key, loss scale, monitor state,
    step) and the run's position and history are saved with orbax-checkpoint
    (`funcgrad.save_checkpoint`) every `every` epochs, when the run stops on a non-finite step
    (the last finite state), on Ctrl-C, at the end, and at an exception (not in a run of
    several processes: the save waits for every process; the last periodic checkpoint is
    kept). With `resume`, fit continues from the newest checkpoint in `directory` (its epoch
    and batch; a folder with none starts the run), so 10 epochs equal 5, a stop and 5 more:
    bit for bit when both runs compile to the same programs (see `funcgrad.fit`).

    Attributes:
      directory: the folder (str or path), created when needed.
      every: epochs between periodic checkpoints, a positive int.
      resume: continue from the newest checkpoint in `directory`.
    Raises:
      TypeError: a `directory` that is not a str or path, a `resume` that is not a bool.
      ValueError: an empty `directory`, an `every` that is not a positive int.
    Example:
      >>> ck = fg.Checkpointing(tmp_path / "ck", every=2)
      >>> first = fg.fit(step, state, data, epochs=2, checkpoint=ck, progress=False)
      >>> more = fg.fit(step, state, data, epochs=4, progress=False,
      ...               checkpoint=fg.Checkpointing(tmp_path / "ck", resume=True))
      >>> int(more.state.step) == 2 * int(first.state.step)
      True
    """
    directory: str | os.PathLike
    every: int = dataclasses.field(default=1, kw_only=True)
    resume: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.directory, (str, os.PathLike)):
            raise TypeError(f"Checkpointing: directory must be a str or a path, got "
                            f"{type(self.directory).__name__}.")
        if not os.fspath(self.directory):
            raise ValueError("Checkpointing: directory is empty; name the folder, e.g. "
                             "'runs/ck'.")
        if not _positive_int(self.every):
            raise ValueError(f"Checkpointing: every must be a positive int (epochs between "
                             f"checkpoints), got {self.every!r}.")
        if not isinstance(self.resume, (bool, np.bool_)):
            raise TypeError(f"Checkpointing: resume must be True or False, got "
                            f"{self.resume!r}.")


@dataclasses.dataclass(frozen=True)
class Progress:
    """What `funcgrad.fit` shows as it runs: a progress bar, each epoch's line, both, or
    nothing (``Progress()``).

    fit's ``progress=`` also takes the common cases directly: True is ``Progress(bar=True)``
    (the default), False or None is ``Progress()``, and a function such as `print` is
    ``Progress(print)``. The bar moves once per dispatch of steps, so a run that shows it
    runs one epoch per dispatch (without it, several epochs may run in one).

    Attributes:
      lines: called with each epoch's summary line and each monitor alert (the first
        `funcgrad.train.fit.MAX_LOGGED_ALERTS`; all are kept in the history), and a Ctrl-C's
        note; e.g. `print`, ``logging.info``, ``lines.append``. None: no lines.
      bar: a tqdm progress bar of the steps on stderr (lines are written around it).
    Raises:
      TypeError: a `lines` that is not callable, a `bar` that is not a bool.
    Example:
      >>> lines = []
      >>> _ = fg.fit(step, state, data, epochs=2, progress=fg.Progress(lines.append))
      >>> len(lines), lines[0].split()[1]           # "epoch   1  loss ..."
      (2, '1')
    """
    lines: Callable[[str], None] | None = None
    bar: bool = False

    def __post_init__(self):
        if self.lines is not None and not callable(self.lines):
            raise TypeError(f"Progress: lines must be a function of one string (e.g. print), "
                            f"got {type(self.lines).__name__}.")
        if not isinstance(self.bar, (bool, np.bool_)):
            raise TypeError(f"Progress: bar must be True or False, got {self.bar!r}.")


def as_progress(progress: Any) -> Progress:
    """fit's ``progress=`` as a `Progress` (True: the bar; False or None: nothing; a
    function: its lines)."""
    if isinstance(progress, Progress):
        return progress
    if progress is None or isinstance(progress, (bool, np.bool_)):
        return Progress(bar=bool(progress))
    if callable(progress):
        return Progress(progress)
    raise TypeError(f"fit: progress must be True, False, a function of one string (e.g. print) "
                    f"or a funcgrad.Progress, got {type(progress).__name__}.")


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """How `funcgrad.fit` runs its steps: what it does at a non-finite step, how many steps one
    dispatch runs, and whether a chunk runs unguarded first. The defaults are the fast, safe
    choice; each option trades speed for something else.

    Attributes:
      on_nonfinite: "stop" (fit returns the state from before the first step whose loss,
        gradient norm or update is NaN/inf, with a `funcgrad.NonFiniteReport`) or "skip" (go
        on past such batches, each recorded in ``History.skipped_batches``; the step's guard
        left params and optimizer state untouched).
      chunk: steps per dispatch, a positive int, or None (array data: all the full batches
        of an epoch, at most 1,024, or several epochs when nothing on the host needs their
        numbers in between; a loader's batches: 64 stacked per transfer). 1 calls the step
        once per batch.
      optimistic: run each chunk first with the step's ``unguarded`` form (the guard's test
        without its per-leaf selects, 1.2x on a 1.1M-parameter MLP), keeping the chunk's
        starting state; a chunk in which a step was skipped runs again from that state,
        guarded, so no non-finite update is ever applied. Not with a loss scale or
        ``on_nonfinite="skip"``. False: the guarded step only, which donates the state (half
        the state's memory during a chunk), one epoch per dispatch.
    Raises:
      ValueError: an unknown `on_nonfinite`, a `chunk` that is not a positive int.
      TypeError: an `optimistic` that is not a bool.
    Example:
      >>> got = fg.fit(step, state, data, epochs=1, progress=False,
      ...              options=fg.FitOptions(on_nonfinite="skip", chunk=1))
      >>> got.nonfinite is None
      True
    """
    on_nonfinite: str = "stop"
    chunk: int | None = None
    optimistic: bool = True

    def __post_init__(self):
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"FitOptions: on_nonfinite must be 'stop' or 'skip', got "
                             f"{self.on_nonfinite!r}.")
        if self.chunk is not None and not _positive_int(self.chunk):
            raise ValueError(f"FitOptions: chunk must be a positive int (steps per dispatch) "
                             f"or None, got {self.chunk!r}.")
        if not isinstance(self.optimistic, (bool, np.bool_)):
            raise TypeError(f"FitOptions: optimistic must be True or False, got "
                            f"{self.optimistic!r}.")
