"""A small convolutional net with BatchNorm and dropout, written as pure JAX functions.

The model of ``funcgrad train --model cnn``: blocks of ``conv 3x3 -> BatchNorm -> ReLU ->
max-pool 2x2`` on 8x8 grey images (the digits set, NHWC), then inverted dropout and a dense
head. No flax is needed: the convolution is ``jax.lax.conv_general_dilated``, BatchNorm and
dropout are functions below, and what a framework keeps in a module lives in two pytrees:

  params       what is differentiated: ``{"conv0": {"w"}, "bn0": {"scale", "bias"}, ...,
               "dense": {"w", "b"}}`` (leaf paths read ``params['bn0']['scale']``);
  model_state  what is not: each BatchNorm's running statistics, ``{"bn0": {"mean", "var"},
               ...}``, updated in training and used at evaluation time.

The loss `cnn_loss` follows funcgrad's loss contract with model state and a key
(`funcgrad.train.loss`; docs/guide/train.md, "Models with state, randomness and aux outputs"):
``loss(params, batch, *, model_state, key) -> (loss, new_model_state)``.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any

#: Defaults of `cnn_apply` / `cnn_loss`: flax.linen.BatchNorm's momentum and epsilon, and the
#: dropout rate before the dense head.
MOMENTUM = 0.99
EPSILON = 1e-5
DROPOUT_RATE = 0.25

_CONV_DIMS = ("NHWC", "HWIO", "NHWC")  # flax's layout: channels last, kernels (h, w, in, out)


def cnn_init(key: jax.Array, *, channels: Sequence[int] = (32, 64), num_classes: int = 10,
             image_shape: tuple[int, int] = (8, 8), dtype: Any = jnp.float32
             ) -> tuple[PyTree, PyTree]:
    """Returns ``(params, model_state)`` of a CNN with one conv block per entry of `channels`.

    Block ``i`` is a 3x3 convolution (stride 1, SAME padding, no bias: the BatchNorm's shift
    that follows makes one redundant) from the previous block's channels (1 for the grey
    input) to ``channels[i]``, BatchNorm, ReLU and a 2x2 max-pool (stride 2), which halves the
    height and width. The dense head maps the flattened last block to `num_classes` logits.

    Init: convolution kernels normal with variance ``2 / fan_in``, fan-in ``3*3*in`` (He et al.
    2015, arXiv:1502.01852, eq. 10; torch.nn.init.kaiming_normal_), the dense head normal with
    variance ``1 / fan_in`` (LeCun normal: it feeds a softmax, not a ReLU), BatchNorm scale 1
    and bias 0,
    running mean 0 and variance 1 (as flax.linen.BatchNorm and torch.nn.BatchNorm2d).

    Args:
      key: a JAX PRNG key (``jax.random.key(seed)``).
      channels: output channels of each block, positive ints; each block halves the image, so
        at most ``log2(min(image_shape))`` blocks (3 for 8x8).
      num_classes: number of logits.
      image_shape: ``(height, width)`` of the input images, in pixels.
      dtype: floating dtype of every leaf of params and model_state.
    Returns:
      params: ``{"conv{i}": {"w": (3, 3, in_i, channels[i])}, "bn{i}": {"scale":
        (channels[i],), "bias": (channels[i],)}, "dense": {"w": (features, num_classes),
        "b": (num_classes,)}}`` with ``features = channels[-1] * (h / 2**blocks) * (w /
        2**blocks)`` (integer division).
      model_state: ``{"bn{i}": {"mean": (channels[i],), "var": (channels[i],)}}``.
    Raises:
      TypeError: if `key` is an int, not a PRNG key.
      ValueError: if `channels` is empty or holds a non-positive entry, or has more blocks
        than the image can be halved.
    """
    if isinstance(key, (int, np.integer)):
        raise TypeError(f"cnn_init: key must be a JAX PRNG key, got the int {key!r}. Make one "
                        f"from the seed: cnn_init(jax.random.key({int(key)})).")
    channels = tuple(channels)
    if not channels or not all(isinstance(c, (int, np.integer)) and c > 0 for c in channels):
        raise ValueError(f"cnn_init: channels must be one or more positive ints, got "
                         f"{channels!r}. Example: cnn_init(key, channels=(32, 64)).")
    height, width = image_shape
    if min(height, width) >> len(channels) < 1:
        raise ValueError(f"cnn_init: {len(channels)} blocks each halve the image, but a "
                         f"{height}x{width} image can be halved only "
                         f"{int(np.log2(min(height, width)))} times; pass fewer channels.")
    return _init(key, channels, num_classes, (height, width), jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _init(key, channels, num_classes, image_shape, dtype):
    """The arrays of `cnn_init`, made in one compiled program (eagerly, each initializer
    compiles on its own: seconds on a busy CPU)."""
    height, width = image_shape
    keys = jax.random.split(key, len(channels) + 1)
    params, model_state, fan_in = {}, {}, 1
    for i, (k, c) in enumerate(zip(keys, channels)):
        params[f"conv{i}"] = {"w": _normal(k, (3, 3, fan_in, c), 2.0 / (9 * fan_in), dtype)}
        params[f"bn{i}"] = {"scale": jnp.ones((c,), dtype), "bias": jnp.zeros((c,), dtype)}
        model_state[f"bn{i}"] = {"mean": jnp.zeros((c,), dtype), "var": jnp.ones((c,), dtype)}
        fan_in = c
    features = channels[-1] * (height >> len(channels)) * (width >> len(channels))
    params["dense"] = {
        "w": _normal(keys[-1], (features, num_classes), 1.0 / features, dtype),
        "b": jnp.zeros((num_classes,), dtype)}
    return params, model_state


def _normal(key, shape, variance, dtype):
    """Normal(0, variance) draws of `shape`. Drawn flat and reshaped: XLA:CPU compiled the same
    draw made in its 2-D or 4-D shape up to 15x slower (3-8 s against 0.5 s, measured with jax
    0.10.2 for (256, 10) and (3, 3, 4, 8); jax.nn.initializers draw in the leaf's shape), and
    the CLI pays that compile on every run."""
    return (jax.random.normal(key, (math.prod(shape),), dtype)
            * jnp.sqrt(jnp.asarray(variance, dtype))).reshape(shape)


def batch_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, stats: dict[str, jax.Array],
               *, train: bool, momentum: float = MOMENTUM, epsilon: float = EPSILON
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """BatchNorm over every axis but the last (channels), as a pure function.

    ``y = (x - mean) / sqrt(var + epsilon) * scale + bias`` (Ioffe & Szegedy 2015,
    arXiv:1502.03167, Algorithm 1), with ``mean`` and ``var`` per channel:

      train=True   the batch's own statistics (over batch, height and width), ``var`` the
                   biased (1/n) variance; the running statistics move towards them:
                   ``running = momentum * running + (1 - momentum) * batch_stat``, for the
                   mean and for the biased variance. This is flax.linen.BatchNorm's convention
                   (its ``momentum`` default 0.99; flax/linen/normalization.py,
                   ``ra_mean.value = momentum * ra_mean.value + (1 - momentum) * mean``).
                   PyTorch's ``momentum`` is the complement (torch 0.1 == flax 0.9) and its
                   running variance is the unbiased ``n/(n-1)`` one; this function follows flax.
      train=False  the running statistics in `stats`, returned unchanged.

    The statistics are computed in float32 for float16/bfloat16 inputs (as flax does with
    ``force_float32_reductions``), and the new running statistics keep the dtype of `stats`.

    Args:
      x: ``(..., channels)``, floating.
      scale, bias: ``(channels,)``, the learned affine map (gamma and beta).
      stats: ``{"mean": (channels,), "var": (channels,)}``, the running statistics.
      train: use and update the batch statistics (True) or use the running ones (False).
      momentum: in [0, 1], dimensionless; the weight of the old running value.
      epsilon: added to the variance, > 0, in the squared units of `x`.
    Returns:
      ``(y, new_stats)``: y of the shape and dtype of `x`; new_stats of the structure, shapes
      and dtypes of `stats`.
    """
    axes = tuple(range(x.ndim - 1))
    if train:
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean = jnp.mean(x32, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=axes)
        mean = mean.reshape(var.shape)
        # In the running statistics' dtype (float64 activations of a float32 state, as in a
        # float64 gradient check, would otherwise mix dtypes).
        new_stats = {
            name: momentum * stats[name] + (1 - momentum) * batch.astype(stats[name].dtype)
            for name, batch in (("mean", mean), ("var", var))}
    else:
        mean, var, new_stats = stats["mean"], stats["var"], stats
    # One multiply-add per element, in x's dtype: y = x * mul + add.
    mul = scale.astype(mean.dtype) * jax.lax.rsqrt(var + epsilon)
    add = bias.astype(mean.dtype) - mean * mul
    per_channel = (1,) * (x.ndim - 1) + (-1,)  # explicit broadcast over (..., channels)
    return (x * mul.astype(x.dtype).reshape(per_channel)
            + add.astype(x.dtype).reshape(per_channel)), new_stats


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout: zero each element with probability `rate`, scale the rest by 1/(1-rate).

    The mask is ``jax.random.bernoulli(key, 1 - rate, x.shape)`` (True: kept), so the same key
    gives the same mask and the expected output equals `x` (Srivastava et al. 2014, JMLR 15;
    the scaling at training time, not at test time, as flax.linen.Dropout and
    torch.nn.Dropout do). ``rate == 0`` returns `x` and needs no key.

    Args:
      x: any shape, floating.
      rate: the probability of dropping, in [0, 1).
      key: a JAX PRNG key; required when ``rate > 0``.
    Returns:
      an array of the shape and dtype of `x`.
    Raises:
      ValueError: if `rate` is outside [0, 1), or `key` is None while ``rate > 0``.
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout: rate must be in [0, 1), got {rate!r}.")
    if rate == 0.0:
        return x
    if key is None:
        raise ValueError(
            f"dropout: training with dropout rate {rate} needs a PRNG key, got key=None. Pass "
            "key=jax.random.key(seed) (a fresh one every step: funcgrad's train step gives the "
            "loss one when made with takes_key=True), or train=False for evaluation.")
    keep = 1.0 - rate
    mask = jax.random.bernoulli(key, keep, x.shape)
    return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))


def _images(x: jax.Array, params: PyTree) -> jax.Array:
    """(n, h*w), (n, h, w) or (n, h, w, 1) -> (n, h, w, 1), checked against the params."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"cnn_apply: x must be floating images, got dtype {x.dtype}.")
    if x.ndim == 2:
        side = int(round(np.sqrt(x.shape[1])))
        if side * side != x.shape[1]:
            raise ValueError(f"cnn_apply: x of shape {x.shape} has {x.shape[1]} features, not "
                             "a square image; pass images of shape (n, height, width).")
        x = x.reshape(x.shape[0], side, side)
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] != params["conv0"]["w"].shape[2]:
        raise ValueError(
            f"cnn_apply: x must be grey images (n, height, width), (n, height * width) or "
            f"(n, height, width, {params['conv0']['w'].shape[2]}), got shape {x.shape}.")
    return x


def _blocks(params: PyTree) -> int:
    if not isinstance(params, dict) or "conv0" not in params or "dense" not in params:
        raise ValueError("cnn_apply: params must be the dict from cnn_init ('conv0', 'bn0', "
                         f"..., 'dense'), got {type(params).__name__} "
                         f"{sorted(params) if isinstance(params, dict) else ''}.")
    n = 0
    while f"conv{n}" in params:
        n += 1
    return n


def cnn_apply(params: PyTree, model_state: PyTree, x: jax.Array, *, train: bool,
              key: jax.Array | None = None, dropout_rate: float = DROPOUT_RATE,
              momentum: float = MOMENTUM, epsilon: float = EPSILON
              ) -> tuple[jax.Array, PyTree]:
    """Returns ``(logits, new_model_state)`` of the CNN made by `cnn_init`.

    Each block: ``conv 3x3 (SAME) -> batch_norm -> relu -> max-pool 2x2 (stride 2)``; then the
    flattened features (row-major over height, width, channels, as ``reshape(n, -1)`` of NHWC)
    go through `dropout` (training only) and the dense head. Training uses each BatchNorm's
    batch statistics and returns the updated running statistics; evaluation uses the running
    statistics and returns `model_state` unchanged (see `batch_norm`).

    Args:
      params: as returned by `cnn_init`.
      model_state: as returned by `cnn_init`.
      x: images ``(n, 8, 8)``, flattened images ``(n, 64)`` (the rows of
        `funcgrad.train.data.load_digits`) or ``(n, 8, 8, 1)`` (NHWC), floating. The compute dtype
        is that of `x` and `params` combined (float16 params and x compute in float16; the
        BatchNorm statistics in float32).
      train: True for a training step (batch statistics, dropout), False for evaluation.
      key: a PRNG key for the dropout mask; required when ``train`` and ``dropout_rate > 0``.
        It is used as is (one dropout site), so the same key gives the same mask.
      dropout_rate: the probability of dropping each feature before the dense head, [0, 1).
      momentum: of every BatchNorm (flax's convention; see `batch_norm`).
      epsilon: of every BatchNorm (flax's convention; see `batch_norm`).
    Returns:
      logits ``(n, num_classes)`` in the compute dtype, and the new model state (same
      structure, shapes and dtypes as `model_state`).
    Raises:
      ValueError: if `x` has the wrong shape for the params, params are not from `cnn_init`,
        or a key is missing for dropout (see `dropout`).
      TypeError: if `x` is not floating.
    """
    blocks = _blocks(params)
    h = _images(x, params)
    new_state = {}
    for i in range(blocks):
        w = params[f"conv{i}"]["w"]
        h = jax.lax.conv_general_dilated(h, w.astype(h.dtype), window_strides=(1, 1),
                                         padding="SAME", dimension_numbers=_CONV_DIMS)
        bn = params[f"bn{i}"]
        h, new_state[f"bn{i}"] = batch_norm(h, bn["scale"], bn["bias"], model_state[f"bn{i}"],
                                            train=train, momentum=momentum, epsilon=epsilon)
        h = jax.nn.relu(h)
        # A Python -inf init and lax.max make this reduce_window_max, which has a VJP.
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = h.reshape(h.shape[0], -1)
    if train:
        h = dropout(h, dropout_rate, key)
    dense = params["dense"]
    logits = h @ dense["w"].astype(h.dtype) + dense["b"].astype(h.dtype)[None, :]
    return logits, new_state


def cnn_loss(params: PyTree, batch: dict[str, jax.Array], *, model_state: PyTree,
             key: jax.Array | None, dropout_rate: float = DROPOUT_RATE,
             per_example: bool = False) -> tuple[jax.Array, PyTree]:
    """Softmax cross-entropy of a training forward pass, under funcgrad's loss contract.

    ``loss(params, batch, *, model_state, key) -> (loss, new_model_state)``: declare it with
    ``has_state=True, takes_key=True`` (``funcgrad.make_train_step(cnn_loss, optimizer,
    has_state=True, takes_key=True)``). For the analysis tools bind the state and key:
    ``funcgrad.Loss(cnn_loss, has_state=True, takes_key=True).bind(model_state=ms, key=k)``
    is ``f(params, batch) -> loss``.

    Args:
      params: as returned by `cnn_init`.
      model_state: as returned by `cnn_init`.
      batch: ``{"x": images as for `cnn_apply`, "y": (n,) int class labels}``.
      key: the dropout key of this step (None only with ``dropout_rate == 0``).
      dropout_rate: as for `cnn_apply`; bind another one with ``functools.partial``.
      per_example: return the ``(n,)`` losses instead of their mean (what the train step's
        ``accumulate=K`` takes).
    Returns:
      ``(loss, new_model_state)``: loss of shape ``()`` (or ``(n,)``), float32 whatever the
      compute dtype (as PyTorch's autocast computes losses), in nats.
    """
    logits, new_state = cnn_apply(params, model_state, batch["x"], train=True, key=key,
                                  dropout_rate=dropout_rate)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                             batch["y"])
    return (losses if per_example else losses.mean()), new_state
