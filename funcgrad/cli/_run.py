"""What the commands share when they run: the cache folder (JAX's compiled programs) and
strict JSON (NaN and inf written as null)."""
from __future__ import annotations

import os
import sys
import tempfile


def _use_caches(flag: str | None) -> str | None:
    """The cache folder of this run (see --cache-dir), made if missing, with JAX's persistent
    compilation cache in its jax/ subfolder unless one is configured already; None, after a
    note on stderr, when there is no usable folder (a read-only or missing home)."""
    root = flag or os.environ.get("FUNCGRAD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "funcgrad")
    try:
        if root.startswith("~"):  # no HOME and no password entry to find it
            raise OSError("no home folder to put it in")
        os.makedirs(os.path.join(root, "jax"), exist_ok=True)
        with tempfile.TemporaryFile(dir=root):  # writable? (os.access says yes to root)
            pass
    except OSError as e:
        print(f"funcgrad: note: no cache folder ({root}: {e.strerror or e}); the run compiles "
              "and loads everything afresh; pass --cache-dir DIR to keep them", file=sys.stderr)
        return None
    import jax

    # jax 0.10's Config stub lacks the (dynamically added) option attributes; 0.12's has them.
    if not jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined,unused-ignore]
        jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax"))
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            # JAX's default (1 s) would keep none of these programs: each compiles in 0.01-1 s.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return root



def _strict_json(value):
    """NaN and inf become null: metrics.json stays valid JSON for any reader."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value

