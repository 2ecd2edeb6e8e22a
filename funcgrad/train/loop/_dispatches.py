"""What each of a `fit` run's dispatches of array data runs: several epochs in one call when
nothing on the host needs their numbers in between (`ChunkRunner.epochs`), and the next
dispatch launched ahead, before the host records the one just read.

While the epochs of one call are recorded the state is already past them, so the log lines
they raise are held until the last of them is recorded (no user code runs in between), and a
Ctrl-C takes effect after them. A call in which a step was bad is dropped and its epochs run
one by one, which finds the step as a run of one epoch per dispatch does.
"""
from __future__ import annotations

import functools
from typing import Any, cast

import jax
import numpy as np

from funcgrad.train.loop._record import fetched

#: Most steps one dispatch runs by default: array data (all the full batches of an epoch, up
#: to this, or as many whole epochs as fit in it), and a loader's batches stacked per transfer.
MAX_CHUNK, LOADER_CHUNK = 1024, 64


class Dispatches:
    """The part of a run (`funcgrad.train.loop._epochs._Run`) that plans its dispatches of
    several epochs and launches the next one ahead. The run sets: ``state``, ``owned``,
    ``fast`` (its unguarded `ChunkRunner` or None), ``chunk``, ``epochs``, ``data``, ``key``,
    ``write`` (the log writer), and calls `_init_dispatches` with ``epochs_per_dispatch``
    (fit's ``epoch -> how many epochs from it the host leaves unobserved``)."""
    state: Any
    owned: bool
    fast: Any
    chunk: Any
    epochs: int
    data: Any
    key: Any
    write: Any

    def _init_dispatches(self, epochs_per_dispatch) -> None:
        self.ahead: Any = None  # (epoch, step, what was launched, its result, its start state)
        self.epochs_per_dispatch = epochs_per_dispatch or (lambda epoch: 1)
        self.group: _Group | None = None  # the epochs of the last call of several
        self.ungrouped_until = 0  # epochs run one by one after a bad step in a call
        self.held: list[str] | None = None  # log lines held while such a call is recorded

    def say(self, line: str) -> None:
        """Passes `line` to the log, or holds it while the epochs of one dispatch are being
        recorded (the state is already their last one's: no user code runs in between)."""
        if self.held is not None:
            self.held.append(line)
        else:
            self.write(line)

    def holds(self, epoch: int) -> bool:
        """Whether `epoch` was run by the last dispatch of several epochs (the state is past
        it): its rows are recorded whatever happens, a Ctrl-C included."""
        return self.group is not None and self.group.first <= epoch <= self.group.last

    def epoch_ended(self, epoch: int) -> None:
        """After `epoch`'s row: the log lines held for a dispatch of several epochs go out
        once its last epoch is recorded."""
        if self.held is not None and self.group is not None and epoch >= self.group.last:
            lines, self.held = self.held, None
            for line in lines:
                self.write(line)

    # --- dispatches of several epochs, and the next one launched ahead -------------------
    def _from_group(self, epoch, shape, stopper):
        """``(count, rows)`` of `epoch`, from step 0, when it runs in one dispatch with the
        epochs after it (`ChunkRunner.epochs`), launched now or ahead; None when it runs on
        its own. A dispatch in which a step was bad is dropped: its epochs then run one by
        one (unguarded, then guarded from the chunk with the bad step)."""
        if not self.holds(epoch):
            m = self._group_size(epoch, shape)
            if m < 2:
                return None
            launched = self._ahead_for(epoch, 0, ("epochs", m))
            if launched is None:
                launched = self._launch_group(epoch, m, shape, self.state)
            state, counts, rows = launched
            got = fetched(counts, rows)
            if np.asarray(got[1]["bad"]).any():
                self.ungrouped_until = epoch + m - 1
                return None
            self.group = _Group(epoch, epoch + m - 1, got)
            self.state, self.owned = state, True
            self.held = []  # the log waits until every epoch of it is recorded
            if not stopper.raised:
                self._launch_ahead(self.group.last + 1, shape, None)
        group = cast(_Group, self.group)
        counts, rows = group.got
        e = epoch - group.first
        one = {k: (tuple(_Epoch(d, e) for d in v) if k == "monitor_dead" else v[e])
               for k, v in rows.items()}
        return counts[e], one

    def _group_size(self, epoch, shape) -> int:
        """How many epochs from `epoch` on run in one dispatch (1: on its own)."""
        if self.fast is None or self.chunk is not None or epoch <= self.ungrouped_until:
            return 1
        return max(1, min(self.epochs_per_dispatch(epoch), self.epochs - epoch + 1,
                          _most_epochs(shape)))

    def _launch_group(self, epoch, m, shape, state):
        full, size, tail, b = shape
        return self.fast.epochs(state, self.data, self.key, np.int32(epoch - 1), np.int32(m),
                                most=_most_epochs(shape), length=full, size=size, tail=tail,
                                batch_size=b)

    def _launch_ahead(self, epoch, shape, length) -> None:
        """The first dispatch of `epoch` (from its step 0) goes to the device now, from this
        state (an unguarded call does not consume it): the host's work on the rows just
        read (the history, the evaluation, a checkpoint) overlaps it. Used only if the
        epoch starts from this very state (`_ahead_for`)."""
        if epoch > self.epochs or self.fast is None:
            return
        m = self._group_size(epoch, shape)
        full, size, tail, b = shape
        what: tuple
        if m >= 2:
            what, launched = ("epochs", m), self._launch_group(epoch, m, shape, self.state)
        else:
            following = min(length or self.chunk or max(1, min(full, MAX_CHUNK)), full)
            last_tail = tail if following == full else 0
            what = ("chunk", following, last_tail)
            launched = self.fast.gathered(
                self.state, self.data, self.key, np.int32(epoch - 1), np.int32(0),
                np.int32(following), length=following, size=size, tail=last_tail,
                batch_size=b)
        self.ahead = (epoch, 0, what, launched, self.state)

    def _ahead_for(self, epoch, start, what):
        """The result launched ahead for this dispatch (`epoch`, from step `start`, `what`),
        if it started from the current state; None otherwise. Forgets it either way."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[:3] == (epoch, start, what) and ahead[4] is self.state:
            return ahead[3]
        return None


class _Group:
    """The epochs ``first .. last`` (numbered from 1) of one dispatch and their fetched
    ``(counts, rows)``, each with a leading epoch axis."""

    def __init__(self, first: int, last: int, got: tuple):
        self.first, self.last, self.got = first, last, got


class _Epoch:
    """Epoch `e`'s rows of a device array of several epochs' rows, read only where indexed
    (the monitor's dead-unit masks stay on the device until an alert needs one)."""

    def __init__(self, rows: Any, e: int):
        self.rows, self.e = rows, e

    def __getitem__(self, i):
        return self.rows[self.e, i]


def _most_epochs(shape) -> int:
    """The most epochs one dispatch runs: as many as fit in `MAX_CHUNK` steps. Fixed by the
    epoch's shape alone, so that every run of a step and data shares one program."""
    full, _, tail, _ = shape
    return MAX_CHUNK // max(full + (1 if tail else 0), 1)


@functools.lru_cache(maxsize=16)
def base_key(seed: int) -> jax.Array:
    """``jax.random.key(seed)``, made once per seed (a dispatch of its own each time)."""
    return jax.random.key(seed)
