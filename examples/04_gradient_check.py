"""Gradient checking by central differences in float64 (article A §4.5, B §3.2-3.3; concept 19).

1. The article's audit: every element of every leaf of a tiny MLP, one row per leaf.
2. A custom_vjp layer with a planted bug (one element of dW doubled): found and located to
   its leaf and element.
3. A ReLU evaluated exactly at 0: reported as a non-differentiable point, not a failure.

    $ python examples/04_gradient_check.py
"""
import functools

import jax
import jax.numpy as jnp
from _check import Check

import funcgrad as fg


def make_dense(bad_element=None):
    @jax.custom_vjp
    def dense(w, b, x):
        return x @ w + b[None, :]

    def bwd(res, g):
        w, x = res
        dw = x.T @ g
        if bad_element is not None:
            dw = dw.at[bad_element].multiply(2.0)  # the planted bug
        return dw, g.sum(axis=0), g @ w.T

    dense.defvjp(lambda w, b, x: (dense(w, b, x), (w, x)), bwd)
    return dense


def main() -> None:
    data = fg.load_digits(seed=0)
    x, y = data.x_train[:16], data.y_train[:16]
    params = fg.mlp_init(jax.random.key(0), (64, 16, 10), activation="tanh")

    correct = make_dense()

    def loss(params, x, y, dense=correct):
        h = jnp.tanh(dense(params[0]["w"], params[0]["b"], x))
        return fg.softmax_cross_entropy(make_dense()(params[1]["w"], params[1]["b"], h), y)

    audit = fg.audit(loss, params, x, y)
    print(audit, "\n")

    bug = (5, 3)
    buggy = fg.check_grads(functools.partial(loss, dense=make_dense(bug)), params, x, y)
    print(buggy, "\n")
    failing = buggy.failures

    relu = fg.check_grads(lambda z: jnp.sum(jax.nn.relu(z) * jnp.arange(1.0, 4.0)),
                          jnp.array([0.0, 1.0, -1.0]))
    print(relu, "\n")

    c = Check("what the checker found", left="found", right="expected")
    c.row("audit: leaves that pass", sum(r.ok for r in audit.rows), 4)
    c.below("audit: max abs error", max(r.max_abs_error for r in audit.rows), 1e-7)
    c.row("planted bug: failing leaves", len(failing), 1)
    located = (bool(failing) and failing[0].path == "params[0]['w']"
               and failing[0].worst_index == bug)
    c.row("bug located at [0]['w'][5, 3]", located, True)
    # d = 2 * true derivative: the analytic/numeric ratio at the located element is 2.
    c.row("analytic / numeric there", failing[0].analytic / failing[0].numeric if failing else 0,
          2.0, tol=1e-6)
    c.row("relu(0) is a kink, not a failure", relu.ok and relu.rows[0].status ==
          "nondifferentiable_point", True)
    c.row("JAX's relu'(0)", relu.rows[0].kinks[0][3] if relu.rows[0].kinks else -1, 0.0)
    c.done()


if __name__ == "__main__":
    main()
