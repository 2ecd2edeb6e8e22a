"""A run's folder: an earlier run in --out (refused, or replaced with --overwrite), and the
settings --resume takes from the run it continues."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

#: What funcgrad train writes into --out: a folder holding any of them holds an earlier run,
#: and --overwrite deletes exactly these.
_RUN_FILES = ("metrics.json", "training.png", "checkpoints")

def _earlier_run(out: str) -> list[str]:
    """The entries of `_RUN_FILES` that `out` holds (an earlier run's), in that order."""
    return [name for name in _RUN_FILES if os.path.lexists(os.path.join(out, name))]

def _listed(names: list[str]) -> str:
    """"metrics.json, checkpoints/": `_RUN_FILES` entries as a folder listing shows them."""
    return ", ".join(name + "/" if name == "checkpoints" else name for name in names)

def _check_out(train_parser: argparse.ArgumentParser, args: argparse.Namespace, *,
               delete: bool = True) -> None:
    """Refuses (exit 2, before anything is loaded or trained) an --out that holds an earlier
    run, unless --resume continues that very run there; with --overwrite, deletes that run's
    files instead (only those: `_RUN_FILES`), if `delete` (process 0 of a --distributed run:
    the others check the same folder and leave it alone)."""
    here = (args.resume is not None
            and os.path.realpath(args.resume) == os.path.realpath(args.out))
    if here and args.overwrite:
        train_parser.error(f"argument --overwrite: it would delete the run that --resume "
                           f"{args.resume} continues in {args.out}; drop --overwrite (or "
                           "continue it into a new folder with --out DIR)")
    found = [] if here else _earlier_run(args.out)
    if not found:
        return
    if not args.overwrite:
        train_parser.error(
            f"argument --out: {args.out} holds an earlier run ({_listed(found)}); continue "
            f"it with --resume {args.out}, write this run elsewhere with another --out DIR, "
            "or replace it with --overwrite")
    if not delete:
        return
    import shutil

    for name in found:
        path = os.path.join(args.out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    print(f"funcgrad: note: --overwrite: deleted the earlier run's {_listed(found)} in "
          f"{args.out}", file=sys.stderr)

#: What --resume may change about a run: how long, where, and how it reports; not what it
#: trains (model, data, optimizer, batches), which must stay the run's own.
_RESUME_MAY_CHANGE = {"epochs", "out", "no_progress", "cache_dir", "resume", "checkpoint_every",
                      "distributed", "memory_report", "detect_anomaly", "on_nonfinite", "overwrite"}

def _resumed_settings(train_parser: argparse.ArgumentParser, args: argparse.Namespace,
                      argv: list[str]) -> tuple[int, dict] | None:
    """--resume DIR: the run's own settings for every flag not given, and the (step, metadata)
    of its latest checkpoint (None when it has none yet: the run starts over there).

    The settings come from DIR/metrics.json's config, except those the checkpoint records
    itself (what decides the batches: --seed, --batch-size, --accumulate, and through the
    train split's size --test-size), which must match it: a metrics.json that says otherwise
    is another run's (written over the checkpointed one), and the error says which flag to
    give. A given flag that would change what the run trains is an error (exit 2), and so is
    --epochs not beyond the epochs done. --out defaults to DIR. Errors name the flags."""
    metrics = os.path.join(args.resume, "metrics.json")
    try:
        with open(metrics) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = {}
    config = saved.get("config") or {}
    checkpoints = os.path.join(args.resume, "checkpoints")
    try:
        from funcgrad.train.checkpoint import latest_meta
        latest = latest_meta(checkpoints)
    except (ImportError, OSError, ValueError) as e:
        train_parser.error(f"argument --resume: cannot read the checkpoints in {checkpoints}: "
                           f"{str(e).splitlines()[0]}")
    position = (latest[1].get("position") or {}) if latest else {}
    done = (position["epoch"] if "epoch" in position else len(saved.get("epochs") or []))
    given = _given_flags(train_parser, argv[argv.index("train") + 1:] if "train" in argv
                         else argv)
    if "out" not in given:
        args.out = args.resume
    # What the checkpoint recorded (fit's position: the settings that decide the batches).
    recorded = {name: position[key] for name, key in (("seed", "seed"),
                ("batch_size", "batch_size"), ("accumulate", "accumulate"),
                ("test_size", "examples")) if key in position}
    for name, value in config.items():
        flag = "--" + name.replace("_", "-")
        if name not in given:
            if name not in _RESUME_MAY_CHANGE or name == "epochs":
                setattr(args, name, value)
        # A given flag must be the run's own value: the checkpoint's where it records one
        # (checked below; metrics.json may be another run's), else metrics.json's.
        elif (name not in _RESUME_MAY_CHANGE and name not in recorded
              and getattr(args, name) != value):
            train_parser.error(
                f"argument {flag}: the run in {args.resume} trained with {flag} {value}; "
                "--resume continues that run with its own settings (drop the flag, or start "
                "a new run with another --out)")
    step = latest[0] if latest else None
    for name, had in recorded.items():
        if name not in given and name not in config and name != "test_size":
            setattr(args, name, had)  # no metrics.json: the checkpoint's is the run's own
    # The flags typed first: an error about one of them is the one to fix first.
    for name, had in sorted(recorded.items(), key=lambda item: item[0] not in given):
        now = getattr(args, name)
        if (_train_digits(now) if name == "test_size" else now) == had:
            continue
        flag = "--" + name.replace("_", "-")
        ran = (f"on {had} train digits" if name == "test_size" else f"with {flag} {had}")
        this = (f"{flag} {now} leaves {_train_digits(now)}" if name == "test_size"
                else f"{flag} {now}")
        if name in given:
            train_parser.error(
                f"argument {flag}: the run in {args.resume} trained {ran} (its checkpoint at "
                f"step {step}), not {this}; --resume continues that run with its own settings "
                "(drop the flag, or start a new run with another --out)")
        source = (f"{metrics}'s config, which is then another run's (one written into "
                  f"{args.resume} over it)" if name in config else
                  f"the default ({args.resume} has no metrics.json that gives it)")
        fix = ("the --test-size that run used" if name == "test_size" else f"{flag} {had}")
        train_parser.error(
            f"argument --resume: the checkpoints in {checkpoints} were trained {ran}, but "
            f"{this} comes from {source}; continue the checkpointed run by passing {fix}, or "
            "start a new run with another --out")
    if done and args.epochs <= done:
        train_parser.error(
            f"argument --epochs: the run in {args.resume} has done {done} epochs; pass --epochs "
            f"above {done} to train more (the total, counting the epochs done)")
    return latest

#: The digits scikit-learn bundles; --test-size holds out a fraction of them.
_DIGITS = 1797

def _train_digits(test_size: float) -> int:
    """The train split's size for `test_size`: scikit-learn's train_test_split holds out
    ceil(test_size * n) examples (0.2: ceil(359.4) = 360 of 1797, leaving 1437)."""
    return _DIGITS - math.ceil(test_size * _DIGITS)

def _given_flags(train_parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags `argv` gives explicitly (defaults not counted)."""
    defaults = {action: action.default for action in train_parser._actions}
    try:
        for action in defaults:
            action.default = argparse.SUPPRESS
        given, _ = train_parser.parse_known_args(argv)
    finally:
        for action, default in defaults.items():
            action.default = default
    return set(vars(given))

def _check_resumable(args: argparse.Namespace, state, resumed: tuple[int, dict]) -> None:
    """ValueError, in the flags' terms, when the --resume checkpoint is not of the state these
    flags build (another model or optimizer: its metrics.json is another run's, or missing)."""
    from funcgrad.train.checkpoint import check_like

    step, meta = resumed
    try:
        check_like(meta, state, step, f"--resume {args.resume}",
                    theirs="the flags' state", hint=False)
    except ValueError as e:
        metrics = os.path.join(args.resume, "metrics.json")
        source = (f"they come from {metrics}'s config, which is then another run's"
                  if os.path.exists(metrics) else
                  f"{args.resume} has no metrics.json to take them from")
        raise ValueError(
            f"{e} The model and optimizer flags (--model, --hidden or --channels, --optimizer, "
            f"--loss-scale, --no-monitor) build another state than the checkpointed run's: "
            f"{source}. Pass the flags that run was started with, or start a new run with "
            "another --out.") from None
