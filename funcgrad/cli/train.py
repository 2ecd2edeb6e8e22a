"""``funcgrad train``: trains a perceptron (or, with ``--model cnn``, a small convolutional net)
on the digits set and saves its history (metrics.json, training.png, checkpoints).

This module is the command: its flags and the checks of their combinations. The run itself is
`funcgrad.cli._training`; --out and --resume's checks are `funcgrad.cli._resume`.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from funcgrad.cli._flags import _fraction, _Parser, _positive, _seed, _unit_interval
from funcgrad.cli._resume import _check_out, _resumed_settings

# The run: called by name from this module, so a test patches funcgrad.cli.train._train.
from funcgrad.cli._training import _join, _train

#: Flags that belong to one model only, with the model's default (None: the flag was not
#: given). A flag given for the other model is an error, not silently ignored.
_MLP_DEFAULTS = {"hidden": [128], "activation": "relu", "remat": None}
_CNN_DEFAULTS = {"channels": [32, 64], "dropout": 0.25}

def _remat_segments(text: str):
    if text == "sqrt":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected 'sqrt' or a positive int, got {text!r}")
    return k

def add_parser(sub: Any) -> _Parser:
    """Adds the ``train`` command and its flags to `sub` (the top-level subparsers)."""
    from funcgrad.demo.mlp import ACTIVATIONS
    from funcgrad.train.optimizers import OPTIMIZERS

    t = sub.add_parser(
        "train", help="train an MLP or a CNN on scikit-learn's digits set (the main job)",
        description="Train an MLP (64 -> hidden... -> 10), or with --model cnn a small "
                    "convolutional net with BatchNorm and dropout, on scikit-learn's bundled "
                    "digits set, print loss, global gradient norm and test accuracy per epoch "
                    "(numbered from 1), and write metrics.json and training.png into --out.")
    t.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                   help="mlp: a perceptron; cnn: conv 3x3 -> BatchNorm -> ReLU -> max-pool "
                        "blocks on the 8x8 images, dropout and a dense head, evaluated with "
                        "BatchNorm's running statistics (funcgrad.demo.cnn) (default: mlp)")
    t.add_argument("--hidden", type=_positive(int), nargs="+", default=None, metavar="N",
                   help="MLP only: hidden layer widths (default: 128)")
    t.add_argument("--activation", choices=sorted(ACTIVATIONS), default=None,
                   help="MLP only: hidden activation (default: relu)")
    t.add_argument("--remat", type=_remat_segments, default=None, metavar="SEGMENTS",
                   help="MLP only: rematerialise the layers in segments ('sqrt' or a segment "
                        "size K): the backward pass keeps each segment's input and recomputes "
                        "the rest (funcgrad.memory.remat_sequential; default: keep everything)")
    t.add_argument("--channels", type=_positive(int), nargs="+", default=None, metavar="N",
                   help="CNN only: output channels of each conv block, at most 3 blocks "
                        "(each halves the 8x8 image) (default: 32 64)")
    t.add_argument("--dropout", type=_unit_interval, default=None, metavar="RATE",
                   help="CNN only: dropout rate before the dense head (default: 0.25)")
    t.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam",
                   help="optax optimizer (default: adam)")
    t.add_argument("--lr", type=_positive(float), default=1e-3,
                   help="learning rate (default: 1e-3)")
    t.add_argument("--momentum", type=_unit_interval, default=None,
                   help="momentum coefficient, only for --optimizer momentum (default: 0.9)")
    t.add_argument("--epochs", type=_positive(int), default=30,
                   help="passes over the train split (default: 30)")
    t.add_argument("--batch-size", type=_positive(int), default=32,
                   help="examples per step (default: 32)")
    t.add_argument("--seed", type=_seed, default=0,
                   help="seed of the init, split and batch order (default: 0)")
    t.add_argument("--clip-norm", type=_positive(float), default=None,
                   help="clip gradients to this global norm (default: no clipping)")
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="compute dtype of the forward and backward pass; params, gradients and "
                        "updates stay float32 (default: float32)")
    t.add_argument("--loss-scale", choices=["none", "dynamic"], default="none",
                   help="dynamic loss scaling (funcgrad.dynamic_loss_scale defaults); skipped "
                        "steps are counted per epoch (default: none)")
    t.add_argument("--accumulate", type=_positive(int), default=1, metavar="K",
                   help="micro-batches of --batch-size per optimizer update (gradient "
                        "accumulation, exact mean over the examples; an epoch's last, partial "
                        "group is applied too) (default: 1)")
    t.add_argument("--test-size", type=_fraction, default=0.2,
                   help="held-out fraction of the 1,797 digits (default: 0.2)")
    t.add_argument("--out", default="runs/latest",
                   help="output folder (default: runs/latest). One that holds an earlier run "
                        "(what funcgrad train writes there: metrics.json, training.png or "
                        "checkpoints/) is refused before training: continue that run with "
                        "--resume DIR, pick another --out, or pass --overwrite")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run in --out: delete its metrics.json, "
                        "training.png and checkpoints/ before training (other files there are "
                        "left alone)")
    t.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="folder for what a later run can reuse: the digits split (digits/) and "
                        "JAX's compiled programs (jax/, unless JAX_COMPILATION_CACHE_DIR or "
                        "jax.config already names a JAX cache), so a later run skips "
                        "scikit-learn's import and XLA's compiling. One that cannot be written "
                        "means no cache "
                        "(default: $FUNCGRAD_CACHE_DIR, else $XDG_CACHE_HOME/funcgrad, else "
                        "~/.cache/funcgrad)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar (none either when stderr is not a terminal)")
    t.add_argument("--no-monitor", action="store_true",
                   help="no gradient monitor (by default each step also computes per-layer "
                        "gradient norms, dead-ReLU fractions and explosion/vanishing alerts, "
                        "printed as they happen and drawn in training.png)")
    t.add_argument("--detect-anomaly", action="store_true",
                   help="when a step's loss or gradient goes NaN/inf, name the primitive, the pass "
                        "(forward/backward) and the source line that produced it (one host read "
                        "per step)")
    t.add_argument("--memory-report", action="store_true",
                   help="before training, print the memory of the compiled step (XLA's "
                        "argument/output/temporary bytes, the estimated peak) and write it into "
                        "metrics.json under \"memory\" (one extra compilation)")
    t.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run saved in DIR (a previous --out folder; its "
                        "checkpoints/ subfolder) up to --epochs in all, with the same model "
                        "flags; --out defaults to DIR")
    t.add_argument("--checkpoint-every", type=_positive(int), default=None, metavar="N",
                   help="also checkpoint every N epochs (default: a checkpoint at the end, on "
                        "Ctrl-C and at a non-finite stop, in OUT/checkpoints)")
    t.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                   help="at a step whose loss, gradient or update is NaN/inf: stop with a "
                        "report (default), or skip the batch, count it and go on")
    t.add_argument("--distributed", action="store_true",
                   help="one process of a data-parallel run (under funcgrad launch -n N, or a "
                        "cluster's launcher): fg.distributed_init(), the step on a mesh of every "
                        "process's devices, each batch's rows split over them; only process 0 "
                        "prints and writes metrics.json and training.png")
    return t

def run(train_parser: _Parser, args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``funcgrad train`` with its parsed `args`: the checks of flag combinations (exit 2 through
    `train_parser`), then the run; returns the exit status."""
    if args.momentum is not None and args.optimizer != "momentum":
        train_parser.error(
            f"argument --momentum: applies to --optimizer momentum only (got --optimizer "
            f"{args.optimizer}); drop it or add --optimizer momentum")
    if args.distributed and (args.detect_anomaly or args.memory_report):
        train_parser.error(
            f"argument --distributed: not with --"
            f"{'detect-anomaly' if args.detect_anomaly else 'memory-report'} (debug on one "
            "process, without --distributed)")
    status = _reported_run(train_parser, args, argv)
    if status and args.distributed:
        _exit_now(status)
    return status

def _exit_now(status: int) -> None:
    """Ends a --distributed process that failed at once, as `funcgrad.distributed_init`'s
    `exit_on_error` does for an uncaught exception: a normal exit would wait at JAX's
    shutdown barrier for processes that may be waiting for this one in a collective."""
    import jax

    if jax.process_count() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

def _reported_run(train_parser: _Parser, args: argparse.Namespace,
                  argv: Sequence[str] | None) -> int:
    """`_checked_run`, with the errors a user can fix printed in one line (exit status 1)."""
    try:
        return _checked_run(train_parser, args, argv)
    except KeyboardInterrupt:
        print("funcgrad: interrupted", file=sys.stderr)
        return 130
    except (ImportError, OSError, ValueError, MemoryError) as e:
        print(f"funcgrad: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except Exception as e:  # e.g. XLA running out of memory for a huge --hidden
        if type(e).__name__ != "JaxRuntimeError":
            raise
        print(f"funcgrad: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1

def _checked_run(train_parser: _Parser, args: argparse.Namespace,
                 argv: Sequence[str] | None) -> int:
    """`run` after the flag checks that need nothing but the flags: --distributed joins the run,
    the checks that read the --resume checkpoint or probe XLA, --out's, then `_train`."""
    # Joining comes before anything touches JAX: reading the --resume checkpoint (orbax) and
    # the float16 probe start JAX's backend, after which jax.distributed refuses to start.
    main = _join() if args.distributed else True
    if args.resume is not None:
        if not os.path.isdir(os.path.join(args.resume, "checkpoints")):
            train_parser.error(
                f"argument --resume: {args.resume} holds no checkpoints/ folder; pass the --out "
                "folder of an earlier funcgrad train run")
        resumed = _resumed_settings(train_parser, args,
                                    list(argv if argv is not None else sys.argv[1:]))
    else:
        resumed = None
    _model_flags(train_parser, args)
    if args.dtype == "float16":
        from funcgrad._platform import dtype_compiles
        if not dtype_compiles("float16"):  # F16C missing: every float16 step would fail in XLA
            train_parser.error(
                "argument --dtype: XLA on this CPU cannot compile float16 (no F16C instructions, "
                "openxla/xla#6787); use --dtype bfloat16, or a machine with F16C or a GPU")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        train_parser.error(f"argument --out: {args.out} exists and is not a folder; "
                           "pass a folder path (it is created if missing)")
    _check_out(train_parser, args, delete=main)
    return _train(args, resumed)

def _model_flags(train_parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses a flag of the other model's, fills in the chosen model's defaults, and drops
    the other model's flags from `args` (so metrics.json's config lists what was used)."""
    own, other = ((_MLP_DEFAULTS, _CNN_DEFAULTS) if args.model == "mlp"
                  else (_CNN_DEFAULTS, _MLP_DEFAULTS))
    for name in other:
        if getattr(args, name) is not None:
            flag = "--" + name
            train_parser.error(
                f"argument {flag}: applies to --model {'cnn' if args.model == 'mlp' else 'mlp'} "
                f"only (got --model {args.model}); drop it"
                + (" or add --model cnn" if args.model == "mlp" else
                   " (the cnn's widths are set by --channels; its activation is ReLU)"
                   if name in ("hidden", "activation") else ""))
        delattr(args, name)
    for name, default in own.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    layers = len(args.hidden) + 1 if args.model == "mlp" else 0
    if args.model == "mlp" and isinstance(args.remat, int) and args.remat > layers:
        train_parser.error(f"argument --remat: a segment of {args.remat} layers does not fit the "
                           f"MLP's {layers} layers; pass at most {layers}, or sqrt")
    if args.model == "cnn" and len(args.channels) > 3:
        train_parser.error(f"argument --channels: each block halves the 8x8 image, so at most "
                           f"3 blocks; got {len(args.channels)}")
