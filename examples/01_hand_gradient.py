"""Gradients you can check by hand: two scalar problems (article A §3.1, B §3.1).

    $ python examples/01_hand_gradient.py
"""
import jax
import jax.numpy as jnp
from _check import Check


def squared_error(params, x, target):
    return (params["w"] * x + params["b"] - target) ** 2


def main() -> None:
    # Problem 1: y = w*x + b with w=1, b=0, x=2, target 10.
    #   y = 2, loss = (2-10)^2 = 64, dL/dy = 2*(2-10) = -16, dL/dw = -16*x = -32, dL/db = -16.
    loss, g = jax.value_and_grad(squared_error)({"w": 1.0, "b": 0.0}, 2.0, 10.0)
    c = Check("y = w*x + b, squared error, w=1 b=0 x=2 target=10")
    c.row("loss", loss, 64.0)
    c.row("dL/dw", g["w"], -32.0)
    c.row("dL/db", g["b"], -16.0)

    # Problem 2: y = x*w + b with x=2, w=3, b=1, loss (y-4)^2, differentiated in x, w and b.
    #   y = 7, loss = 9, dL/dy = 6, dL/dx = 6*w = 18, dL/dw = 6*x = 12, dL/db = 6.
    def loss2(x, w, b):
        return (x * w + b - 4.0) ** 2

    value, (dx, dw, db) = jax.value_and_grad(loss2, argnums=(0, 1, 2))(
        jnp.float32(2.0), jnp.float32(3.0), jnp.float32(1.0))
    print()
    c2 = Check("y = x*w + b, loss (y - 4)^2, x=2 w=3 b=1")
    c2.row("loss", value, 9.0)
    c2.row("dL/dx", dx, 18.0)
    c2.row("dL/dw", dw, 12.0)
    c2.row("dL/db", db, 6.0)
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
