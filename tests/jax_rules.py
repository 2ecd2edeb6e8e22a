"""Facts about the installed JAX's own differentiation rules that hand counts depend on,
read from JAX itself (not from funcgrad), so a test can state both derivations."""
import jax
import jax.numpy as jnp


def tanh_residuals() -> int:
    """How many (n,)-shaped values JAX's jvp rule of tanh keeps per tanh, read from the
    linearised program: JAX <= 0.11 writes tanh' as (t + t*y)(1 - y) with y = tanh(u) and keeps
    y and 1 - y (2); JAX 0.12 writes t * one_minus_square(y) and keeps 1 - y^2 only (1)."""
    text = str(jax.make_jaxpr(lambda x, t: jax.jvp(jnp.tanh, (x,), (t,)))(1.0, 1.0))
    return 1 if "one_minus_square" in text else 2
