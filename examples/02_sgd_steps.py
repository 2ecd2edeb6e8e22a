"""Three SGD steps by funcgrad's train step and by hand (article A §3.2; concept 10).

There is no zero_grad: each step's gradient is computed fresh from the current params.

    $ python examples/02_sgd_steps.py
"""
import jax.numpy as jnp
from _check import Check

import funcgrad as fg


def loss_fn(params, batch):
    return (params["w"] * batch["x"] + params["b"] - batch["y"]) ** 2


def main() -> None:
    # By hand, lr = 0.01: the residual r = w*x + b - 10 obeys r <- r - lr*(2*r*x*x + 2*r)
    # = 0.9*r, so r = -8, -7.2, -6.48, -5.832 and the loss is 64 * 0.81^k.
    hand = [  # (w, b, loss) after each step
        (1.32, 0.16, 51.84),
        (1.608, 0.304, 41.9904),
        (1.8672, 0.4336, 34.012224),
    ]
    batch = {"x": jnp.float32(2.0), "y": jnp.float32(10.0)}
    tx = fg.make_optimizer("sgd", 0.01)
    step = fg.make_train_step(loss_fn, tx)
    state = step.init({"w": jnp.float32(1.0), "b": jnp.float32(0.0)})
    c = Check("SGD, lr=0.01, on y = w*x + b, x=2, target 10, from w=1 b=0")
    for k, (w, b, loss) in enumerate(hand, start=1):
        state, _ = step(state, batch)
        # float32 carries ~7 significant digits; 1e-5 of values up to 52 is a few ulps.
        c.row(f"step {k}: w", state.params["w"], w, tol=1e-5)
        c.row(f"step {k}: b", state.params["b"], b, tol=1e-5)
        c.row(f"step {k}: loss", loss_fn(state.params, batch), loss, tol=1e-4)
    c.done()


if __name__ == "__main__":
    main()
