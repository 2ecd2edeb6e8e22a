"""Warnings attributed to the user's line, not to funcgrad's or JAX's frames (private).

funcgrad warns from deep inside its own code and JAX's traces (an accumulating step's probe, a
custom rule's backward pass), where ``stacklevel`` counts frames that vary with jit, scan and
the call path. `user_location` finds the user's frame instead, as `funcgrad._traced` does for
errors: the innermost frame outside funcgrad, JAX and the standard library (a frame of an
installed library such as flax only when no other remains); `warn` reports a warning there,
with the filters and once-per-location registry of the module that owns that line, as
``warnings.warn`` would (Python 3.12's ``skip_file_prefixes`` does the same for a fixed list).
"""
from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import NamedTuple

from funcgrad._traced import _FUNCGRAD_DIR, _JAX_DIRS, _SITE, _STDLIB


class Location(NamedTuple):
    """A line of the user's code: file name, line number, and its module's globals."""
    filename: str
    lineno: int
    module_globals: dict


def user_location() -> Location | None:
    """The innermost frame of the current stack that is the user's (module docstring), or
    None when every frame is funcgrad's, JAX's or the standard library's."""
    installed = None
    frame: FrameType | None = sys._getframe(1)
    try:
        while frame is not None:
            file = frame.f_code.co_filename
            path = os.path.abspath(file)
            if not (file.startswith("<frozen") or path.startswith(_FUNCGRAD_DIR + os.sep)
                    or path.startswith(_JAX_DIRS)):
                if path.startswith(_SITE):  # before the stdlib test: site-packages may be in it
                    installed = installed or Location(file, frame.f_lineno, frame.f_globals)
                elif not path.startswith(_STDLIB + os.sep):
                    return Location(file, frame.f_lineno, frame.f_globals)
            frame = frame.f_back
        return installed
    finally:
        del frame


def warn(message: str, category: type[Warning], where: Location | None = None) -> None:
    """``warnings.warn(message, category)`` reported at `where` (default: `user_location`)."""
    where = where or user_location()
    if where is None:
        warnings.warn(message, category, stacklevel=3)
        return
    module = where.module_globals
    # module_globals lets the warning show the line's source; Python 3.13 refuses globals
    # whose module has no loader (a script run by runpy.run_path), so those go without.
    loader = module.get("__loader__") or getattr(module.get("__spec__"), "loader", None)
    warnings.warn_explicit(message, category, where.filename, where.lineno,
                           module=module.get("__name__", "<string>"),
                           registry=module.setdefault("__warningregistry__", {}),
                           module_globals=module if loader is not None else None)
