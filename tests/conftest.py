"""Make mistakes loud: implicit rank promotion is an error everywhere, strict dtype promotion
where the code under test is ours alone (optax's Adam mixes Python floats and int32 counts, so
it cannot run under strict promotion), warnings are errors (pyproject), and keys are seeded."""
import jax
import pytest


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture
def strict_dtypes():
    """Strict dtype promotion for the duration of a test that touches only funcgrad's own maths."""
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture
def key():
    return jax.random.key(0)
