"""pytest helpers: assert that gradients match finite differences, or fail with the check's table.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from funcgrad.check.grads import check_grads
from funcgrad.check.report import GradCheckReport


def assert_grads_close(fn: Callable, *args: Any, **kwargs: Any) -> GradCheckReport:
    """Runs `funcgrad.check_grads(fn, *args, **kwargs)` and fails like an assert if a leaf fails.

    For users' own test suites::

        def test_my_layer_grads():
            assert_grads_close(my_loss, params, batch)

    Args:
      fn: as for `funcgrad.check_grads`.
      *args: as for `funcgrad.check_grads`.
      **kwargs: as for `funcgrad.check_grads`.
    Returns:
      the `GradCheckReport` when every leaf passes (kinks and stop_gradient-cut leaves pass).
    Raises:
      AssertionError: with the report's table, naming each failing leaf and its worst element.
    """
    report = check_grads(fn, *args, **kwargs)
    report.raise_if_failed()
    return report
