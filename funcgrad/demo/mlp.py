"""Models as pure functions: a multilayer perceptron as a parameter pytree plus an apply function.

The parameters are a list of layers, each a dict ``{"w": (in, out), "b": (out,)}``, so a leaf's
pytree path reads ``[0]['w']``. Parameters made with a hidden activation other than ReLU are an
`MLPParams`, a list that also carries the activation's name, so `mlp_apply` runs the network
they were initialised for. Losses come from optax where optax has them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
Params = list[dict[str, jax.Array]]

#: Activation name -> (function, weight initializer). He (Kaiming) init keeps the forward
#: variance of ReLU-like units (He et al. 2015, arXiv:1502.01852); Glorot (Xavier) init keeps it
#: for units that are linear near 0 (Glorot & Bengio 2010).
ACTIVATIONS: dict[str, tuple[Callable[[jax.Array], jax.Array], Callable[..., jax.Array]]] = {
    "relu": (jax.nn.relu, jax.nn.initializers.he_normal()),
    "gelu": (jax.nn.gelu, jax.nn.initializers.he_normal()),
    "tanh": (jnp.tanh, jax.nn.initializers.glorot_normal()),
    "sigmoid": (jax.nn.sigmoid, jax.nn.initializers.glorot_normal()),
    "identity": (lambda z: z, jax.nn.initializers.glorot_normal()),
}


class MLPParams(list):
    """The layers of a perceptron (a list of ``{"w", "b"}`` dicts) and its hidden activation.

    A pytree whose children are the layers (paths ``[0]['w']`` as for a plain list) and whose
    static metadata is `activation`, so it survives ``jit``, ``grad`` and optimizer updates:
    ``jax.tree.map`` over it returns an `MLPParams` with the same activation. A mask or other
    pytree combined with it by ``jax.tree.map`` must be an `MLPParams` too (make it with
    ``funcgrad.trainable_mask(params, ...)``, which keeps the structure).

    Attributes:
      activation: a key of `ACTIVATIONS`.
    """

    def __init__(self, layers=(), activation: str = "relu"):
        super().__init__(layers)
        self.activation = activation

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return MLPParams(item, self.activation) if isinstance(index, slice) else item

    def __repr__(self) -> str:
        return f"MLPParams({list.__repr__(self)}, activation={self.activation!r})"


jax.tree_util.register_pytree_with_keys(
    MLPParams,
    lambda p: ([(jax.tree_util.SequenceKey(i), layer) for i, layer in enumerate(p)],
               p.activation),
    lambda activation, layers: MLPParams(layers, activation),
    lambda p: (list(p), p.activation))


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(
            f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


def mlp_init(key: jax.Array, sizes: Sequence[int], *, activation: str = "relu",
             dtype: jax.typing.DTypeLike = jnp.float32) -> Params:
    """Returns the parameters of a multilayer perceptron with layer widths `sizes`.

    Args:
      key: a JAX PRNG key (``jax.random.key(seed)`` or ``jax.random.PRNGKey(seed)``).
      sizes: layer widths ``(in, hidden..., out)``, at least two positive ints; e.g.
        ``(64, 128, 10)`` gives two layers.
      activation: name of the hidden activation (a key of `ACTIVATIONS`); it picks the weight
        initializer (He normal for "relu"/"gelu", Glorot normal for the others) and, for
        any activation but "relu", travels with the params, so ``mlp_apply(params, x)``
        applies it.
      dtype: floating dtype of every leaf.
    Returns:
      a list of ``len(sizes) - 1`` dicts; layer ``i`` has ``"w"`` of shape
      ``(sizes[i], sizes[i+1])`` and ``"b"`` of shape ``(sizes[i+1],)``, zeros. For
      ``activation="relu"`` (the default) a plain list; otherwise an `MLPParams` (a list that
      carries the activation's name).
    Raises:
      ValueError: if `sizes` has fewer than two entries or a non-positive one, or the
        activation is unknown.
      TypeError: if `key` is a Python int or other non-key (PyTorch seeds with an int; JAX
        takes a key made from it).
    """
    if isinstance(key, (int, np.integer)):
        raise TypeError(f"mlp_init: key must be a JAX PRNG key, got the int {key!r}. Make one "
                        f"from the seed: mlp_init(jax.random.key({int(key)}), sizes).")
    if not isinstance(key, (jax.Array, np.ndarray)):
        raise TypeError(f"mlp_init: key must be a JAX PRNG key (jax.random.key(seed)), got "
                        f"{type(key).__name__}.")
    sizes = tuple(sizes)
    if len(sizes) < 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(
            f"mlp_init: sizes must be at least two positive ints (in, ..., out), got {sizes!r}. "
            "Example: mlp_init(key, (64, 128, 10)).")
    _, init = _activation(activation)
    keys = jax.random.split(key, len(sizes) - 1)
    layers = [
        {"w": init(k, (fan_in, fan_out), dtype), "b": jnp.zeros((fan_out,), dtype)}
        for k, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:])
    ]
    # ReLU params stay a plain list, as before: masks and pytrees written as plain lists
    # (prefix masks such as [False, True]) keep matching them.
    return layers if activation == "relu" else MLPParams(layers, activation)


def mlp_apply(params: Params, x: jax.Array, *, activation: str | None = None,
              remat: Any = None) -> jax.Array:
    """Returns the logits of the perceptron: ``act(x W0 + b0) ... W_last + b_last``.

    Args:
      params: the list of ``{"w": (in, out), "b": (out,)}`` dicts made by `mlp_init` (an
        `MLPParams` when it was given an activation other than "relu").
      x: inputs of shape ``(batch, in)``, floating.
      activation: the hidden activation's name; the last layer is linear. Default: the one
        `params` carry (`MLPParams.activation`), else "relu".
      remat: None (keep every activation for the backward pass), or the layers' segments for
        `funcgrad.memory.remat_sequential` ("sqrt", a segment size k, or sizes): the backward
        pass then keeps each segment's input and recomputes the rest (same values, less
        compiled memory; see funcgrad/memory/checkpointing.py).
    Returns:
      logits of shape ``(batch, out)`` in the dtype of the parameters and `x` combined.
    Raises:
      ValueError: if `x` is not 2-D or its width does not match the first layer, or if
        `activation` differs from the one `params` were initialised for (the message says
        which).
    """
    carried = params.activation if isinstance(params, MLPParams) else None
    if activation is None:
        activation = carried or "relu"
    elif carried is not None and activation != carried:
        raise ValueError(
            f"mlp_apply: activation={activation!r}, but params were made by "
            f"mlp_init(..., activation={carried!r}) (its initializer is chosen for "
            f"{carried}). Leave activation out (the params carry it), or make the params "
            f"with mlp_init(..., activation={activation!r}).")
    act, _ = _activation(activation)
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(
            f"mlp_apply: x must have shape (batch, in), got shape {x.shape}. "
            "For a single example use x[None, :].")
    if not params or "w" not in params[0]:
        raise ValueError("mlp_apply: params must be the list of {'w', 'b'} dicts from mlp_init.")
    if x.shape[1] != params[0]["w"].shape[0]:
        raise ValueError(
            f"mlp_apply: x has {x.shape[1]} features but params[0]['w'] expects "
            f"{params[0]['w'].shape[0]} (shape {params[0]['w'].shape}).")
    def hidden(layer, h):
        return act(h @ layer["w"] + layer["b"][None, :])

    def last(layer, h):
        return h @ layer["w"] + layer["b"][None, :]

    layers = [hidden] * (len(params) - 1) + [last]
    if remat is not None:
        from funcgrad.memory.checkpointing import remat_sequential
        return remat_sequential(layers, list(params), x, segments=remat)
    h = x
    for f, layer in zip(layers, params):
        h = f(layer, h)
    return h


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over the batch, for integer class labels.

    Args:
      logits: shape ``(batch, classes)``, floating.
      labels: shape ``(batch,)``, integer class indices in ``[0, classes)``. A label outside
        that range, negative ones included, makes the loss NaN (it cannot raise inside jit;
        the train step then skips the update); `funcgrad.find_nonfinite` locates it.
    Returns:
      a scalar (shape ``()``) in nats, the dtype of `logits`.
    Raises:
      TypeError: if `labels` are not integers (one-hot or float labels: use
        ``optax.softmax_cross_entropy`` for probabilities, or ``labels.argmax(-1)``).
      ValueError: if the shapes do not match: labels must be ``logits.shape[:-1]``.
    """
    logits_shape, labels_shape = jnp.shape(logits), jnp.shape(labels)
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise TypeError(
            f"softmax_cross_entropy: labels must be integer class indices of shape "
            f"{logits_shape[:-1]}, got dtype {jnp.result_type(labels)} and shape {labels_shape}. "
            "For one-hot labels pass labels.argmax(-1); for soft labels (probabilities) use "
            "optax.softmax_cross_entropy(logits, probs).mean().")
    if labels_shape != logits_shape[:-1]:
        raise ValueError(
            f"softmax_cross_entropy: labels of shape {labels_shape} do not match logits of "
            f"shape {logits_shape}: expected one label per row, shape {logits_shape[:-1]}. "
            "Check that x and y of the batch hold the same examples.")
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    # A negative label would index from the end (-1: the last class) and give a finite, wrong
    # loss; one past the end gives NaN. Both are NaN here, so the guard skips the step.
    # Added, not selected: the NaN term does not depend on the logits, so the backward pass
    # keeps no mask for it (no residual bytes).
    valid = (labels >= 0) & (labels < logits_shape[-1])
    return (per_example + jnp.where(valid, 0.0, jnp.nan).astype(per_example.dtype)).mean()


def mean_squared_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean of ``(predictions - targets)**2`` over every element (optax.squared_error, averaged).

    Args:
      predictions: a floating array.
      targets: a floating array of the shape of `predictions`.
    Returns:
      a scalar (shape ``()``) in the squared units of the targets.
    """
    return optax.squared_error(predictions, targets).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of rows whose arg-max logit equals the label; shape ``()``, float32, in [0, 1]."""
    return (jnp.argmax(logits, axis=-1) == labels).mean(dtype=jnp.float32)
