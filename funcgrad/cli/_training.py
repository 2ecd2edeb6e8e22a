"""The run of ``funcgrad train``: the data, the model, the step and `fit`, then metrics.json,
the plot and the last lines printed (`_train`)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any

from funcgrad.cli._clock import _Clock

# The models: called by name from this module, so a test patches funcgrad.cli._training._mlp.
from funcgrad.cli._models import _cnn, _mlp
from funcgrad.cli._plot import _plot
from funcgrad.cli._resume import _check_resumable
from funcgrad.cli._run import _strict_json, _use_caches


def _train(args: argparse.Namespace, resumed: tuple[int, dict] | None = None) -> int:
    """The run `args` asks for (main has checked its flags); `resumed`: the (step, metadata)
    of the --resume checkpoint, checked against the state these flags build. The exit status.
    """
    import jax.numpy as jnp

    from funcgrad.train.batching import Batches
    from funcgrad.train.coupling import CoupledExamplesWarning
    from funcgrad.train.data import load_digits
    from funcgrad.train.loop import FitOptions, Progress, fit
    from funcgrad.train.optimizers import make_optimizer
    from funcgrad.train.precision import dynamic_loss_scale
    from funcgrad.train.transforms import grad_monitor

    clock = _Clock()
    mesh, main = _distributed() if args.distributed else (None, True)
    _prefetch_modules()
    os.makedirs(args.out, exist_ok=True)
    cache = _use_caches(args.cache_dir)
    data = load_digits(test_size=args.test_size, seed=args.seed,
                       cache_dir=cache and os.path.join(cache, "digits"))
    clock.lap("data")
    tx = make_optimizer(args.optimizer, args.lr,
                        momentum=0.9 if args.momentum is None else args.momentum)

    compute_dtype = None if args.dtype == "float32" else jnp.dtype(args.dtype)
    loss_scale = dynamic_loss_scale() if args.loss_scale == "dynamic" else None
    accumulate = args.accumulate if args.accumulate > 1 else None
    monitor = None if args.no_monitor else grad_monitor()
    if loss_scale is not None and compute_dtype is None:
        print("funcgrad: error: argument --loss-scale: dynamic loss scaling keeps small "
              "float16/bfloat16 gradients from flushing to zero and changes nothing in "
              "float32; pass --dtype float16 (or bfloat16) with it", file=sys.stderr)
        return 2
    if args.dtype == "float16" and loss_scale is None:
        print("funcgrad: note: float16 without --loss-scale dynamic: small gradients may "
              "underflow to zero", file=sys.stderr)

    model = (_mlp(args, data, accumulate) if args.model == "mlp"
             else _cnn(args, data, accumulate))
    if mesh is not None and args.batch_size % mesh.size:
        print(f"funcgrad: error: argument --batch-size: {args.batch_size} rows do not divide "
              f"among the {mesh.size} devices of the run; pass a multiple of {mesh.size}",
              file=sys.stderr)
        return 2
    say = print if main else _quiet

    say(f"funcgrad train: {model.description}, {args.optimizer} lr={args.lr:g}, "
          f"{len(data.x_train)} train / {len(data.x_test)} test "
          f"digits, {args.epochs} epochs of batch {args.batch_size}"
          + (f", clip_norm={args.clip_norm:g}" if args.clip_norm else "")
          + (f", compute {args.dtype}" if compute_dtype is not None else "")
          + (", dynamic loss scale" if loss_scale is not None else "")
          + (f", {accumulate} micro-batches per update (effective batch "
             f"{min(accumulate * args.batch_size, len(data.x_train))})" if accumulate else "")
          + (f", data-parallel over {mesh.size} devices of {_process_count()} processes"
             if mesh is not None else ""),
          flush=True)
    if accumulate and accumulate * args.batch_size > len(data.x_train):
        micro = math.ceil(len(data.x_train) / args.batch_size)
        print(f"funcgrad: note: --accumulate {accumulate} x --batch-size {args.batch_size} = "
              f"{accumulate * args.batch_size} examples per update exceeds the "
              f"{len(data.x_train)} train digits: each epoch is one update over all of them "
              f"({micro} micro-batches). Use --accumulate {max(1, micro // 2)} or less for more "
              "than one update per epoch.", file=sys.stderr)
    if accumulate and args.model == "cnn":
        print(f"funcgrad: note: with --accumulate each micro-batch of {args.batch_size} "
              "normalises with its own BatchNorm statistics (ghost batch norm): the update "
              "averages their gradients, which is not the gradient of one batch of "
              f"{accumulate * args.batch_size}", file=sys.stderr)
    with warnings.catch_warnings():  # the report is printed once, below, not also as a warning
        warnings.filterwarnings("ignore", "non-finite value", RuntimeWarning)
        warnings.filterwarnings("ignore", "fit: accumulate=", UserWarning)  # the note above
        warnings.filterwarnings("ignore", category=CoupledExamplesWarning)  # the note above
        step = _step(args, model.loss, tx, compute_dtype, loss_scale, accumulate, monitor,
                     mesh)
        state = step.init(model.params, **model.state_kwargs)
        if resumed is not None:
            _check_resumable(args, state, resumed)
        memory = _memory_report(step, state, data, args.batch_size, accumulate) \
            if args.memory_report else None
        clock.lap("setup")
        result = _fit_keeping_everything(
            fit, args, step, state,
            Batches(data.x_train, data.y_train, batch_size=args.batch_size, seed=args.seed),
            main=main, every=args.checkpoint_every or args.epochs, epochs=args.epochs,
            evaluate=lambda *p: {"test_accuracy": model.test_accuracy(*p)},
            progress=Progress(print if main else None,
                              bar=main and not args.no_progress and sys.stderr.isatty()),
            options=FitOptions(on_nonfinite=args.on_nonfinite))
    clock.lap("train")
    history = result.history
    metrics_path = os.path.join(args.out, "metrics.json")
    final = float(model.test_accuracy(  # the last finite state if stopped early
        result.state.params, *(() if result.state.model_state is None
                               else (result.state.model_state,))))
    if not main:  # process 0 writes and reports the run (every process holds the same)
        return 130 if result.interrupted else 1 if result.nonfinite is not None else 0
    with open(metrics_path, "w") as f:
        json.dump(_strict_json({
            "config": {k: v for k, v in vars(args).items() if k != "command"},
            **model.shape, **history.to_dict(),
            "nonfinite": result.nonfinite.to_dict() if result.nonfinite else None,
            **({"memory": memory} if memory is not None else {})}), f, indent=1)
    clock.lap("setup")
    plot_path = _plot(history, os.path.join(args.out, "training.png"))
    clock.lap("plot")
    if loss_scale is not None:
        print(f"loss scale {float(result.state.loss_scale.scale):g}, "
              f"{len(history.skipped_steps)} steps skipped")
    if monitor is not None:
        print(f"gradient monitor: {len(history.alerts)} alert(s)")
    print(f"final test accuracy {final:.4f}; wrote {metrics_path} and {plot_path} "
          f"({clock.summary()})")
    if history.skipped_batches:
        print(f"{len(history.skipped_batches)} non-finite batch(es) skipped (listed in "
              "metrics.json under skipped_batches)")
    if result.interrupted:
        print(f"funcgrad: interrupted after step {int(result.state.step)}; kept "
              f"{metrics_path}, {plot_path} and a checkpoint in "
              f"{os.path.join(args.out, 'checkpoints')} (continue with --resume {args.out})",
              file=sys.stderr)
        return 130
    if result.nonfinite is not None:
        print(f"funcgrad: error: {result.nonfinite}", file=sys.stderr)
        return 1
    return 0

def _join() -> bool:
    """``--distributed``: joins the run (`funcgrad.distributed_init`) unless this process has
    joined already; whether this is process 0. It must come before anything starts JAX's
    backend (a computation, orbax reading a checkpoint, ``jax.devices()``)."""
    import jax

    from funcgrad.parallel.distributed import distributed_init

    if not jax.distributed.is_initialized():
        distributed_init()
    return jax.process_index() == 0

def _distributed():
    """``--distributed``: joins the run (`_join`, before any computation) and returns its mesh
    over every process's devices and whether this is process 0."""
    from funcgrad.parallel.placement import data_mesh

    main = _join()
    return data_mesh(), main

def _process_count() -> int:
    import jax
    return jax.process_count()

def _quiet(*args: Any, **kwargs: Any) -> None:
    """`print` on the processes other than 0 of a --distributed run."""

def _fit_keeping_everything(fit, args, step, state, data, *, main: bool = True, every: int,
                            **kwargs):
    """`fit` with checkpoints in OUT/checkpoints every `every` epochs (resumed from --resume
    DIR); a crash inside it still writes metrics.json with the history so far before the
    error propagates.

    In a --distributed run only process 0 (`main`) writes: the copy of --resume DIR's
    checkpoints into another --out (every process waits for it before reading them) and
    the crash's metrics.json. Orbax writes the checkpoints, coordinating the processes."""
    checkpoints = os.path.join(args.out, "checkpoints")
    if args.resume is not None and os.path.realpath(args.resume) != os.path.realpath(args.out):
        import shutil
        # main's _check_out refused an --out holding an earlier run (or --overwrite cleared it)
        if main:
            shutil.copytree(os.path.join(args.resume, "checkpoints"), checkpoints)
        if args.distributed:
            from jax.experimental.multihost_utils import sync_global_devices
            sync_global_devices("funcgrad train: the --resume checkpoints are copied")
    try:
        from funcgrad.train.loop import Checkpointing
        return fit(step, state, data, **kwargs, checkpoint=Checkpointing(
            checkpoints, every=every, resume=args.resume is not None))
    except Exception as error:
        partial = getattr(error, "fit_result", None)
        if partial is not None and main:
            with open(os.path.join(args.out, "metrics.json"), "w") as f:
                json.dump(_strict_json({
                    "config": {k: v for k, v in vars(args).items() if k != "command"},
                    **partial.history.to_dict(), "error": f"{type(error).__name__}: {error}"}),
                    f, indent=1)
            error.add_note(f"funcgrad train: the history so far is in "
                           f"{os.path.join(args.out, 'metrics.json')}")
        raise

def _memory_report(step, state, data, batch_size: int, accumulate: int | None) -> dict:
    """Prints `funcgrad.memory_report` of the compiled step on one batch of the run's shape
    (stacked micro-batches with --accumulate) and returns its dict for metrics.json."""
    from funcgrad.memory.report import memory_report
    from funcgrad.train.microbatches import stack_microbatches

    n = min(batch_size, len(data.x_train))
    one = {"x": data.x_train[:n], "y": data.y_train[:n]}
    report = memory_report(step, state, stack_microbatches([one] * accumulate)
                           if accumulate else one)
    print(report, flush=True)
    return report.to_dict()

def _step(args: Any, loss: Any, tx: Any, compute_dtype: Any, loss_scale: Any,
          accumulate: int | None, monitor: Any, mesh: Any) -> Any:
    """The run's `TrainStep`, built from its pieces as the flags ask."""
    from funcgrad.train.microbatches import accumulate as accumulating
    from funcgrad.train.precision import mixed_precision
    from funcgrad.train.step import detect_anomaly, make_train_step

    if compute_dtype is not None:
        loss = mixed_precision(loss, compute_dtype, loss_scale=loss_scale)
    if accumulate is not None:
        loss = accumulating(loss, accumulate)
    import optax

    from funcgrad.train.transforms import clip_by_global_norm

    pieces = [monitor] if monitor is not None else []  # the monitor first: the raw gradient
    if args.clip_norm:
        pieces.append(clip_by_global_norm(args.clip_norm))
    step = make_train_step(loss, optax.chain(*pieces, tx) if pieces else tx)
    if args.detect_anomaly:
        step = detect_anomaly(step)
    if mesh is not None:
        from funcgrad.parallel.step import data_parallel
        step = data_parallel(step, mesh)
    return step


def _prefetch_modules() -> None:
    """Imports what the run needs only at its end (the plot's matplotlib, orbax for the
    checkpoint) in a background thread: it runs while the main thread waits on XLA (compiling,
    training), which releases the GIL, instead of after training (0.4-0.6 s of the command).
    A failed import is left for the main thread to meet and report."""
    import threading

    def load():
        import importlib

        from funcgrad.train.checkpoint import silence_orbax_deprecations
        silence_orbax_deprecations()  # not the user's to fix (funcgrad.train.checkpoint._orbax)
        for name in ("matplotlib.figure", "matplotlib.backends.backend_agg",
                     "matplotlib.ticker", "orbax.checkpoint"):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - reported where it is used
                pass

    threading.Thread(target=load, name="funcgrad-prefetch", daemon=True).start()
