"""Checkpoints: a whole `TrainState` saved to disk and restored bit for bit, with the run's
data position and history (orbax-checkpoint writes them; it is imported only when used).

Layout on disk, one step-numbered folder per checkpoint (``state.step``), written by an
``orbax.checkpoint.CheckpointManager``::

    directory/
      120/                 the checkpoint of the state after 120 step calls
        state/             every array leaf of the TrainState (orbax's OCDBT/zarr array store),
                           under the names leaf0, leaf1, ... in ``jax.tree.leaves`` order
        meta/metadata      JSON: {"format", "step", "fields", "leaves": [{"path", "dtype",
                           "shape", "key_impl"}], "position", "history"}
        _CHECKPOINT_METADATA, commit_success.txt    orbax's own
      130/ ...

A save is atomic: orbax writes ``<step>.orbax-checkpoint-tmp*`` and renames it to ``<step>``
when everything is on disk, so a crash mid-save leaves the earlier folders as they were (the
next save deletes the unfinished one). Only the latest `keep` folders (by step) are kept.

What comes back is what was saved: each leaf with its dtype, shape and bits (bfloat16 params,
Adam's moments and count, the loss scale, the monitor's packed vector, BatchNorm statistics,
an ``inject_hyperparams`` state's rate and counts); a typed PRNG key is stored as its key
data (``jax.random.key_data``) with its implementation's name and wrapped again; leaves
without data (None, optax's ``MaskedNode`` for frozen leaves, empty arrays) come from `like`.
The structure comes from `like`, so a restored state is the pytree the step was compiled for.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from funcgrad._paths import key_paths, keystr
from funcgrad.train.state import TrainState

PyTree = Any

#: The ``format`` entry of a checkpoint's JSON; a later layout gets a new number.
FORMAT = "funcgrad.checkpoint/1"

_INSTALL = "pip install orbax-checkpoint"
_LIKE_HINT = (
    "Build `like` as the run that saved it built its state: step.init(params, "
    "model_state=..., seed=...) of a step with the same loss pieces, optimizer (a schedule "
    "too), trainable mask and monitor, and the same model and dtypes.")


class Restored(NamedTuple):
    """What `restore_checkpoint` returns.

    Attributes:
      state: the `TrainState`, structure of `like`, each leaf as saved.
      position: the ``position`` dict given to `save_checkpoint` (JSON types), or None.
      history: the ``history`` dict given to `save_checkpoint` (JSON types), or None.
      step: the step of the checkpoint restored (int, its folder's name).
    """
    state: TrainState
    position: dict | None
    history: dict | None
    step: int


def _orbax():
    """``orbax.checkpoint``, or an ImportError that says how to install it.

    orbax's own use of JAX APIs that JAX has deprecated (orbax-checkpoint 0.12.8 reads
    ``jax.sharding.SingleDeviceSharding``, deprecated in jax 0.12.1, when it is imported and
    when it saves) is not the user's to fix: its DeprecationWarnings are silenced here, on every
    use (a filter for warnings raised from orbax's modules only, put first again each time so
    that a caller's later filters, such as pytest's per-test ones, do not shadow it).
    """
    silence_orbax_deprecations()
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(f"funcgrad checkpoints are written with orbax-checkpoint, which could "
                          f"not be imported ({e}). Install it: {_INSTALL}") from e
    return ocp


def silence_orbax_deprecations() -> None:
    """Ignores DeprecationWarnings raised from orbax's modules (see `_orbax`)."""
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"orbax\.")


def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _describe(path: tuple, leaf: Any) -> dict:
    """A leaf's entry in the checkpoint's JSON (a typed key: its key data's dtype and shape)."""
    data: Any  # an array: JAX's, NumPy's, or a NumPy scalar
    if _is_key(leaf):
        data = jax.random.key_data(leaf)
    else:  # an array, or a Python number of a model state
        data = leaf if hasattr(leaf, "dtype") else np.asarray(leaf)
    return {"path": "state" + keystr(path), "dtype": str(data.dtype),
            "shape": list(np.shape(data)),
            "key_impl": str(jax.random.key_impl(leaf)) if _is_key(leaf) else None}


def _fields(state: TrainState) -> dict[str, int]:
    """Number of leaves of each TrainState field (0 for a field that is None)."""
    return {name: len(jax.tree.leaves(value)) for name, value in state._asdict().items()}


def _check_train_state(where: str, state: Any, arg: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"{where}: {arg} must be a funcgrad TrainState (from step.init(params) or "
                        f"returned by the train step), got {type(state).__name__}.")


def _to_json(value: Any, where: str) -> Any:
    """`value` as JSON types (numpy/JAX numbers and arrays as Python ones, tuples as lists);
    TypeError naming the entry that has no JSON form or a key that is not a str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.generic, np.ndarray, jax.Array)) and not _is_key(value):
        return np.asarray(value).tolist()
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise TypeError(f"save_checkpoint: {where} has the key {k!r}; keys must be str "
                                "(JSON turns other keys into strings, so they would not come "
                                "back as given).")
        return {k: _to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"save_checkpoint: {where} has type {type(value).__name__}, which has no "
                    "JSON form; give numbers, strings, bools, None, lists and dicts (a "
                    "dataclass: dataclasses.asdict(it)).")


def save_checkpoint(directory: str | os.PathLike, state: TrainState, *,
                    position: dict | None = None, history: dict | None = None,
                    keep: int = 3) -> str:
    """Saves `state` to ``directory/<state.step>/``, atomically, keeping the latest `keep`.

    Args:
      directory: the run's checkpoint folder (created if missing); relative paths are taken
        from the current directory.
      state: the `TrainState` to save, concrete (not inside ``jax.jit``); its ``step`` names
        the folder.
      position: a dict of where the run is in its data (epoch, batch, seed, ...), or None.
      history: a dict of the run's record so far (losses per step, metrics), or None.
        Both are stored as JSON: numpy/JAX numbers and arrays become Python numbers and
        lists, tuples become lists; NaN and inf are kept (written as Python's json writes
        them, ``NaN``/``Infinity``, which it reads back; strict JSON readers refuse them),
        since a run's history often records the step that went non-finite.
      keep: how many checkpoints (the latest by step, this one included) stay on disk, >= 1.
    Returns:
      the path of the new checkpoint's folder, ``directory/<step>``.
    Raises:
      TypeError: if `state` is not a TrainState, or `position`/`history` holds something
        with no JSON form or a non-str key (the message names the entry).
      ValueError: if `keep` is not a positive int, ``state.step`` is not a concrete scalar,
        or `directory` already holds a checkpoint at this step or a later one (another run's,
        or this run's before a restore to an earlier step): restore_checkpoint would return the
        latest, so saving an earlier step there is refused; use a new directory or delete
        them.
      ImportError: if orbax-checkpoint is not installed (the message gives the pip command).
    """
    _check_train_state("save_checkpoint", state, "state")
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1:
        raise ValueError(f"save_checkpoint: keep must be an int >= 1 (checkpoints kept), got "
                         f"{keep!r}.")
    try:
        step = int(state.step)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"save_checkpoint: state.step must be one concrete int (save outside "
                         f"jax.jit, one state at a time), got {state.step!r}.") from e
    meta = {"format": FORMAT, "step": step, "fields": _fields(state),
            "leaves": [_describe(p, leaf) for p, leaf in zip(key_paths(state),
                                                             jax.tree.leaves(state))],
            "position": _to_json(position, "position"), "history": _to_json(history, "history")}
    arrays = {f"leaf{i}": jax.random.key_data(leaf) if _is_key(leaf) else leaf
              for i, leaf in enumerate(jax.tree.leaves(state)) if np.size(leaf)}
    ocp = _orbax()  # orbax refuses arrays of size 0: theirs come back from `like`
    directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False, cleanup_tmp_directories=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(int(keep)))
    with ocp.CheckpointManager(directory, options=options, item_names=("state", "meta")) as m:
        later = [s for s in m.all_steps() if s >= step]
        if later:
            raise ValueError(
                f"save_checkpoint: {directory} already holds checkpoints at steps {sorted(later)}"
                f", not before this state's step {step}: they are another run's, or this run's "
                "from before a restore to an earlier step, and restore_checkpoint returns the "
                "latest. Save into a new directory, or delete those step folders first.")
        m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                             meta=ocp.args.JsonSave(meta)))
    return os.path.join(directory, str(step))


def _steps(ocp, directory: str) -> list[int]:
    return sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []


def latest_checkpoint_step(directory: str | os.PathLike) -> int | None:
    """The step of the latest complete checkpoint in `directory`, or None if it has none (or
    does not exist). Unfinished saves (``*.orbax-checkpoint-tmp*`` folders) do not count.

    Raises ImportError if orbax-checkpoint is not installed and `directory` exists.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        return None
    steps = _steps(_orbax(), directory)
    return steps[-1] if steps else None


def latest_meta(directory: str | os.PathLike) -> tuple[int, dict] | None:
    """(step, JSON metadata) of the latest complete checkpoint in `directory` (its position,
    history and leaf descriptions; the module docstring), without restoring any array; None
    when it holds none. ValueError if that checkpoint is not funcgrad's."""
    directory = os.path.abspath(os.fspath(directory))
    step = latest_checkpoint_step(directory)
    if step is None:
        return None
    ocp = _orbax()
    path = os.path.join(directory, str(step))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        meta = _funcgrad_meta(ocp, checkpointer, path, "")
    return step, meta


def _funcgrad_meta(ocp, checkpointer, path: str, where: str) -> dict:
    """The meta entry of the checkpoint at `path`; ValueError (prefixed with `where`) when it
    is not a funcgrad checkpoint of this `FORMAT`."""
    meta = checkpointer.restore(
        path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise ValueError(f"{where + ': ' if where else ''}{path} is not a funcgrad checkpoint "
                         f"of format {FORMAT} (its format entry is {found!r}); "
                         "save_checkpoint writes them.")
    return meta


def check_like(meta: dict, like: TrainState, step: int, where: str, *,
                theirs: str = "like", hint: bool = True) -> list[dict]:
    """The saved leaf entries, after checking `like` has the same paths, dtypes and shapes
    (ValueError naming the first difference, calling `like` `theirs`; with `hint`, how to
    build `like`)."""
    advice = f" {_LIKE_HINT}" if hint else ""
    named = "`like`" if theirs == "like" else theirs
    saved, wanted = meta["leaves"], [_describe(p, leaf) for p, leaf in
                                     zip(key_paths(like), jax.tree.leaves(like))]
    if [s["path"] for s in saved] != [w["path"] for w in wanted]:
        first = next(i for i in range(max(len(saved), len(wanted)))
                     if i >= len(saved) or i >= len(wanted)
                     or saved[i]["path"] != wanted[i]["path"])
        at = lambda entries: entries[first]["path"] if first < len(entries) else "nothing"
        had = lambda fields: ", ".join(k for k, n in fields.items() if n) or "none"
        raise ValueError(
            f"{where}: the checkpoint at step {step} does not have the structure of {named}: "
            f"its leaf {first} is {at(saved)} where {theirs} has {at(wanted)} ({len(saved)} saved "
            f"leaves, {len(wanted)} in {theirs}; fields set when saved: {had(meta['fields'])}; "
            f"in {theirs}: {had(_fields(like))}).{advice}")
    for s, w in zip(saved, wanted):
        if (s["dtype"], s["shape"], s["key_impl"]) != (w["dtype"], w["shape"], w["key_impl"]):
            kind = lambda e: (f"a typed PRNG key ({e['key_impl']}) with key data " if e["key_impl"]
                              else "") + f"{e['dtype']} of shape {tuple(e['shape'])}"
            raise ValueError(
                f"{where}: {s['path']} was saved as {kind(s)}, but {theirs} has {kind(w)}; "
                f"restoring does not convert dtypes or shapes.{advice}")
    return saved


def _target(leaf: Any) -> Any:
    """What orbax restores a leaf into: a ShapeDtypeStruct placed like `leaf` (a jax.Array),
    else a numpy array (orbax then returns numpy)."""
    data = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    if isinstance(data, jax.Array):
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)
    return np.zeros(np.shape(data), np.asarray(data).dtype)


def _rebuild(like_leaf: Any, value: Any) -> Any:
    """A restored array as the kind of leaf `like` holds there."""
    if _is_key(like_leaf):
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(like_leaf))
    if isinstance(like_leaf, jax.Array):
        return value
    if isinstance(like_leaf, np.ndarray):
        return np.asarray(value)
    return type(like_leaf)(np.asarray(value).item())  # a Python number in the model state


def restore_checkpoint(directory: str | os.PathLike, like: TrainState, *,
                       step: int | None = None) -> Restored:
    """Restores the checkpoint at `step` (default: the latest) into the structure of `like`.

    Args:
      directory: the folder given to `save_checkpoint`.
      like: a `TrainState` of the same structure, dtypes and shapes as the one saved, e.g.
        ``step.init(params, ...)`` built as the saving run built its state;
        its values are not used, only its structure, its leaves' placement (a restored
        jax.Array gets the sharding of like's leaf) and its leaves without data (None,
        ``optax.MaskedNode``, arrays of size 0). Typed and raw PRNG keys come back as saved.
      step: the step to restore; None for the latest.
    Returns:
      ``Restored(state, position, history, step)``; continuing the run from ``state`` gives
      the same bits as never having stopped (the train step is deterministic on one device).
    Raises:
      FileNotFoundError: if `directory` holds no complete checkpoint, or none at `step` (the
        message lists the steps it holds).
      ValueError: if `like` has another structure (the message names the first leaf path
        that differs and the TrainState fields set in each), or a leaf's dtype, shape or PRNG
        key implementation differs from the saved one; or the checkpoint is not funcgrad's.
      TypeError: if `like` is not a TrainState.
      ImportError: if orbax-checkpoint is not installed (the message gives the pip command).
    """
    where = "restore_checkpoint"
    _check_train_state(where, like, "like")
    ocp = _orbax()
    directory = os.path.abspath(os.fspath(directory))
    steps = _steps(ocp, directory)
    if not steps or (step is not None and step not in steps):
        held = f"it holds steps {steps}" if steps else (
            "it holds no complete checkpoint" if os.path.isdir(directory) else "it does not exist")
        raise FileNotFoundError(f"{where}: no checkpoint at "
                                f"{'step ' + str(step) if step is not None else 'any step'} in "
                                f"{directory}: {held}. save_checkpoint(directory, state) writes "
                                "them.")
    step = steps[-1] if step is None else int(step)
    path = os.path.join(directory, str(step))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        meta = _funcgrad_meta(ocp, checkpointer, path, where)
        check_like(meta, like, step, where)
        leaves, treedef = jax.tree.flatten(like)
        targets = {f"leaf{i}": _target(leaf) for i, leaf in enumerate(leaves) if np.size(leaf)}
        arrays = checkpointer.restore(path, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(targets)))["state"] if targets else {}
    restored = [_rebuild(leaf, arrays[f"leaf{i}"]) if f"leaf{i}" in arrays else leaf
                for i, leaf in enumerate(leaves)]
    return Restored(jax.tree.unflatten(treedef, restored), meta["position"], meta["history"],
                    step)
