"""Why is my gradient zero? Every status of explain_grads on one small model (A §4.1, §6; B §5.2).

PyTorch answers "None" for a parameter that never reached the loss; JAX answers with zeros, the
same zeros for five different reasons. The model below has one parameter leaf per reason:

    live    -> relu(x @ live + 1)                       connected
    dead    -> relu(x @ dead - 100)                     numerically_zero (every unit dead)
    frozen  -> stop_gradient(frozen) * 2                blocked_by_stop_gradient
    rounded -> round(rounded)                           blocked_by_zero_derivative_op
    spare   -> never read                               unused

    $ python examples/09_why_zero.py
"""
import jax
import jax.numpy as jnp
import numpy as np
from _check import Check

import funcgrad as fg


def loss_fn(params, x):
    live = jax.nn.relu(x @ params["live"] + 1.0)
    dead = jax.nn.relu(x @ params["dead"] - 100.0)
    frozen = jax.lax.stop_gradient(params["frozen"]) * 2.0
    rounded = jnp.round(params["rounded"])
    return jnp.mean(live) + jnp.mean(dead) + jnp.sum(frozen) + jnp.sum(rounded)


def main() -> None:
    data = fg.load_digits(seed=0)
    x = jnp.asarray(data.x_train[:32, :8])   # 32 digits, 8 standardised pixels
    k = jax.random.split(jax.random.key(0), 2)
    params = {"live": 0.1 * jax.random.normal(k[0], (8, 4)),
              "dead": 0.1 * jax.random.normal(k[1], (8, 3)),
              "frozen": jnp.ones(2), "rounded": jnp.array([0.4, 2.6]), "spare": jnp.ones(5)}

    report = fg.explain_grads(loss_fn, params, x)
    print(report, end="\n\n")
    grads = jax.grad(loss_fn)(params, x)
    print("jax.grad gives zeros for all but one of them:",
          {k: float(jnp.linalg.norm(jnp.ravel(g))) for k, g in grads.items()}, end="\n\n")

    c = Check("status of each leaf (left: explain_grads, right: by construction)", left="",
              right="")
    expected = {"live": "connected", "dead": "numerically_zero",
                "frozen": "blocked_by_stop_gradient", "rounded": "blocked_by_zero_derivative_op",
                "spare": "unused"}
    for name, status in expected.items():
        c.same(name, report.status(f"params['{name}']"), status)
    # Hand: x @ dead - 100 < 0 for every example (|x @ dead| is a few units at most), so all 3
    # units are dead; x @ live + 1 > 0 can fail for a unit only if x @ live < -1 everywhere.
    dead_site = next(s for s in report.relus if s.units == 3)
    c.same("dead units of the dead layer", dead_site.dead, 3)
    c.same("dead units of the live layer", next(s for s in report.relus if s.units == 4).dead,
           int(np.sum(np.all(np.asarray(x @ params["live"] + 1.0) <= 0, axis=0))))
    c.row("grad norm of 'live' vs jax.grad", report["params['live']"].grad_norm,
          float(jnp.linalg.norm(grads["live"])), tol=1e-6)
    c.done()


if __name__ == "__main__":
    main()
