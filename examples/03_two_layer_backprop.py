"""The two-layer ReLU perceptron's backward pass by hand equals jax.grad (article B §2.2-2.3).

Shapes, with batch B, input D, hidden H, classes K:
    x (B, D)  W1 (D, H)  b1 (H,)  z = x W1 + b1 (B, H)  h = relu(z)  W2 (H, K)  logits (B, K)

    $ python examples/03_two_layer_backprop.py
"""
import jax
import jax.numpy as jnp
import numpy as np
from _check import Check

import funcgrad as fg


def main() -> None:
    data = fg.load_digits(seed=0)
    failed = 0
    with jax.enable_x64(True):  # float64 so the two methods can agree to 1e-10
        params = fg.mlp_init(jax.random.key(0), (64, 32, 10), dtype=jnp.float64)
        x = jnp.asarray(data.x_train[:16], jnp.float64)
        targets = {
            "softmax_cross_entropy": jnp.asarray(data.y_train[:16]),
            "mean_squared_error": jax.nn.one_hot(data.y_train[:16], 10, dtype=jnp.float64),
        }
        for loss, t in targets.items():
            reference = getattr(fg, loss)

            def loss_fn(p, reference=reference, t=t):
                return reference(fg.mlp_apply(p, x), t)

            auto_loss, auto = jax.value_and_grad(loss_fn)(params)
            hand_loss, hand = fg.two_layer_grads(params, x, t, loss=loss)
            c = Check(f"64 -> 32 -> 10 ReLU MLP on 16 digits, {loss}, float64: manual vs jax.grad",
                      left="max |diff|", right="bound")
            c.below("loss", abs(hand_loss - auto_loss), 1e-10)
            for layer, (a, h, p) in enumerate(zip(auto, hand, params)):
                for name in ("w", "b"):
                    if not a[name].shape == h[name].shape == p[name].shape:
                        print(f"  shape mismatch at [{layer}]['{name}']: grad {h[name].shape}, "
                              f"param {p[name].shape}")
                        c.failed += 1
                        continue
                    diff = float(np.max(np.abs(np.asarray(a[name]) - np.asarray(h[name]))))
                    c.below(f"d[{layer}]['{name}'] {p[name].shape}", diff, 1e-10)
            failed += c.failed
            print()
    c.failed = failed
    c.done()


if __name__ == "__main__":
    main()
