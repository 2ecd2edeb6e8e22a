"""Backpropagation by hand: the two-layer ReLU perceptron's gradients written out, no autodiff.

These are the formulas of article B §2.2-2.3, used as an independent reference for
``jax.grad``. With ``z = x W1 + b1``, ``h = relu(z)`` and ``logits = h W2 + b2``:

    dW2 = hᵀ · dlogits          (hidden, out)
    db2 = Σ_batch dlogits       (out,)
    dh  = dlogits · W2ᵀ         (batch, hidden)
    dz  = dh ⊙ (z > 0)          (batch, hidden)   relu'(0) = 0, as in JAX
    dW1 = xᵀ · dz               (in, hidden)
    db1 = Σ_batch dz            (hidden,)

where ``dlogits = d(loss)/d(logits)`` of shape ``(batch, out)`` depends on the loss (see
`dlogits_softmax_cross_entropy` and `dlogits_mean_squared_error`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from funcgrad.demo.mlp import Params

LOSSES = ("softmax_cross_entropy", "mean_squared_error")


def dlogits_softmax_cross_entropy(logits: jax.Array,
                                  labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Loss and d(loss)/d(logits) for the batch-mean softmax cross-entropy.

    loss = -(1/B) Σ_i log softmax(logits_i)[y_i]; differentiating log-sum-exp gives
    d(loss)/d(logits_i) = (softmax(logits_i) - onehot(y_i)) / B.

    Args:
      logits: (batch, classes), floating.
      labels: (batch,), integer class indices.
    Returns:
      (loss of shape (), dlogits of shape (batch, classes)), the dtype of `logits`.
    """
    batch, classes = logits.shape
    log_p = logits - jax.nn.logsumexp(logits, axis=1, keepdims=True)
    onehot = jax.nn.one_hot(labels, classes, dtype=logits.dtype)
    loss = -(onehot * log_p).sum() / batch
    return loss, (jnp.exp(log_p) - onehot) / batch


def dlogits_mean_squared_error(logits: jax.Array,
                               targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Loss and d(loss)/d(logits) for the mean squared error over every element.

    loss = (1/(B·K)) Σ_ik (logits_ik - t_ik)²,
    so d(loss)/d(logits_ik) = 2 (logits_ik - t_ik) / (B·K).

    Args:
      logits: (batch, out), floating.
      targets: (batch, out), floating, the shape of `logits`.
    Returns:
      (loss of shape (), dlogits of shape (batch, out)).
    """
    r = logits - targets
    return (r * r).mean(), 2.0 * r / r.size


def two_layer_grads(params: Params, x: jax.Array, targets: jax.Array, *,
                    loss: str = "softmax_cross_entropy") -> tuple[jax.Array, Params]:
    """Loss and parameter gradients of a two-layer ReLU perceptron, by the hand formulas.

    The model is ``mlp_apply(params, x, activation="relu")`` with two layers.

    Args:
      params: ``[{"w": (in, hidden), "b": (hidden,)}, {"w": (hidden, out), "b": (out,)}]``.
      x: (batch, in), floating.
      targets: (batch,) integer labels for "softmax_cross_entropy"; (batch, out) floats for
        "mean_squared_error".
      loss: one of `LOSSES`.
    Returns:
      ``(loss, grads)``: loss of shape (), grads with the structure and shapes of `params`.
    Raises:
      ValueError: for an unknown loss, a model that is not two layers, or mismatched shapes.
    """
    if loss not in LOSSES:
        raise ValueError(f"two_layer_grads: loss must be one of {LOSSES}, got {loss!r}.")
    if len(params) != 2:
        raise ValueError(f"two_layer_grads: expected 2 layers, got {len(params)}.")
    (w1, b1), (w2, b2) = ((p["w"], p["b"]) for p in params)
    if x.ndim != 2 or x.shape[1] != w1.shape[0]:
        raise ValueError(f"two_layer_grads: x must be (batch, {w1.shape[0]}), got {x.shape}.")
    z = x @ w1 + b1[None, :]                      # (batch, hidden)
    h = jnp.maximum(z, 0)                          # (batch, hidden)
    logits = h @ w2 + b2[None, :]                  # (batch, out)
    if loss == "softmax_cross_entropy":
        value, dlogits = dlogits_softmax_cross_entropy(logits, targets)
    else:
        value, dlogits = dlogits_mean_squared_error(logits, targets)
    dw2 = h.T @ dlogits                            # (hidden, out)
    db2 = dlogits.sum(axis=0)                      # (out,)
    dh = dlogits @ w2.T                            # (batch, hidden)
    dz = dh * (z > 0).astype(dh.dtype)             # (batch, hidden)
    dw1 = x.T @ dz                                 # (in, hidden)
    db1 = dz.sum(axis=0)                           # (hidden,)
    return value, [{"w": dw1, "b": db1}, {"w": dw2, "b": db2}]
