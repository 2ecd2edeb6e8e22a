"""detach, clone, no_grad and in-place writes in JAX (article A §2.3, §2.4, §5.3; B §5.2).

    PyTorch                        JAX
    x.detach()                     jax.lax.stop_gradient(x)    value kept, gradient cut
    x.clone()                      jnp.array(x, copy=True)     new buffer, gradient passes
    x.detach().clone()             stop_gradient(jnp.array(x, copy=True))   a snapshot
    with torch.no_grad(): ...      just call the function (nothing is recorded unless you
                                   differentiate); stop_gradient for a region inside one
    enable_grad + requires_grad_   jax.grad with respect to the input, anywhere
    x[0] = 5                       x.at[0].set(5) returns a new array; x is unchanged

    $ python examples/07_stop_gradient_detach_clone.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg
from funcgrad._jaxpr import sub_jaxprs


def count_dot_generals(jaxpr) -> int:
    return sum((e.primitive.name == "dot_general")
               + sum(count_dot_generals(sub) for _, sub, _ in sub_jaxprs(e)) for e in jaxpr.eqns)


def detach_and_clone(c: Check) -> None:
    # detach: f(x) = x * stop_gradient(x). The stopped factor is a constant c = x = 3 to the
    # derivative, so df/dx = c = 3, while d(x*x)/dx = 2x = 6. The value is 9 either way.
    x = jnp.float32(3.0)
    f = lambda x: x * jax.lax.stop_gradient(x)
    c.row("x * stop_gradient(x) at x=3", f(x), 9.0)
    c.row("d/dx [x * stop_gradient(x)]", jax.grad(f)(x), 3.0)
    c.row("d/dx [x * x]", jax.grad(lambda x: x * x)(x), 6.0)

    # clone: a new buffer with the same values, and differentiable: d/dx sum(clone(x)^2) = 2x.
    v = jnp.array([1.0, 2.0])
    clone = lambda x: jnp.array(x, copy=True)
    c.row("clone is a new array (1 = yes)", float(clone(v) is not v), 1.0)
    g = jax.grad(lambda x: jnp.sum(clone(x) ** 2))(v)
    c.row("d/dx0 sum(clone(x)^2) = 2 x0", g[0], 2.0)
    c.row("d/dx1 sum(clone(x)^2) = 2 x1", g[1], 4.0)

    # detach().clone(): a snapshot s that is a constant. d/dx sum(s * x) = s = (1, 2), not 2x.
    g = jax.grad(lambda x: jnp.sum(jax.lax.stop_gradient(clone(x)) * x))(v)
    c.row("d/dx1 sum(snapshot(x) * x) = x1", g[1], 2.0)


def no_grad(c: Check, params, batch) -> None:
    def loss_fn(params, batch):
        return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])

    # Inference is a plain call: the traced program is the forward pass alone, x W0 and h W1
    # (2 matrix products); differentiating adds dW1, dh and dW0 (5 in all). No residuals are
    # kept unless a gradient is asked for, so there is nothing to switch off.
    c.row("matmuls: loss_fn(params, batch)",
          count_dot_generals(jax.make_jaxpr(loss_fn)(params, batch).jaxpr), 2)
    c.row("matmuls: value_and_grad(loss_fn)",
          count_dot_generals(jax.make_jaxpr(jax.value_and_grad(loss_fn))(params, batch).jaxpr), 5)

    # A no_grad region inside a differentiated function: h(w) = w^2 + stop_gradient(w^3).
    # At w = 2: h = 4 + 8 = 12, dh/dw = 2w = 4 (the region's 3w^2 = 12 is not added).
    h = lambda w: w ** 2 + jax.lax.stop_gradient(w ** 3)
    c.row("h(2) = 4 + 8", h(jnp.float32(2.0)), 12.0)
    c.row("dh/dw at 2 = 2w", jax.grad(h)(jnp.float32(2.0)), 4.0)


def saliency(c: Check, params, image) -> None:
    # Inference code (no parameter gradients) that still needs a gradient with respect to the
    # input: d logit[predicted class] / d image. In PyTorch: enable_grad inside no_grad and
    # image.requires_grad_(); here: jax.grad of a function of the image. float64, so the
    # central difference can be trusted to ~1e-9.
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        image = jnp.asarray(image, jnp.float64)

        @jax.jit
        def logit(image, k):
            return fg.mlp_apply(params, image[None, :])[0, k]

        predicted = int(jnp.argmax(fg.mlp_apply(params, image[None, :])))
        sal = jax.jit(jax.grad(logit))(image, predicted)
        i = int(jnp.argmax(jnp.abs(sal)))
        # Central difference (f(x + h e_i) - f(x - h e_i)) / 2h, h = 1e-6: a ReLU net is
        # piecewise linear in the image, so truncation error is 0 off a kink and round-off is
        # ~1e-16 * |logit| / h ~ 1e-10.
        e = np.zeros(image.shape)
        e[i] = 1e-6
        fd = (float(logit(image + e, predicted)) - float(logit(image - e, predicted))) / 2e-6
        print(f"  predicted class {predicted}; saliency map 8x8, largest |value| at pixel "
              f"({i // 8}, {i % 8}):")
        for row in np.asarray(sal).reshape(8, 8):
            print("   " + " ".join(f"{v:+6.2f}" for v in row))
        c.row(f"saliency[{i}] vs central difference", sal[i], fd, tol=1e-6 * max(1.0, abs(fd)))


def in_place(c: Check) -> None:
    x = jnp.array([1.0, 2.0, 3.0])
    try:
        x[0] = 5.0
        message = "(no error)"
    except TypeError as err:
        message = str(err)
    print(f"  x[0] = 5.0 on a jax array raises TypeError:\n    {message}")
    c.row("x[0] = 5 raises TypeError (1 = yes)", float(message != "(no error)"), 1.0)
    y = x.at[0].set(5.0)
    c.row("y = x.at[0].set(5); y[0]", y[0], 5.0)
    c.row("x[0] after it (unchanged)", x[0], 1.0)
    # The overwritten element no longer reaches the output: for g(x) = sum(x.at[0].set(5)^2),
    # dg/dx = (0, 2 x1, 2 x2) = (0, 4, 6).
    g = jax.grad(lambda x: jnp.sum(x.at[0].set(5.0) ** 2))(x)
    c.row("dg/dx0 (overwritten)", g[0], 0.0)
    c.row("dg/dx2 = 2 x2", g[2], 6.0)


def main() -> None:
    c = Check("detach <-> stop_gradient, clone <-> copy", left="funcgrad", right="by hand")
    detach_and_clone(c)

    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))

    def loss_fn(p, b):
        return fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])

    tx = optax.adam(1e-2)
    step = fg.make_train_step(loss_fn, tx)
    state = step.init(params)
    for batch in list(fg.Batches(data.x_train, data.y_train, batch_size=64).epoch(0))[:40]:
        state, _ = step(state, batch)
    batch = {"x": jnp.asarray(data.x_test[:32]), "y": jnp.asarray(data.y_test[:32])}

    print()
    c2 = Check("no_grad: just do not differentiate; stop_gradient for a region")
    no_grad(c2, state.params, batch)
    print()
    c3 = Check("saliency map of a test digit (64 -> 32 -> 10 MLP, 40 Adam steps)",
               left="jax.grad", right="central diff")
    saliency(c3, state.params, data.x_test[0])
    print()
    c4 = Check("in-place writes: x[0] = 5 vs x.at[0].set(5)")
    in_place(c4)
    c.failed += c2.failed + c3.failed + c4.failed
    c.done()


if __name__ == "__main__":
    main()
