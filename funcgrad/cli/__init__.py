"""The command line, one module per command: ``funcgrad train`` (`funcgrad.cli.train`) trains an
MLP or a CNN on the digits set; ``funcgrad doctor`` (`funcgrad.cli.doctor`) runs the
gradient-debugging checklist on a model file; ``funcgrad launch`` (`funcgrad.cli.launch`) runs a
command as N processes of one ``jax.distributed`` run. The shared flag parsing is
`funcgrad.cli._flags`; the train command's run is `funcgrad.cli._training`.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from funcgrad.cli import doctor as _doctor_command
from funcgrad.cli import launch as _launch_command
from funcgrad.cli import train as _train_command

# The train command's pieces under their old names (``funcgrad.cli._plot``, ...): tests and
# scripts use them. The seams a test patches are where they are called: _train in
# funcgrad.cli.train, _mlp and _cnn in funcgrad.cli._training.
from funcgrad.cli._clock import _Clock as _Clock
from funcgrad.cli._flags import _Parser
from funcgrad.cli._plot import _MAX_SPANS as _MAX_SPANS
from funcgrad.cli._plot import _alert_spans as _alert_spans
from funcgrad.cli._plot import _plot as _plot
from funcgrad.cli._run import _use_caches as _use_caches

#: The commands: name -> module with ``add_parser(subparsers)`` and ``run(parser, args, argv)``.
_COMMANDS = {"train": _train_command, "doctor": _doctor_command, "launch": _launch_command}


def _build_parser() -> _Parser:
    from funcgrad import __version__

    parser = _Parser(prog="funcgrad",
                     description="funcgrad: see, check and trust gradients in JAX.")
    parser.add_argument("--version", action="version", version=f"funcgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # Flag errors found after parsing use each command's own prefix ("funcgrad train: ...").
    parser.commands = {name: module.add_parser(sub) for name, module in _COMMANDS.items()}
    return parser


def console_main() -> None:
    """The ``funcgrad`` console script and ``python -m funcgrad``: `main` on ``sys.argv``, then
    the exit handlers (atexit) and a flush of stdout and stderr, then ``os._exit``.

    That skips only the interpreter's own teardown -- freeing every module, array and
    compiled XLA program one by one, which the OS does at once anyway: 0.45-0.5 s of a
    ~4 s ``funcgrad train`` on 2026-12-02 here (a process that has imported jax, optax and
    matplotlib). Everything the run writes is closed before `main` returns.
    """
    status = main()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (funcgrad train | head) or stream
            pass
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """What ``funcgrad`` does with `argv` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    command = _COMMANDS[args.command]
    return command.run(parser.commands[args.command], args, argv)
