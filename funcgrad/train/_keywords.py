"""A train step from the former ``make_train_step`` keywords, each mapped to its piece.

For the callers that still describe a step as a dict of keywords (the doctor's
``step_kwargs``, a model file's ``STEP_KWARGS``) until they take the user's step itself.
"""
from __future__ import annotations

from typing import Any

import optax

from funcgrad.train.loss import Loss, as_loss
from funcgrad.train.microbatches import accumulate as accumulate_piece
from funcgrad.train.optimizers import make_optimizer
from funcgrad.train.precision import mixed_precision
from funcgrad.train.step import TrainStep, detect_anomaly, make_train_step
from funcgrad.train.transforms import clip_by_global_norm, zero_nonfinite


def step_from_keywords(loss: Any, optimizer: Any, **keywords: Any) -> TrainStep:
    """``make_train_step(loss, optimizer, **keywords)`` with the former keywords (has_aux,
    has_state, takes_key, compute_dtype, loss_scale, accumulate, tail, detect_anomaly)
    applied as the pieces that replaced them (monitor, nonfinite="zero" and clip_norm chained
    before the optimizer, in that order); a keyword given as None (or False) adds
    nothing. A data-parallel step is not described by keywords: `funcgrad.data_parallel`."""
    kw = dict(keywords)
    flags = {k: kw.pop(k) for k in ("has_aux", "has_state", "takes_key") if k in kw}
    if any(flags.values()):
        loss = (Loss(loss, **{k: bool(v) for k, v in flags.items()})
                if not isinstance(loss, Loss) else as_loss(loss, **flags))
    dtype, scale = kw.pop("compute_dtype", None), kw.pop("loss_scale", None)
    if dtype is not None or scale is not None:
        loss = mixed_precision(loss, "float32" if dtype is None else dtype, loss_scale=scale)
    k, tail = kw.pop("accumulate", None), kw.pop("tail", None)
    if k is not None:
        loss = accumulate_piece(loss, k, **({} if tail is None else {"tail": tail}))
    anomaly = kw.pop("detect_anomaly", False)
    pieces = [p for p in (kw.pop("monitor", None),
                          zero_nonfinite() if kw.get("nonfinite") == "zero" else None,
                          clip_by_global_norm(kw["clip_norm"]) if kw.get("clip_norm") else None)
              if p is not None]
    kw.pop("clip_norm", None)
    if kw.get("nonfinite") == "zero":
        kw.pop("nonfinite")
    if pieces:
        optimizer = optax.chain(*pieces, make_optimizer(optimizer))
    step = make_train_step(loss, optimizer, **kw)  # mesh= etc.: the TypeError naming the piece
    return detect_anomaly(step) if anomaly else step
