"""Markers of the doctor's tests: the planted-fault suite's run of the doctor on every model file
is slow (~25 minutes on a 2-core CPU) and runs only when asked for, with ``-m slow`` or
``FUNCGRAD_SLOW=1``; a float16 model compiles float16 programs, which some CPUs' XLA cannot."""
import os

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: runs for minutes (the doctor on every model file); only with -m slow "
        "or FUNCGRAD_SLOW=1")
    config.addinivalue_line(
        "markers", "float16: compiles float16 programs (some CPUs' XLA cannot)")


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.option.markexpr or "") or os.environ.get("FUNCGRAD_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow or FUNCGRAD_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
