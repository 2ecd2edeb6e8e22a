"""The 1x gradient inside ``shard_map`` or ``pmap``, where habits give 1x, Nx or N²x.

Inside a mapped function each device sees its own rows, and how a gradient with respect to
the replicated params comes back depends on the mapping: under ``shard_map`` (which tracks
which values vary over the axis) the cotangent of a replicated input is summed over the
devices for you; under ``pmap`` it is not. So ``jax.grad`` of the local mean followed by a
``pmean`` is right under ``pmap`` (with equal counts) and N times too large under
``shard_map``; followed by a ``psum`` it is N and N² times too large; the gradient of a
``psum``-ed global loss is right under ``shard_map`` and, under ``pmap``, N times each
device's own share (measured on 2 processes: docs/guide/distributed.md).
`data_parallel_value_and_grad` does not depend on the mapping: it differentiates each
device's *sum* with respect to a per-device copy of the params (marked varying over the axis,
so nothing is summed implicitly), sums the partial gradients with one ``psum`` and divides by
the global count. The mean is then over every real row of the global batch, never a mean of
per-device means.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def data_parallel_value_and_grad(sum_and_count: Callable, axis_name: str) -> Callable:
    """Returns ``f(params, shard) -> (mean_loss, grads)`` for use inside ``shard_map`` or
    ``pmap`` over `axis_name`: the mean loss over the global batch's real rows and its
    gradient, the same on every device and equal to the one-device gradient of that mean.

    Args:
      sum_and_count: ``(params, shard) -> (loss_sum, count)``: this device's sum of per-row
        (or per-token) losses, shape (), and how many rows (tokens) it summed, shape () (a
        masked loss: ``(jnp.sum(mask * l), jnp.sum(mask))``). Devices may hold different
        counts; a device with none contributes 0.
      axis_name: the mapped axis (``shard_map``'s mesh axis, ``pmap``'s ``axis_name``).
    Returns:
      ``f(params, shard) -> (loss, grads)``: ``loss = psum(sum) / psum(count)`` (shape (),
      float) and ``grads`` with the params' structure, shapes and dtypes; both replicated.
      The partial gradients are summed by one ``psum`` of the whole pytree (one fused
      all-reduce), the count by one more of a scalar.
    Raises:
      NameError: (from JAX) `axis_name` is not a mapped axis where `f` is called.
    """
    def value_and_grad(params: Any, shard: Any) -> tuple[jax.Array, Any]:
        # A per-device copy: its cotangent stays on the device (no implicit sum under
        # shard_map; pcast is a no-op under pmap, which sums nothing anyway).
        local = jax.tree.map(lambda p: jax.lax.pcast(p, axis_name, to="varying"), params)
        (total, count), grads = jax.value_and_grad(sum_and_count, has_aux=True)(local, shard)
        total, count, grads = jax.lax.psum((total, jnp.asarray(count, jnp.float32), grads),
                                           axis_name)
        scale = 1.0 / count
        return total * scale, jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)

    return value_and_grad


def device_key(key: jax.Array, axis_name: str) -> jax.Array:
    """``fold_in(key, axis_index(axis_name))``: a different PRNG key on each device of a
    ``shard_map``/``pmap``, the same on every rerun (dropout masks that differ across devices
    and repeat). Not needed by ``funcgrad.data_parallel(step, mesh)``, whose loss draws for
    the global batch: each device computes its own rows' part of the same mask as on one device."""
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))
