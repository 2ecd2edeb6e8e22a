"""Backward twice and higher order: retain_graph, reusable pullbacks, a gradient penalty (A §4.4).

PyTorch frees the residuals of a graph during ``backward()``, so a second call needs
``retain_graph=True``. ``jax.vjp`` instead returns the pullback as a function that holds its
residuals: call it as often as you like, with any cotangent; they are freed when it is
dropped. Differentiating a gradient (a gradient penalty, as in WGAN-GP) is ``jax.grad`` of a
function that itself calls ``jax.grad``: no ``create_graph=True``, every gradient is itself a
differentiable function. `funcgrad.debug.vjp.backward` is the one-call form with a cotangent.

    $ python examples/10_backward_twice.py
"""
import jax
import jax.numpy as jnp
from _check import Check

import funcgrad as fg
from funcgrad.debug.vjp import backward


def reuse_pullback(c: Check) -> None:
    # f(x) = x^3 elementwise: J = diag(3 x^2), so vᵀJ = 3 x^2 v. At x = (1, 2, 3):
    # v1 = (1, 1, 1) -> (3, 12, 27); v2 = (1, 0, -1) -> (3, 0, -27).
    x = jnp.array([1.0, 2.0, 3.0])
    y, pullback = jax.vjp(lambda x: x ** 3, x)
    residuals = jax.tree.leaves(pullback)
    print(f"  y = {y.tolist()}; the pullback holds {len(residuals)} residual(s): "
          + ", ".join(f"{r.dtype}{list(r.shape)}" for r in residuals))
    (g1,) = pullback(jnp.array([1.0, 1.0, 1.0]))
    (g2,) = pullback(jnp.array([1.0, 0.0, -1.0]))
    (g3,) = pullback(jnp.array([1.0, 1.0, 1.0]))  # a third call: nothing was freed
    for i, want in enumerate([3.0, 12.0, 27.0]):
        c.row(f"pullback(v1)[{i}] = 3 x{i}^2", g1[i], want)
    for i, want in enumerate([3.0, 0.0, -27.0]):
        c.row(f"pullback(v2)[{i}] = 3 x{i}^2 v2[{i}]", g2[i], want)
    c.row("pullback(v1) again, max |diff|", jnp.max(jnp.abs(g3 - g1)), 0.0)

    # The same through funcgrad.debug.vjp, and its error when the cotangent is left out.
    g = backward(lambda x: x ** 3, x, cotangent=jnp.array([1.0, 0.0, -1.0]))
    c.row("backward(x^3, cotangent=v2)[2]", g[2], -27.0)
    try:
        backward(lambda x: x ** 3, x)
        raised = 0.0
    except ValueError as err:
        raised = 1.0
        print("  backward(x^3) without a cotangent: " + str(err).splitlines()[0])
    c.row("missing cotangent raises (1 = yes)", raised, 1.0)


def penalty_by_hand(c: Check) -> None:
    # f(w, x) = sum(w x^2): grad_x f = 2 w x. Penalty P(w) = ||grad_x f||^2 = 4 sum(w^2 x^2),
    # dP/dw = 8 w x^2. At w = (1, -2), x = (3, 0.5): grad_x f = (6, -2), P = 36 + 4 = 40,
    # dP/dw = (8*1*9, 8*(-2)*0.25) = (72, -4).
    x = jnp.array([3.0, 0.5])
    f = lambda w, x: jnp.sum(w * x ** 2)
    penalty = lambda w: jnp.sum(jax.grad(f, argnums=1)(w, x) ** 2)
    w = jnp.array([1.0, -2.0])
    p, dp = jax.value_and_grad(penalty)(w)
    c.row("P(w) = ||grad_x f||^2", p, 40.0)
    c.row("dP/dw0 = 8 w0 x0^2", dp[0], 72.0)
    c.row("dP/dw1 = 8 w1 x1^2", dp[1], -4.0)


def penalty_of_an_mlp(c: Check) -> None:
    # P(params) = mean over a batch of ||d f / d x||^2 for a tanh MLP with one output (tanh,
    # not ReLU, keeps P smooth so finite differences apply). Checked along a random direction
    # d: (P(p + h d) - P(p - h d)) / 2h against <grad P, d>, float64, h = 1e-6: truncation
    # ~h^2 |P'''| ~ 1e-12, round-off ~1e-16 |P| / h ~ 1e-10.
    with jax.enable_x64(True):
        params = fg.mlp_init(jax.random.key(0), (4, 8, 1), activation="tanh",
                             dtype=jnp.float64)
        xs = jax.random.normal(jax.random.key(1), (6, 4), jnp.float64)

        def f(params, x):  # scalar output for one example x of shape (4,)
            return fg.mlp_apply(params, x[None, :], activation="tanh")[0, 0]

        def penalty(params):
            grads_x = jax.vmap(jax.grad(f, argnums=1), in_axes=(None, 0))(params, xs)
            return jnp.mean(jnp.sum(grads_x ** 2, axis=1))

        grad_p = jax.jit(jax.grad(penalty))(params)
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(2), len(leaves))
        d = treedef.unflatten([jax.random.normal(k, x.shape, x.dtype)
                               for k, x in zip(keys, leaves)])
        along = lambda s: jax.tree.map(lambda a, b: a + s * b, params, d)
        h = 1e-6
        fd = (penalty(along(h)) - penalty(along(-h))) / (2 * h)
        analytic = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(grad_p), jax.tree.leaves(d)))
        c.row("<grad P, d> vs central difference", analytic, fd, tol=1e-7 * max(1.0, abs(fd)))


def main() -> None:
    c = Check("one pullback, several cotangents: f(x) = x^3 at x = (1, 2, 3)")
    reuse_pullback(c)
    print()
    c2 = Check("gradient penalty by hand: f(w, x) = sum(w x^2)")
    penalty_by_hand(c2)
    print()
    c3 = Check("gradient penalty of a 4 -> 8 -> 1 tanh MLP, float64", left="grad of grad",
               right="central diff")
    penalty_of_an_mlp(c3)
    c.failed += c2.failed + c3.failed
    c.done()


if __name__ == "__main__":
    main()
