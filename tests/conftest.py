"""Make mistakes loud: implicit rank promotion is an error everywhere, strict dtype promotion
where the code under test is ours alone (optax's Adam mixes Python floats and int32 counts, so
it cannot run under strict promotion), warnings are errors (pyproject), and keys are seeded.

Compilation is most of the suite's time (hundreds of small programs, each run a few times), so
XLA's backend (LLVM) optimisation level is 0 here unless XLA_FLAGS already sets it: on this
2-core machine it cut the CPU time of test_coupling.py + test_train_guard.py from 92 s to 77 s.
It changes how fast the compiled code runs, not the arithmetic asked for (no fast-math or
reassociation at either level; at most the last bit where LLVM would fuse a multiply-add, as
between two CPUs). Subprocesses (examples, CLI) inherit it through the environment."""
import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads it when it starts)
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
