"""The two models ``funcgrad train`` trains, as `_train` needs them: the MLP and the CNN."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple


class _Model(NamedTuple):
    """What `_train` needs of a model: its line in the header, its loss (a plain function or a
    `funcgrad.Loss`),
    initial params, the keyword arguments of ``step.init`` that give its model state and
    key, ``test_accuracy(params[, model_state])`` (jitted, shape () float32) and the entries
    that describe its shape in metrics.json."""
    description: str
    loss: Any
    params: Any
    state_kwargs: dict
    test_accuracy: Callable
    shape: dict

def _mlp(args: argparse.Namespace, data, accumulate: int | None) -> _Model:
    import functools

    import jax
    import jax.numpy as jnp
    import optax

    from funcgrad.demo.mlp import accuracy, mlp_apply, mlp_init, softmax_cross_entropy

    sizes = (data.x_train.shape[1], *args.hidden, data.num_classes)
    # One compiled program for the whole init, not one per eager op (15 compilations).
    params = jax.jit(functools.partial(mlp_init, sizes=sizes, activation=args.activation))(
        jax.random.key(args.seed))
    remat = args.remat

    def loss_fn(params, batch):
        logits = mlp_apply(params, batch["x"], activation=args.activation, remat=remat)
        # The loss in float32 whatever the compute dtype, as PyTorch's autocast does.
        if accumulate:  # one loss per example: the step takes the exact mean over each group
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                   batch["y"])
        return softmax_cross_entropy(logits.astype(jnp.float32), batch["y"])

    @jax.jit
    def test_accuracy(params):
        return accuracy(mlp_apply(params, data.x_test, activation=args.activation), data.y_test)

    description = f"MLP {' -> '.join(map(str, sizes))} ({args.activation})"
    if remat is not None:
        from funcgrad.memory.checkpointing import segment_sizes
        segments = segment_sizes(len(sizes) - 1, remat)
        description += (f", remat segments {list(segments)} (the last kept)" if len(segments) > 1
                        else f", --remat {remat}: one segment of {len(sizes) - 1} layers, which "
                             "is kept: no remat (more layers, or a smaller K)")
    return _Model(description, loss_fn,
                  params, {}, test_accuracy, {"sizes": list(sizes)})

def _cnn(args: argparse.Namespace, data, accumulate: int | None) -> _Model:
    import functools

    import jax

    from funcgrad.demo.cnn import cnn_apply, cnn_init, cnn_loss
    from funcgrad.demo.mlp import accuracy
    from funcgrad.train.loss import Loss

    # One key for the init, one for dropout: step s draws fold_in(dropout_key, s).
    init_key, dropout_key = jax.random.split(jax.random.key(args.seed))
    params, model_state = cnn_init(init_key, channels=args.channels,
                                   num_classes=data.num_classes)
    loss = Loss(functools.partial(cnn_loss, dropout_rate=args.dropout,
                                  per_example=accumulate is not None),
                has_state=True, takes_key=True)

    @jax.jit
    def test_accuracy(params, model_state):  # BatchNorm with its running statistics
        logits, _ = cnn_apply(params, model_state, data.x_test, train=False)
        return accuracy(logits, data.y_test)

    blocks = " -> ".join(f"conv {c}" for c in args.channels)
    return _Model(f"CNN 8x8x1 -> {blocks} -> {data.num_classes} (3x3 conv, BatchNorm, ReLU, "
                  f"2x2 max-pool; dropout {args.dropout:g})", loss, params,
                  {"model_state": model_state, "key": dropout_key}, test_accuracy,
                  {"channels": list(args.channels)})
