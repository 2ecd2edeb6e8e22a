"""requires_grad as a trainable mask: freeze the first layer of the digits MLP (article A §2.1).

PyTorch sets ``requires_grad=False`` on a tensor; here a mask of bools over the params pytree
says which leaves are trainable. Frozen leaves are passed to the loss as plain values, so no
gradient work is done for them, and `train_only` gives them exactly zero optimizer updates.

    $ python examples/06_requires_grad.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg
from funcgrad._jaxpr import sub_jaxprs
from funcgrad.train.masks import requires_grad, train_only, trainable_mask, value_and_grad_trainable


def count_dot_generals(jaxpr) -> int:
    return sum((e.primitive.name == "dot_general")
               + sum(count_dot_generals(sub) for _, sub, _ in sub_jaxprs(e)) for e in jaxpr.eqns)


def loss_fn(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def propagation(c: Check) -> None:
    # The rule: an output needs a gradient iff some input on a differentiable path does.
    # a is frozen (like data), b is trainable.
    def f(p):
        a, b = p["a"], p["b"]
        return {"a * b": a * b, "a ** 2": a ** 2,
                "stop_gradient(b) * a": jax.lax.stop_gradient(b) * a, "b > 0": b > 0}

    mask = {"a": False, "b": True}
    p = {"a": jnp.float32(2.0), "b": jnp.float32(3.0)}
    expected = {"a * b": True, "a ** 2": False, "stop_gradient(b) * a": False, "b > 0": False}
    for name, needs in requires_grad(f, mask)(p).items():
        c.row(f"requires_grad({name})", needs, expected[name])
    # c = a*b: dc/db = a = 2; a is frozen, so its gradient is an exact 0 (dc/da = b is not formed).
    _, g = value_and_grad_trainable(lambda p: p["a"] * p["b"], mask)(p)
    c.row("d(a*b)/db", g["b"], 2.0)
    c.row("d(a*b)/da, a frozen", g["a"], 0.0)


def main() -> None:
    c = Check("the propagation rule on f(a, b), a frozen, b trainable", left="funcgrad",
              right="by hand")
    propagation(c)

    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 64, 10))
    mask = trainable_mask(params, freeze="0/*")
    print(f"\ntrainable_mask(params, freeze='0/*') = {mask}")

    tx = train_only(optax.adam(1e-2), mask)  # True = trained, as the mask reads
    grad_fn = value_and_grad_trainable(loss_fn, mask)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    new, opt_state, losses = params, tx.init(params), []
    for batch in list(fg.Batches(data.x_train, data.y_train, batch_size=64).epoch(0))[:20]:
        new, opt_state, loss = step(new, opt_state, batch)
        losses.append(float(loss))

    print()
    c2 = Check("64 -> 64 -> 10 MLP on digits, layer 0 frozen, 20 Adam steps (lr 1e-2)",
               left="measured", right="expected")
    for name in ("w", "b"):
        changed = np.sum(np.asarray(new[0][name]).view(np.uint32)
                         != np.asarray(params[0][name]).view(np.uint32))
        c2.row(f"0/{name}: elements whose bits changed", changed, 0)
    for name in ("w", "b"):
        moved = float(jnp.max(jnp.abs(new[1][name] - params[1][name])) > 0)
        c2.row(f"1/{name} moved (1 = yes)", moved, 1.0)
    c2.below("loss of step 20 / loss of step 1", losses[-1] / losses[0], 1.0)
    # Adam keeps mu and nu for trainable leaves only: 2 * (64*10 + 10) = 1300 floats
    # (all leaves would be 2 * (64*64 + 64 + 650) = 9620).
    c2.row("Adam state floats", sum(x.size for x in jax.tree.leaves(opt_state)
                                    if x.dtype == jnp.float32), 1300)

    # No gradient work for frozen leaves. Matrix products in the traced gradient computation:
    # forward x W0, h W1 (2); backward all trainable: dW1 = hᵀ dlogits, dh = dlogits W1ᵀ,
    # dW0 = xᵀ dz (3), total 5; layer 0 frozen: only dW1 (1), total 3.
    batch = {"x": jnp.asarray(data.x_train[:64]), "y": jnp.asarray(data.y_train[:64])}
    full = count_dot_generals(jax.make_jaxpr(jax.value_and_grad(loss_fn))(params, batch).jaxpr)
    part = count_dot_generals(jax.make_jaxpr(grad_fn)(params, batch).jaxpr)
    c2.row("dot_generals, jax.value_and_grad", full, 5)
    c2.row("dot_generals, layer 0 frozen", part, 3)

    # The same optimizer in funcgrad's train step: it carries the mask, which the step takes as
    # its trainable=, so layer 0 is not differentiated there either and its update is exactly
    # zero.
    train_step = fg.make_train_step(loss_fn, tx)
    state = train_step.init(params)
    for _ in range(3):
        state, _ = train_step(state, batch)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params[0]),
                                                    jax.tree.leaves(params[0])))
    c2.row("train step + train_only: layer 0 kept", float(same), 1.0)
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
