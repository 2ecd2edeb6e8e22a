"""Autodiff taken apart: funcgrad.micro, a tiny reverse-mode engine on NumPy (concept 24).

The same hand numbers as 01_hand_gradient.py, the same three SGD steps as 02_sgd_steps.py
(here with PyTorch's habits: .grad accumulates, so each step starts with zero_grad), the
two-layer MLP's backward pass by hand (funcgrad.two_layer_grads) against micro, and the
digits MLP trained with micro alone (article B §3: write the engine, check it, use it).

    $ python examples/23_micro.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from _check import Check

import funcgrad as fg
from funcgrad import micro
from funcgrad.micro import Tensor


def hand_numbers(c: Check) -> None:
    # y = w*x + b with w=1, b=0, x=2, target 10: y = 2, loss = (2-10)^2 = 64,
    # dL/dy = 2*(2-10) = -16, dL/dw = -16*x = -32, dL/db = -16.
    w, b = Tensor(1.0, requires_grad=True), Tensor(0.0, requires_grad=True)
    loss = (w * 2.0 + b - 10.0) ** 2
    loss.backward()
    c.row("loss (w=1 b=0 x=2 target=10)", loss.item(), 64.0)
    c.row("dL/dw", w.grad, -32.0)
    c.row("dL/db", b.grad, -16.0)
    # y = x*w + b with x=2, w=3, b=1, loss (y-4)^2: y = 7, loss = 9, dL/dy = 6,
    # dL/dx = 6*w = 18, dL/dw = 6*x = 12, dL/db = 6.
    x, w, b = (Tensor(v, requires_grad=True) for v in (2.0, 3.0, 1.0))
    loss = (x * w + b - 4.0) ** 2
    loss.backward()
    c.row("loss (x=2 w=3 b=1 target=4)", loss.item(), 9.0)
    for name, t, ref in (("dL/dx", x, 18.0), ("dL/dw", w, 12.0), ("dL/db", b, 6.0)):
        c.row(name, t.grad, ref)


def sgd_steps(c: Check) -> None:
    # lr = 0.01: r = w*x + b - 10 obeys r <- r - lr*(2*r*x*x + 2*r) = 0.9*r, so
    # r = -8, -7.2, -6.48, -5.832 and the loss is 64 * 0.81^k.
    hand = [(1.32, 0.16, 51.84), (1.608, 0.304, 41.9904), (1.8672, 0.4336, 34.012224)]
    w, b = Tensor(1.0, requires_grad=True), Tensor(0.0, requires_grad=True)
    for k, (w_ref, b_ref, loss_ref) in enumerate(hand, start=1):
        w.zero_grad(), b.zero_grad()  # without it, step 2 would use -32 + (-23.04)
        ((w * 2.0 + b - 10.0) ** 2).backward()
        with micro.no_grad():
            w.add_(w.grad, alpha=-0.01)
            b.add_(b.grad, alpha=-0.01)
        loss = ((w * 2.0 + b - 10.0) ** 2).item()
        # float64 rounding of a few operations on values below 60: 1e-12.
        c.row(f"step {k}: w", w.item(), w_ref, tol=1e-12)
        c.row(f"step {k}: b", b.item(), b_ref, tol=1e-12)
        c.row(f"step {k}: loss", loss, loss_ref, tol=1e-11)


def mlp_logits(params, x):
    """The digits MLP in micro: relu(x W0 + b0) W1 + b1; x (batch, 64)."""
    h = micro.relu(x @ params[0]["w"] + params[0]["b"])
    return h @ params[1]["w"] + params[1]["b"]


def two_layer_backward(c: Check, data) -> None:
    with jax.enable_x64(True):  # float64 so the hand backward and micro agree to 1e-10
        jparams = fg.mlp_init(jax.random.key(0), (64, 32, 10), dtype=jnp.float64)
        x = np.asarray(data.x_train[:16], np.float64)
        labels = np.asarray(data.y_train[:16])
        hand_loss, hand = fg.two_layer_grads(jparams, jnp.asarray(x), jnp.asarray(labels),
                                             loss="softmax_cross_entropy")
    params = [{k: Tensor(np.asarray(v), requires_grad=True) for k, v in layer.items()}
              for layer in jparams]
    loss = micro.softmax_cross_entropy(mlp_logits(params, Tensor(x)), labels)
    loss.backward()
    c.below("|loss - hand loss|", abs(loss.item() - float(hand_loss)), 1e-10)
    for layer, (p, h) in enumerate(zip(params, hand)):
        for name in ("w", "b"):
            diff = float(np.max(np.abs(p[name].grad - np.asarray(h[name]))))
            c.below(f"d[{layer}]['{name}'] {p[name].shape}", diff, 1e-10)


def train_digits(c: Check, data, *, hidden: int = 128, epochs: int = 40, batch: int = 32,
                 lr: float = 0.01, momentum: float = 0.9, seed: int = 0) -> None:
    """SGD with momentum (v <- m v + g; p <- p - lr v) on a 64-hidden-10 ReLU MLP with
    He-normal weights. Seeds 0-4 reach 0.972-0.978 test accuracy (360 test digits)."""
    rng = np.random.default_rng(seed)
    sizes = (64, hidden, 10)
    params = [{"w": Tensor(rng.normal(0, np.sqrt(2 / n_in), (n_in, n_out)), requires_grad=True),
               "b": Tensor(np.zeros(n_out), requires_grad=True)}
              for n_in, n_out in zip(sizes[:-1], sizes[1:])]
    leaves = [t for layer in params for t in layer.values()]
    velocity = [np.zeros_like(t.data) for t in leaves]
    x, y = np.asarray(data.x_train, np.float64), np.asarray(data.y_train)
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            for t in leaves:
                t.zero_grad()
            micro.softmax_cross_entropy(mlp_logits(params, Tensor(x[idx])), y[idx]).backward()
            with micro.no_grad():
                for t, v in zip(leaves, velocity):
                    v *= momentum
                    v += t.grad
                    t.add_(v, alpha=-lr)
    seconds = time.perf_counter() - start
    with micro.no_grad():
        logits = mlp_logits(params, Tensor(np.asarray(data.x_test, np.float64)))
    accuracy = float(np.mean(np.argmax(logits.data, axis=1) == data.y_test))
    print(f"  trained {epochs} epochs of {len(x)} digits in {seconds:.1f} s (timed in "
          f"benchmarks/micro.py, target <= 20 s): "
          f"test accuracy {accuracy:.4f} on {len(data.y_test)} digits")
    c.below("1 - test accuracy (target >= 0.97)", 1 - accuracy, 0.03)


def main() -> None:
    c = Check("micro: the articles' hand numbers", left="micro")
    hand_numbers(c)
    print()
    sgd_steps(c)
    print()
    data = fg.load_digits(seed=0)
    t = Check("64 -> 32 -> 10 ReLU MLP, 16 digits, float64: micro vs backward by hand",
              left="max |diff|", right="bound")
    two_layer_backward(t, data)
    print()
    d = Check("digits MLP 64 -> 128 -> 10 trained with micro (SGD lr 0.01, momentum 0.9)",
              left="micro", right="bound")
    train_digits(d, data)
    c.failed += t.failed + d.failed
    c.done()


if __name__ == "__main__":
    main()
