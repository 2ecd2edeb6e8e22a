"""The planted-fault suite's model files are user code written with JAX's default settings
(``x @ w + b`` promotes the bias's rank), so the suite-wide rank-promotion error of
tests/conftest.py is lifted here; and its markers are registered."""
import jax
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs for minutes (the doctor on every model file)")
    config.addinivalue_line(
        "markers", "float16: compiles float16 programs (some CPUs' XLA cannot)")


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():   # overrides tests/conftest.py's fixture of the same name
    with jax.numpy_rank_promotion("allow"):
        yield
