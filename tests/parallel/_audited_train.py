"""``python _audited_train.py --watch DIR [--fail-at-epoch E] -- train ...``: runs ``funcgrad
train ...`` (as the ``funcgrad`` console script does) and, at exit, prints one line
``WROTE ["path", ...]`` (also when it ends with ``os._exit``, as a failed ``--distributed``
process does): the paths inside DIR that this process created, opened for writing,
renamed, copied or deleted (Python's audit events), relative to DIR. DIR/checkpoints/ and
what orbax writes inside it are left out (orbax coordinates the processes itself), but not a
copy into it (``--resume`` into another ``--out`` copies the run's checkpoints there).

With ``--fail-at-epoch E`` the test accuracy raises a RuntimeError naming the process at
epoch E's evaluation, on every process (with ``--fail-process P``, on process P alone): a run
that crashes inside ``fit``.

tests/parallel/test_train_distributed.py runs it under ``funcgrad launch``.
"""
from __future__ import annotations

import atexit
import json
import os
import sys

_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: Audit events that change the file system, and the positions of their path arguments.
_CHANGES = {"os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,),
            "os.truncate": (0,), "os.symlink": (1,), "os.link": (1,), "shutil.copytree": (1,),
            "shutil.rmtree": (0,), "shutil.move": (1,)}


def _watch(folder: str) -> list[str]:
    folder = os.path.abspath(folder)
    orbax = os.path.join(folder, "checkpoints")
    seen: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open":  # open() and os.open(): (path, mode or None, os.O_* flags)
            if not args[2] & _WRITE:
                return
            paths = [args[0]]
        elif event in _CHANGES:
            paths = [args[i] for i in _CHANGES[event]]
        else:
            return
        for path in paths:
            if isinstance(path, (str, bytes, os.PathLike)):
                path = os.path.abspath(os.fsdecode(path))
                inside = os.path.commonpath([path, folder]) == folder != path
                if inside and (event == "shutil.copytree"
                               or os.path.commonpath([path, orbax]) != orbax):
                    seen.append(os.path.relpath(path, folder))

    sys.addaudithook(hook)
    return seen


def _fail_at(epoch: int, process: int | None = None) -> None:
    """The test accuracy of `funcgrad.cli._training._mlp`'s model raises at its `epoch`-th call (on
    every process, or on `process` alone)."""
    from funcgrad.cli import _training  # where the command calls _mlp

    make = _training._mlp

    def _mlp(args, data, accumulate):
        model = make(args, data, accumulate)
        calls = [0]

        def test_accuracy(*arrays):
            import jax

            calls[0] += 1
            if calls[0] == epoch and process in (None, jax.process_index()):
                raise RuntimeError(f"planted failure at epoch {epoch}'s evaluation on process "
                                   f"{jax.process_index()}")
            return model.test_accuracy(*arrays)

        return model._replace(test_accuracy=test_accuracy)

    _training._mlp = _mlp


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    ours, theirs = argv[:split], argv[split + 1:]
    folder = ours[ours.index("--watch") + 1]
    seen = _watch(folder)
    def report() -> None:
        print("WROTE " + json.dumps(sorted(set(seen))), flush=True)
    atexit.register(report)
    # A failed --distributed process ends with os._exit (skipping JAX's shutdown barrier, and
    # the atexit handlers with it): report there too.
    real_exit = os._exit

    def exit_reporting(status: int) -> None:
        report()
        real_exit(status)
    os._exit = exit_reporting
    if "--fail-at-epoch" in ours:
        _fail_at(int(ours[ours.index("--fail-at-epoch") + 1]),
                 int(ours[ours.index("--fail-process") + 1]) if "--fail-process" in ours
                 else None)
    sys.argv = ["funcgrad", *theirs]
    from funcgrad.cli import console_main

    console_main()


if __name__ == "__main__":
    main()
