"""Checkpoints and resume for `fit`: where a run saves itself and how it picks up again.

A checkpoint (`funcgrad.train.checkpoint`, orbax) holds the whole `TrainState`, the run's
position (``epoch``, ``step_in_epoch``, ``run_step``, ``epoch_first`` and the settings that
decide which examples the rest of an epoch visits) and its `History`. `fit` saves every
``Checkpointing.every`` epochs, at a non-finite stop, on Ctrl-C, after a crash and at the
end; ``Checkpointing(..., resume=True)`` restores the newest one, checks the settings and
continues bit for bit (when the resumed run's dispatches compile to the same programs, see
`funcgrad.fit`). `funcgrad.train.loop.options.Checkpointing` says where and when.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from funcgrad.train.loop.history import History


def check_resumed(position: Mapping[str, Any], settings: Mapping[str, Any], directory) -> None:
    """ValueError when a resumed run's batching (seed, batch size, data size, shuffle,
    drop_last) or accumulation differ from the checkpointed run's: the rest of its epoch would
    visit other examples."""
    changed = [f"{k} {v!r} (the run had {position[k]!r})" for k, v in settings.items()
               if k in position and position[k] != v]
    if changed:
        raise ValueError(
            f"fit: resuming from {directory} with {', '.join(changed)}: the rest of the "
            "run would visit other examples than the run that was stopped (some twice, some "
            "never). Resume with the run's own data and settings, or checkpoint into a new "
            "directory to start over.")


def save(directory, state, position, history) -> None:
    """Checkpoints `state` with the run's `position` (a dict) and `history` (a `History`) in
    `directory`, unless the newest checkpoint there is of this very step."""
    from funcgrad.train.checkpoint import latest_checkpoint_step, save_checkpoint
    if os.path.isdir(directory) and latest_checkpoint_step(directory) == int(state.step):
        return  # this state is saved already (an epoch's end, then a stop before any step)
    save_checkpoint(directory, state, position=dict(position), history=history._state())


def restore(directory, like):
    """(state, history, position) of the newest checkpoint in `directory`, or None when the
    folder holds none (a first run with resume=True starts from `like`)."""
    from funcgrad.train.checkpoint import latest_checkpoint_step, restore_checkpoint
    if not os.path.isdir(directory) or latest_checkpoint_step(directory) is None:
        return None
    restored = restore_checkpoint(directory, like)
    return restored.state, History._from_state(restored.history or {}), restored.position
