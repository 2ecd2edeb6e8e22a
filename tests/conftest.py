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
import shutil
import tempfile

import pytest

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

# Many tests compile the same programs (the digits MLP's step, the same CNN, the same small
# eager ops), each in its own jax.jit. JAX's persistent compilation cache, keyed by the
# optimised program's fingerprint, lets a later test (in either xdist worker, or an example
# run as a subprocess) load what an earlier one compiled: 193 -> 154 s of CPU on
# test_accumulate + test_dead_relu + test_masks. The directory is new for each run (made here
# by the controlling process, inherited by the workers through the environment, removed at
# the end), so no run ever reads a program compiled by another version of the code.
_CACHE_MADE_HERE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_MADE_HERE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="funcgrad-tests-jax-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# `funcgrad train`'s own cache (the digits split; --cache-dir) goes in there too, not in ~/.cache.
os.environ.setdefault("FUNCGRAD_CACHE_DIR",
                      os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "funcgrad"))

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads it when it starts)


def pytest_unconfigure(config):
    if _CACHE_MADE_HERE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``float16`` are skipped, with the reason, where XLA cannot compile float16
    at all (an x86 CPU without F16C, or ``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2``: every float16
    program fails with "Failed to materialize symbols", openxla/xla#6787); funcgrad then
    refuses float16 with that reason (funcgrad/_platform.py, tests/test_platform.py)."""
    if not any(item.get_closest_marker("float16") for item in items):
        return
    from funcgrad._platform import dtype_compiles
    if dtype_compiles("float16"):
        return
    skip = pytest.mark.skip(reason="XLA on this CPU cannot compile float16 (no F16C; "
                                   "openxla/xla#6787)")
    for item in items:
        if item.get_closest_marker("float16"):
            item.add_marker(skip)
