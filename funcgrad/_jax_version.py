"""Which JAX releases funcgrad is tested on (`TESTED_JAX`), and the one warning for another.

A JAX outside the tested range gets one `JaxVersionWarning` at ``import funcgrad``
(`warn_if_untested`): funcgrad reads JAX's internals (``funcgrad._jax_internals``), which change
between releases. The lower bound is ``pyproject.toml``'s. JAX is not imported here.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings

#: The JAX releases the suite runs on (CI: Python 3.11 -> jax 0.10.2, Python 3.13 -> 0.12.1,
#: the newest release each time CI runs).
#: Versions between them are expected to work; outside, verdicts are unverified.
TESTED_JAX = ("0.10.2", "0.12.1")


class JaxVersionWarning(UserWarning):
    """The installed JAX is outside the range funcgrad is tested on: its tools run, but their
    verdicts are unverified there."""


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.cache
def jax_version() -> str:
    """The installed JAX's version string, read from its metadata (JAX is not imported)."""
    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        import jax
        return jax.__version__


def tested_range() -> str:
    """``"0.10.2 to 0.12.x"``: the tested range as the warnings and docs state it."""
    high = _parse(TESTED_JAX[-1])
    return f"{TESTED_JAX[0]} to {high[0]}.{high[1]}.x"


def untested_reason(version: str | None = None) -> str | None:
    """Why `version` (default: the installed JAX) is outside the tested range; None inside.

    A version is inside when it is at least ``TESTED_JAX[0]`` and its (major, minor) is not
    beyond the newest tested release's (0.12.1 is inside, 0.13.0 is not)."""
    version = version or jax_version()
    got = _parse(version)
    low, high = _parse(TESTED_JAX[0]), _parse(TESTED_JAX[-1])
    if got < low:
        return (f"jax {version} is older than the oldest JAX funcgrad is tested on "
                f"({TESTED_JAX[0]}); upgrade it: pip install 'jax>={TESTED_JAX[0]}'")
    if got[:2] > high[:2]:
        return (f"jax {version} is newer than the newest JAX funcgrad is tested on "
                f"({TESTED_JAX[-1]}): funcgrad reads JAX's jaxprs and compiled programs, "
                "whose internals change between releases, so its verdicts are unverified "
                "there. Tools that cannot read an internal raise JaxInternalsError; "
                f"to be safe, pip install 'jax<{high[0]}.{high[1] + 1}'")
    return None


def warn_if_untested() -> None:
    """One `JaxVersionWarning` when the installed JAX is outside `TESTED_JAX`.
    ``FUNCGRAD_NO_VERSION_WARNING=1`` silences it."""
    reason = untested_reason()
    if reason and not os.environ.get("FUNCGRAD_NO_VERSION_WARNING"):
        warnings.warn(f"funcgrad is tested on jax {tested_range()}: {reason}",
                      JaxVersionWarning, stacklevel=3)
