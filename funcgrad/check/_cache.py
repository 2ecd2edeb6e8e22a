"""Bounded caches of what a check builds per function and argument signature, as ``jax.jit``
keeps its compilations (private to `funcgrad.check`).

A check of the same function at arguments of the same pytree structure, shapes and dtypes
(a test suite's hundredth call) reuses them instead of tracing, lowering and compiling again.
"""
from __future__ import annotations

import collections
import threading
from typing import Any

import jax


def signature(tree: Any) -> tuple:
    """What a trace of a function at `tree` depends on besides the function: the pytree
    structure and, per leaf, its shape, its dtype as given (a NumPy float64 array and a
    float32 array are traced alike with x64 off, but are kept apart here), its dtype as
    traced, and whether it is weakly typed (a Python float). Values are left out, as
    ``jax.jit`` leaves them out."""
    leaves, treedef = jax.tree.flatten(tree)
    avals = []
    for leaf in leaves:
        aval = jax.typeof(leaf)
        given = getattr(leaf, "dtype", None)
        avals.append((tuple(aval.shape), type(leaf).__name__ if given is None else str(given),
                      str(aval.dtype), bool(getattr(aval, "weak_type", False))))
    return treedef, tuple(avals)


def hashable(key: Any) -> bool:
    """Whether `key` can key a cache (a pytree node's unhashable static field cannot)."""
    try:
        hash(key)
    except TypeError:
        return False
    return True


class LRU:
    """A thread-safe mapping that keeps its `size` most recently used entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if key not in self._entries:
                return default
            self._entries.move_to_end(key)
            return self._entries[key]

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def drop(self, keep: Any) -> None:
        """Removes the entries whose key fails `keep(key)`."""
        with self._lock:
            for key in [k for k in self._entries if not keep(k)]:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
