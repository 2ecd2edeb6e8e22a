"""``funcgrad doctor [MODEL.py]``: the gradient-debugging checklist (`funcgrad.doctor`) on a
model file, or on the digits MLP without one: a table on stdout, JSON and HTML reports, exit
status 0 when healthy, 1 when a check fails, 2 for usage errors."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from funcgrad.cli._flags import _Parser, _positive, _seed


def _names(text: str) -> list[str]:
    """A comma-separated list of check names (validated against CHECKS)."""
    from funcgrad.doctor import CHECKS

    names = [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in names if n not in CHECKS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check(s) {', '.join(wrong) or repr(text)}; the checks are "
            f"{','.join(CHECKS)}")
    return names


def add_parser(sub: Any) -> _Parser:
    """Adds the ``doctor`` command and its flags to `sub` (the top-level subparsers)."""
    import textwrap

    from funcgrad.doctor import CHECKS, EXPECTED_FILE

    d = sub.add_parser(
        "doctor", help="run the gradient-debugging checklist on a model file",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Run the gradient-debugging checklist on a model: " + ", ".join(CHECKS)
            + ". Prints one line per check (findings first, with the time each took); exit "
            "status 0 when healthy, 1 when a check fails, 2 for usage errors, 3 when no check "
            "failed but one crashed (the checklist is incomplete). Without "
            "MODEL.py, the digits MLP that `funcgrad train` trains.", 78),
        epilog=EXPECTED_FILE)
    d.add_argument("model", nargs="?", default=None, metavar="MODEL.py",
                   help="the model file (default: the digits MLP, "
                        "funcgrad/doctor/digits_mlp.py)")
    d.add_argument("--checks", type=_names, default=None, metavar="A,B",
                   help="run only these checks (comma-separated)")
    d.add_argument("--skip", type=_names, default=None, metavar="A,B",
                   help="leave these checks out (comma-separated)")
    d.add_argument("--steps", type=_positive(int), default=None, metavar="N",
                   help="optimizer steps of the training check (default: 100)")
    d.add_argument("--overfit-steps", type=_positive(int), default=None, metavar="N",
                   help="most steps of the overfit check (default: 300)")
    d.add_argument("--seed", type=_seed, default=0, help="seed of keys, batches and probes")
    d.add_argument("--out", default=None, metavar="DIR",
                   help="write doctor.json and doctor.html into DIR (created if missing)")
    d.add_argument("--json", default=None, metavar="PATH", help="write the JSON report here")
    d.add_argument("--html", default=None, metavar="PATH", help="write the HTML report here")
    d.add_argument("--quiet", action="store_true", help="no line per check while running")
    return d


def run(parser: _Parser, args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``funcgrad doctor`` with its parsed `args`; returns the exit status."""
    from funcgrad.doctor import ModelFileError

    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"argument --out: {args.out} exists and is not a folder")
    model = args.model
    if model is None:
        from funcgrad.doctor import digits_mlp

        model = digits_mlp.__file__
    from funcgrad.cli._run import _use_caches

    _use_caches(None)  # JAX's compiled programs: a second run compiles little
    progress = None if args.quiet else (
        lambda f: print(f"  {f.check:<11} {f.verdict.upper():<8}{f.seconds:>6.1f}s",
                        file=sys.stderr, flush=True))
    from funcgrad.doctor import CHECKS, DoctorOptions, doctor_file

    skip = set(args.skip or ())
    checks = [name for name in (args.checks or CHECKS) if name not in skip]
    given = {name: getattr(args, name) for name in ("steps", "overfit_steps")
             if getattr(args, name) is not None}
    options = DoctorOptions(seed=args.seed, **given)
    try:
        report = doctor_file(model, checks=checks, options=options, progress=progress)
    except ModelFileError as error:
        print(f"funcgrad doctor: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("funcgrad doctor: interrupted", file=sys.stderr)
        return 130
    print(report.table(), flush=True)
    written = []
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
        args.json = args.json or os.path.join(args.out, "doctor.json")
        args.html = args.html or os.path.join(args.out, "doctor.html")
    if args.json:
        written.append(report.to_json(args.json))
    if args.html:
        written.append(report.to_html(args.html))
    if written:
        print(f"wrote {' and '.join(written)}")
    return report.exit_code
