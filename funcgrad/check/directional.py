"""The directional gradient check: central differences along random unit tangents compared with
``jvp`` and ``<grad, v>``, for models too large to perturb every element (article B §3.3).

Each leaf (or each block of at most `block_size` elements of a leaf) gets `num_directions`
random unit tangents of its own, and `num_directions` more run over all leaves together; a
failing leaf is bisected over element ranges (O(log n) evaluations) to name the element
responsible. A single wrong element of a B-element block moves a directional derivative by
only about 1/sqrt(B) of its error, so each row states its resolution: the smallest
single-element error it reports with probability >= 99% (`funcgrad.check._directions`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from funcgrad.check import _directional_mode, _run
from funcgrad.check.options import CheckOptions, _options_of
from funcgrad.check.report import GradCheckReport


def check_directional(fn: Callable, *args: Any, argnums: int | Sequence[int] = 0,
                      has_aux: bool = False, num_directions: int = 4,
                      block_size: int | None = None,
                      allow_stop_gradient: bool | str | Sequence[str] = False,
                      options: CheckOptions | None = None) -> GradCheckReport:
    """Compares directional derivatives of `fn` at `args` along random unit tangents with their
    central finite differences, in float64.

    For a large model, where `funcgrad.check_grads`' 2n forward evaluations are too many: it
    costs 2 evaluations per tangent (3 with "fwd"'s jvp), plus O(log n) to name the element
    of a failing leaf. Each row's ``resolution`` says how large a single-element error must be
    to be reported with probability >= 99%; `funcgrad.audit` picks `block_size` for a budget
    of evaluations.

    Args:
      fn: as for `funcgrad.check_grads`.
      *args: as for `funcgrad.check_grads`.
      argnums: as for `funcgrad.check_grads`.
      has_aux: as for `funcgrad.check_grads`.
      num_directions: random unit tangents per leaf (per block with `block_size`), and as
        many over all leaves together: a positive int. Each is compared with ``<grad, v>``
        ("rev") and the ``jvp`` along it ("fwd").
      block_size: cut each leaf into blocks of at most this many elements, each with its own
        `num_directions` tangents (a positive int); None draws them over each whole leaf. A
        single-element error is diluted about sqrt(block size)-fold along a tangent.
      allow_stop_gradient: as for `funcgrad.check_grads`.
      options: a `funcgrad.CheckOptions`; its `seed` draws the tangents, its `chunk_size` is
        tangents per vmapped batch, its `progress` is not used (no bar: the tangents run in
        one call). None for its defaults.
    Returns:
      a `GradCheckReport` (``mode`` "directional"): one `LeafCheck` row per differentiated
      leaf, each with its ``resolution``.
    Raises:
      ValueError: num_directions not a positive int, block_size not a positive int or None;
        and as `funcgrad.check_grads`.
      TypeError: as `funcgrad.check_grads`.
    Example:
      >>> report = fg.check_directional(loss_fn, params, batch, num_directions=8)
      >>> report.rows[0].resolution  # errors of one element above this are reported
    """
    options = _options_of("check_directional", options)
    k = num_directions
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"check_directional: num_directions must be a positive int (random "
                         f"tangents per leaf or block), got {k!r}.")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(
            block_size, (int, np.integer)) or block_size < 1):
        raise ValueError(f"check_directional: block_size must be a positive int (elements per "
                         f"block of tangents) or None (each leaf whole), got {block_size!r}.")
    return _run.run("check_directional", "directional", fn, args, argnums, has_aux,
                    allow_stop_gradient, options,
                    lambda prob, tol, allowed: _directional_mode.run_directional(
                        prob, tol, options, allowed, int(k), block_size))
