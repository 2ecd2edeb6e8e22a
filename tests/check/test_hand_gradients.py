"""Gradient parity with hand calculations (article A §3.1, B §3.1; concept 9)."""
import jax
import jax.numpy as jnp


def linear_squared_error(params, x, target):
    y = params["w"] * x + params["b"]
    return (y - target) ** 2


def test_linear_squared_error_value_and_grads():
    # y = w*x + b = 1*2 + 0 = 2;  loss = (y - 10)**2 = (-8)**2 = 64
    # dL/dy = 2*(y - 10) = -16;  dL/dw = dL/dy * x = -32;  dL/db = dL/dy * 1 = -16
    # Every number is a small integer, exact in float32, so equality is exact.
    loss, grads = jax.jit(jax.value_and_grad(linear_squared_error))(
        {"w": jnp.float32(1.0), "b": jnp.float32(0.0)}, jnp.float32(2.0), jnp.float32(10.0))
    assert (float(loss), float(grads["w"]), float(grads["b"])) == (64.0, -32.0, -16.0)


def test_grads_with_respect_to_input_and_params():
    # y = x*w + b = 2*3 + 1 = 7;  loss = (y - 4)**2 = 9;  dL/dy = 2*(7 - 4) = 6
    # dL/dx = 6*w = 18;  dL/dw = 6*x = 12;  dL/db = 6   (exact in float32)
    def loss(x, w, b):
        return (x * w + b - 4.0) ** 2

    value, (dx, dw, db) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        jnp.float32(2.0), jnp.float32(3.0), jnp.float32(1.0))
    assert (float(value), float(dx), float(dw), float(db)) == (9.0, 18.0, 12.0, 6.0)
