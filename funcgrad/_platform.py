"""What the machine's XLA backend can compile, asked once, so a user hears it before a step fails.

float16 on an x86 CPU without the F16C instructions (a VirtualBox guest, an emulated x86 on an
ARM Mac, or ``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2``): XLA:CPU then lowers every float16
conversion to calls of ``__extendhfsf2`` / ``__truncsfhf2``, which its JIT does not provide
outside macOS, and *any* jitted float16 arithmetic fails with ``INTERNAL: Failed to materialize
symbols`` (openxla/xla#6787; the symbols were added for Apple only in openxla/xla#21903).
bfloat16 converts without them and is not affected. No funcgrad tool can work around it: the
user's own float16 program fails the same way.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["dtype_compiles", "require_dtype_compiles"]


@functools.cache
def _probe(dtype_name: str, backend: str) -> str | None:
    """None if a jitted float32 -> `dtype_name` -> float32 round trip with one multiply
    compiles and runs on `backend`, else XLA's message (the first line)."""
    device = jax.devices(backend)[0]
    x = jax.device_put(np.ones(2, np.float32), device)
    try:
        jax.jit(lambda v: (v.astype(dtype_name) * 2).astype(jnp.float32))(x).block_until_ready()
    except Exception as error:  # XLA raises JaxRuntimeError (XlaRuntimeError on older jaxlib)
        if "materialize symbols" not in str(error) and "Symbols not found" not in str(error):
            raise
        return str(error).strip().splitlines()[0]
    return None


def dtype_compiles(dtype, backend: str | None = None) -> bool:
    """True if XLA on `backend` (default: JAX's default backend) compiles arithmetic in
    `dtype`. Asked once per (dtype, backend) with a two-element program (milliseconds).
    False only for the missing-symbol failure described in this module's docstring."""
    backend = backend or jax.default_backend()
    return _probe(jnp.dtype(dtype).name, backend) is None


def require_dtype_compiles(dtype, where: str, name: str) -> None:
    """Raises RuntimeError naming `where` and `name` when `dtype` cannot be compiled on the
    default backend (float16 on an x86 CPU without F16C), with the alternatives."""
    dtype = jnp.dtype(dtype)
    if dtype != jnp.float16:
        return
    backend = jax.default_backend()
    reason = _probe(dtype.name, backend)
    if reason is not None:
        raise RuntimeError(
            f"{where}: {name} is float16, but XLA on this {backend.upper()} cannot compile "
            f"float16 arithmetic ({reason}). On x86 this happens without the F16C instructions "
            f"(virtual machines, emulated x86, XLA_FLAGS=--xla_cpu_max_isa below AVX): XLA "
            f"needs __extendhfsf2/__truncsfhf2, which its CPU JIT provides only on macOS "
            f"(openxla/xla#6787). Use jnp.bfloat16 (same memory, float32's exponent range, "
            f"no loss scale needed), or run on a GPU or a CPU with F16C.")
