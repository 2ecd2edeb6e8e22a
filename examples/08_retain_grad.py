"""Gradients of intermediate values, PyTorch's retain_grad, in functional form (article A §1.3).

In PyTorch only leaves get ``.grad``; ``h.retain_grad()`` keeps an intermediate's. In funcgrad,
name the value with ``tap`` inside the pure function and transform the function with
``intermediate_grads``: it returns the loss, the parameter gradients and d(loss)/d(tapped
value). The hand formulas of the two-layer MLP (B §2.3) give the reference:
    dlogits = (softmax(logits) - onehot(y)) / B,   dh = dlogits W2ᵀ,   dz = dh ⊙ (z > 0).

    $ python examples/08_retain_grad.py
"""
import jax
import jax.numpy as jnp
from _check import Check

import funcgrad as fg
from funcgrad.check.manual import dlogits_softmax_cross_entropy


def loss_fn(params, x, y):
    z = fg.tap("z", x @ params[0]["w"] + params[0]["b"][None, :])
    h = fg.tap("h", jax.nn.relu(z))
    logits = fg.tap("logits", h @ params[1]["w"] + params[1]["b"][None, :])
    return fg.softmax_cross_entropy(logits, y)


def main() -> None:
    data = fg.load_digits(seed=0)
    with jax.enable_x64(True):  # float64 so that the hand formulas agree to 1e-12
        params = fg.mlp_init(jax.random.key(0), (64, 32, 10), dtype=jnp.float64)
        x, y = jnp.asarray(data.x_train[:16], jnp.float64), jnp.asarray(data.y_train[:16])

        loss, grads, taps = jax.jit(fg.intermediate_grads(loss_fn))(params, x, y)
        z = x @ params[0]["w"] + params[0]["b"][None, :]
        h = jax.nn.relu(z)
        _, dlogits = dlogits_softmax_cross_entropy(h @ params[1]["w"] + params[1]["b"][None, :], y)
        dh = dlogits @ params[1]["w"].T
        dz = dh * (z > 0)
        err = lambda a, b: float(jnp.max(jnp.abs(a - b)))

        c = Check("d(loss)/d(intermediate) from taps vs the hand formulas (batch 16, 64-32-10)",
                  right="bound")
        print("  tap shapes: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in taps.items()))
        c.below("max |dlogits - hand|", err(taps["logits"], dlogits), 1e-12)
        c.below("max |dh - dlogits W2ᵀ|", err(taps["h"], dh), 1e-12)
        c.below("max |dz - dh ⊙ (z > 0)|", err(taps["z"], dz), 1e-12)
        # Parameter gradients from the tapped values: dW2 = hᵀ dlogits, dW1 = xᵀ dz.
        c.below("max |dW2 - hᵀ·dlogits(tap)|", err(grads[1]["w"], h.T @ taps["logits"]), 1e-12)
        c.below("max |dW1 - xᵀ·dz(tap)|", err(grads[0]["w"], x.T @ taps["z"]), 1e-12)
        c.below("loss equals jax.value_and_grad's", abs(float(loss - loss_fn(params, x, y))), 1e-12)

        # Inside vmap the tap sees one example; its gradient comes back with the batch axis.
        def per_example_loss(params, x, y):
            def one(xi, yi):
                hi = fg.tap("h", jax.nn.relu(xi @ params[0]["w"] + params[0]["b"]))
                logits = hi @ params[1]["w"] + params[1]["b"]
                return -jax.nn.log_softmax(logits)[yi]
            return jnp.mean(jax.vmap(one)(x, y))

        _, _, taps_v = fg.intermediate_grads(per_example_loss)(params, x, y)
        print(f"\n  under vmap: tap 'h' gradient shape {tuple(taps_v['h'].shape)} (batch, hidden)")
        c.below("max |dh(vmap) - dh(batched)|", err(taps_v["h"], dh), 1e-12)

        # Without intermediate_grads a tap is the identity: jax.grad is unchanged (up to the
        # rounding of jitted vs eager code).
        plain = jax.grad(loss_fn)(params, x, y)
        c.below("|jax.grad(tapped) - interm. grads|",
                max(err(a, b) for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(grads))),
                1e-12)
    c.done()


if __name__ == "__main__":
    main()
