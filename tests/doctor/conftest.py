"""Markers of the doctor's tests: the planted-fault suite's run of the doctor on every model file
is slow; a float16 model compiles float16 programs, which some CPUs' XLA cannot."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs for minutes (the doctor on every model file)")
    config.addinivalue_line(
        "markers", "float16: compiles float16 programs (some CPUs' XLA cannot)")
