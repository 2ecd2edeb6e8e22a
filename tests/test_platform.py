"""funcgrad/_platform.py: float16 is refused, with the reason, exactly where XLA cannot compile it.

The independent fact: XLA:CPU on x86 compiles float16 conversions to the F16C instructions when
the CPU has them and its ISA is not capped below AVX (F16C came with AVX-era CPUs; XLA's
``--xla_cpu_max_isa=SSE4_2`` caps it below); otherwise it calls ``__extendhfsf2``, which its JIT
lacks outside macOS (openxla/xla#6787). /proc/cpuinfo says whether this CPU has F16C.
"""
import os
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from funcgrad._platform import dtype_compiles


def _cpu_has_f16c() -> bool | None:
    try:
        with open("/proc/cpuinfo") as f:
            return " f16c" in f.read()
    except OSError:
        return None


def test_bfloat16_and_float32_always_compile():
    assert dtype_compiles(jnp.bfloat16) and dtype_compiles(jnp.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu" or platform.machine() != "x86_64"
                    or _cpu_has_f16c() is None, reason="the derivation is about x86 CPUs")
def test_float16_compiles_exactly_when_the_cpu_offers_f16c():
    capped = "xla_cpu_max_isa=SSE" in os.environ.get("XLA_FLAGS", "")
    assert dtype_compiles(jnp.float16) == (_cpu_has_f16c() and not capped)


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_max_isa=SSE4_2", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="XLA_FLAGS' ISA cap is x86's")
def test_without_f16c_float16_is_refused_with_the_reason_and_the_fix():
    proc = _run("""
        import jax.numpy as jnp, optax
        import funcgrad as fg
        from funcgrad._platform import dtype_compiles
        assert not dtype_compiles(jnp.float16) and dtype_compiles(jnp.bfloat16)
        for call in (lambda: fg.mixed_precision(lambda p, b: p["w"].sum(), jnp.float16),
                     lambda: fg.make_train_step(lambda p, b: p["w"].sum(), "sgd").init(
                         {"w": jnp.ones(2, jnp.float16)})):
            try:
                call()
            except RuntimeError as e:
                print("REFUSED", e)
        fg.make_train_step(fg.mixed_precision(lambda p, b: p["w"].sum(), jnp.bfloat16),
                           optax.sgd(0.1))                      # bfloat16 is fine there
        print("DONE")
    """)
    assert proc.returncode == 0, proc.stderr
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2 and proc.stdout.rstrip().endswith("DONE")
    assert "mixed_precision: compute_dtype is float16" in refused[0]
    assert "TrainStep.init: params['w'] is float16" in refused[1]
    assert all("jnp.bfloat16" in r and "F16C" in r for r in refused)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="XLA_FLAGS' ISA cap is x86's")
def test_the_cli_says_it_before_training(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_max_isa=SSE4_2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "funcgrad", "train", "--dtype", "float16",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 2
    assert "argument --dtype" in proc.stderr and "--dtype bfloat16" in proc.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()
