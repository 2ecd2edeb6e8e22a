"""``funcgrad train``: trains a perceptron (or, with ``--model cnn``, a small convolutional net)
on the digits set and saves its history (metrics.json, training.png, checkpoints)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from funcgrad.cli._flags import _fraction, _Parser, _positive, _seed, _unit_interval
from funcgrad.cli._run import _strict_json, _use_caches

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
    from funcgrad.train.nn import ACTIVATIONS
    from funcgrad.train.step import OPTIMIZERS

    t = sub.add_parser(
        "train", help="train an MLP or a CNN on scikit-learn's digits set (the main job)",
        description="Train an MLP (64 -> hidden... -> 10), or with --model cnn a small "
                    "convolutional net with BatchNorm and dropout, on scikit-learn's bundled "
                    "digits set, print loss, global gradient norm and test accuracy per epoch "
                    "(numbered from 1), and write metrics.json and training.png into --out.")
    t.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                   help="mlp: a perceptron; cnn: conv 3x3 -> BatchNorm -> ReLU -> max-pool "
                        "blocks on the 8x8 images, dropout and a dense head, evaluated with "
                        "BatchNorm's running statistics (funcgrad.train.convnet) (default: mlp)")
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
    from funcgrad import cli  # the package's names (_train, _mlp, _cnn) are the seams tests patch

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
    return cli._train(args, resumed)


#: What funcgrad train writes into --out: a folder holding any of them holds an earlier run,
#: and --overwrite deletes exactly these.
_RUN_FILES = ("metrics.json", "training.png", "checkpoints")


def _earlier_run(out: str) -> list[str]:
    """The entries of `_RUN_FILES` that `out` holds (an earlier run's), in that order."""
    return [name for name in _RUN_FILES if os.path.lexists(os.path.join(out, name))]


def _listed(names: list[str]) -> str:
    """"metrics.json, checkpoints/": `_RUN_FILES` entries as a folder listing shows them."""
    return ", ".join(name + "/" if name == "checkpoints" else name for name in names)


def _check_out(train_parser: argparse.ArgumentParser, args: argparse.Namespace, *,
               delete: bool = True) -> None:
    """Refuses (exit 2, before anything is loaded or trained) an --out that holds an earlier
    run, unless --resume continues that very run there; with --overwrite, deletes that run's
    files instead (only those: `_RUN_FILES`), if `delete` (process 0 of a --distributed run:
    the others check the same folder and leave it alone)."""
    here = (args.resume is not None
            and os.path.realpath(args.resume) == os.path.realpath(args.out))
    if here and args.overwrite:
        train_parser.error(f"argument --overwrite: it would delete the run that --resume "
                           f"{args.resume} continues in {args.out}; drop --overwrite (or "
                           "continue it into a new folder with --out DIR)")
    found = [] if here else _earlier_run(args.out)
    if not found:
        return
    if not args.overwrite:
        train_parser.error(
            f"argument --out: {args.out} holds an earlier run ({_listed(found)}); continue "
            f"it with --resume {args.out}, write this run elsewhere with another --out DIR, "
            "or replace it with --overwrite")
    if not delete:
        return
    import shutil

    for name in found:
        path = os.path.join(args.out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    print(f"funcgrad: note: --overwrite: deleted the earlier run's {_listed(found)} in "
          f"{args.out}", file=sys.stderr)


#: What --resume may change about a run: how long, where, and how it reports; not what it
#: trains (model, data, optimizer, batches), which must stay the run's own.
_RESUME_MAY_CHANGE = {"epochs", "out", "no_progress", "cache_dir", "resume", "checkpoint_every",
                      "distributed", "memory_report", "detect_anomaly", "on_nonfinite", "overwrite"}


def _resumed_settings(train_parser: argparse.ArgumentParser, args: argparse.Namespace,
                      argv: list[str]) -> tuple[int, dict] | None:
    """--resume DIR: the run's own settings for every flag not given, and the (step, metadata)
    of its latest checkpoint (None when it has none yet: the run starts over there).

    The settings come from DIR/metrics.json's config, except those the checkpoint records
    itself (what decides the batches: --seed, --batch-size, --accumulate, and through the
    train split's size --test-size), which must match it: a metrics.json that says otherwise
    is another run's (written over the checkpointed one), and the error says which flag to
    give. A given flag that would change what the run trains is an error (exit 2), and so is
    --epochs not beyond the epochs done. --out defaults to DIR. Errors name the flags."""
    metrics = os.path.join(args.resume, "metrics.json")
    try:
        with open(metrics) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = {}
    config = saved.get("config") or {}
    checkpoints = os.path.join(args.resume, "checkpoints")
    try:
        from funcgrad.train.checkpoint import _latest_meta
        latest = _latest_meta(checkpoints)
    except (ImportError, OSError, ValueError) as e:
        train_parser.error(f"argument --resume: cannot read the checkpoints in {checkpoints}: "
                           f"{str(e).splitlines()[0]}")
    position = (latest[1].get("position") or {}) if latest else {}
    done = (position["epoch"] if "epoch" in position else len(saved.get("epochs") or []))
    given = _given_flags(train_parser, argv[argv.index("train") + 1:] if "train" in argv
                         else argv)
    if "out" not in given:
        args.out = args.resume
    # What the checkpoint recorded (fit's position: the settings that decide the batches).
    recorded = {name: position[key] for name, key in (("seed", "seed"),
                ("batch_size", "batch_size"), ("accumulate", "accumulate"),
                ("test_size", "examples")) if key in position}
    for name, value in config.items():
        flag = "--" + name.replace("_", "-")
        if name not in given:
            if name not in _RESUME_MAY_CHANGE or name == "epochs":
                setattr(args, name, value)
        # A given flag must be the run's own value: the checkpoint's where it records one
        # (checked below; metrics.json may be another run's), else metrics.json's.
        elif (name not in _RESUME_MAY_CHANGE and name not in recorded
              and getattr(args, name) != value):
            train_parser.error(
                f"argument {flag}: the run in {args.resume} trained with {flag} {value}; "
                "--resume continues that run with its own settings (drop the flag, or start "
                "a new run with another --out)")
    step = latest[0] if latest else None
    for name, had in recorded.items():
        if name not in given and name not in config and name != "test_size":
            setattr(args, name, had)  # no metrics.json: the checkpoint's is the run's own
    # The flags typed first: an error about one of them is the one to fix first.
    for name, had in sorted(recorded.items(), key=lambda item: item[0] not in given):
        now = getattr(args, name)
        if (_train_digits(now) if name == "test_size" else now) == had:
            continue
        flag = "--" + name.replace("_", "-")
        ran = (f"on {had} train digits" if name == "test_size" else f"with {flag} {had}")
        this = (f"{flag} {now} leaves {_train_digits(now)}" if name == "test_size"
                else f"{flag} {now}")
        if name in given:
            train_parser.error(
                f"argument {flag}: the run in {args.resume} trained {ran} (its checkpoint at "
                f"step {step}), not {this}; --resume continues that run with its own settings "
                "(drop the flag, or start a new run with another --out)")
        source = (f"{metrics}'s config, which is then another run's (one written into "
                  f"{args.resume} over it)" if name in config else
                  f"the default ({args.resume} has no metrics.json that gives it)")
        fix = ("the --test-size that run used" if name == "test_size" else f"{flag} {had}")
        train_parser.error(
            f"argument --resume: the checkpoints in {checkpoints} were trained {ran}, but "
            f"{this} comes from {source}; continue the checkpointed run by passing {fix}, or "
            "start a new run with another --out")
    if done and args.epochs <= done:
        train_parser.error(
            f"argument --epochs: the run in {args.resume} has done {done} epochs; pass --epochs "
            f"above {done} to train more (the total, counting the epochs done)")
    return latest


#: The digits scikit-learn bundles; --test-size holds out a fraction of them.
_DIGITS = 1797


def _train_digits(test_size: float) -> int:
    """The train split's size for `test_size`: scikit-learn's train_test_split holds out
    ceil(test_size * n) examples (0.2: ceil(359.4) = 360 of 1797, leaving 1437)."""
    return _DIGITS - math.ceil(test_size * _DIGITS)


def _given_flags(train_parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags `argv` gives explicitly (defaults not counted)."""
    defaults = {action: action.default for action in train_parser._actions}
    try:
        for action in defaults:
            action.default = argparse.SUPPRESS
        given, _ = train_parser.parse_known_args(argv)
    finally:
        for action, default in defaults.items():
            action.default = default
    return set(vars(given))


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


def _train(args: argparse.Namespace, resumed: tuple[int, dict] | None = None) -> int:
    """The run `args` asks for (main has checked its flags); `resumed`: the (step, metadata)
    of the --resume checkpoint, checked against the state these flags build. The exit status.
    """
    import jax.numpy as jnp

    from funcgrad.train.coupling import CoupledExamplesWarning
    from funcgrad.train.data import load_digits
    from funcgrad.train.loop import fit
    from funcgrad.train.monitor import grad_monitor
    from funcgrad.train.precision import dynamic_loss_scale
    from funcgrad.train.step import init_train_state, make_optimizer, make_train_step

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
    if args.dtype == "float16" and loss_scale is None:
        print("funcgrad: note: float16 without --loss-scale dynamic: small gradients may "
              "underflow to zero", file=sys.stderr)

    from funcgrad import cli  # the package's _mlp and _cnn: the seams tests patch

    model = (cli._mlp(args, data, accumulate) if args.model == "mlp"
             else cli._cnn(args, data, accumulate))
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
        step = make_train_step(model.loss, tx, clip_norm=args.clip_norm,
                               compute_dtype=compute_dtype, loss_scale=loss_scale,
                               accumulate=accumulate, detect_anomaly=args.detect_anomaly,
                               monitor=monitor, mesh=mesh)
        state = init_train_state(model.params, tx, loss_scale=loss_scale, monitor=monitor,
                                 **model.state_kwargs)
        if resumed is not None:
            _check_resumable(args, state, resumed)
        memory = _memory_report(step, state, data, args.batch_size, accumulate) \
            if args.memory_report else None
        clock.lap("setup")
        result = _fit_keeping_everything(
            fit, args, step, state, data.x_train, data.y_train, main=main, epochs=args.epochs,
            batch_size=args.batch_size, seed=args.seed,
            evaluate=lambda *p: {"test_accuracy": model.test_accuracy(*p)},
            progress=main and not args.no_progress and sys.stderr.isatty(),
            log=print if main else None,
            on_nonfinite=args.on_nonfinite, every=args.checkpoint_every or args.epochs)
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


def _check_resumable(args: argparse.Namespace, state, resumed: tuple[int, dict]) -> None:
    """ValueError, in the flags' terms, when the --resume checkpoint is not of the state these
    flags build (another model or optimizer: its metrics.json is another run's, or missing)."""
    from funcgrad.train.checkpoint import _check_like

    step, meta = resumed
    try:
        _check_like(meta, state, step, f"--resume {args.resume}",
                    theirs="the flags' state", hint=False)
    except ValueError as e:
        metrics = os.path.join(args.resume, "metrics.json")
        source = (f"they come from {metrics}'s config, which is then another run's"
                  if os.path.exists(metrics) else
                  f"{args.resume} has no metrics.json to take them from")
        raise ValueError(
            f"{e} The model and optimizer flags (--model, --hidden or --channels, --optimizer, "
            f"--loss-scale, --no-monitor) build another state than the checkpointed run's: "
            f"{source}. Pass the flags that run was started with, or start a new run with "
            "another --out.") from None


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


def _fit_keeping_everything(fit, args, step, state, x, y, *, main: bool = True, **kwargs):
    """`fit` with checkpoints in OUT/checkpoints (resumed from --resume DIR); a crash inside
    it still writes metrics.json with the history so far before the error propagates.

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
        return fit(step, state, x, y, checkpoint_dir=checkpoints, resume=args.resume is not None,
                   **kwargs)
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


class _Clock:
    """Where `_train`'s seconds went, for its last line: the named stretches between calls of
    `lap` (a name may recur), less the time JAX spent tracing, lowering and compiling (or
    loading from its cache), which is reported as "compile": the union of those spans, as
    JAX's monitoring records them (they nest). One listener serves every run of the process
    (a run that raised leaves nothing registered behind it but that)."""

    _EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
               "/jax/core/compile/jaxpr_to_mlir_module_duration",
               "/jax/core/compile/backend_compile_duration")
    _current: "_Clock | None" = None
    _listening = False

    def __init__(self, now: Callable[[], float] = time.time):
        import jax.monitoring

        self.now = now  # JAX's spans are time.time() seconds
        self.start = self.last = now()
        self.laps: list[tuple[str, float, float]] = []
        self.spans: list[tuple[float, float]] = []
        _Clock._current = self
        if not _Clock._listening:
            jax.monitoring.register_event_time_span_listener(_Clock._span)
            _Clock._listening = True

    @staticmethod
    def _span(event: str, start_time: float, end_time: float, **_) -> None:
        if _Clock._current is not None and event in _Clock._EVENTS:
            _Clock._current.spans.append((start_time, end_time))

    def lap(self, name: str) -> None:
        now = self.now()
        self.laps.append((name, self.last, now))
        self.last = now

    def summary(self) -> str:
        _Clock._current = None
        merged: list[list[float]] = []
        for a, b in sorted(self.spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        overlap = lambda a, b: sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)
        parts = {"data": 0.0, "compile": sum(b - a for a, b in merged), "train": 0.0,
                 "plot": 0.0, "setup": 0.0}
        end = self.now()
        for name, a, b in [*self.laps, ("setup", self.last, end)]:
            parts[name] += b - a - overlap(a, b)
        total = end - self.start
        return f"{total:.1f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())



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


class _Model(NamedTuple):
    """What `_train` needs of a model: its line in the header, its loss (a plain function or a
    `funcgrad.Loss`),
    initial params, the keyword arguments of `init_train_state` that give its model state and
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

    from funcgrad.train.nn import accuracy, mlp_apply, mlp_init, softmax_cross_entropy

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

    from funcgrad.train.convnet import cnn_apply, cnn_init, cnn_loss
    from funcgrad.train.loss import Loss
    from funcgrad.train.nn import accuracy

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


def _plot(history, path: str) -> str:
    # A Figure on the Agg canvas, not pyplot: no GUI backend is looked for or imported.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, NullLocator
    except ImportError as e:
        raise ImportError(f"the training plot needs matplotlib, one of funcgrad's "
                          f"dependencies, and importing it failed ({e}): this environment's "
                          "installation is incomplete or broken. Install it with: pip install "
                          "'matplotlib>=3.8'") from e
    import numpy as np

    layers = bool(getattr(history, "layer_names", ()))
    height = 8 if layers else 5.5
    fig = Figure(figsize=(7, height))
    FigureCanvasAgg(fig)
    # Fixed margins (inches, for the labels and ticks drawn here) instead of tight_layout,
    # which draws the whole figure once more to measure them.
    fig.subplots_adjust(left=0.9 / 7, right=1 - 0.15 / 7, bottom=0.55 / height,
                        top=1 - 0.45 / height, hspace=0.08 * 8 / height)
    axes = fig.subplots(3 if layers else 2, 1, sharex=True)
    ax_loss, ax_norm = axes[0], axes[1]
    steps = range(len(history.step_loss))
    ax_loss.plot(steps, history.step_loss, lw=0.8)
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.set_yscale("log")
    ax_norm.plot(steps, history.step_grad_norm, lw=0.8, color="tab:orange")
    ax_norm.set_ylabel("global grad norm (pre-clip)")
    ax_norm.set_yscale("log")
    if layers:  # one curve per layer; zeros (a dead layer) are left out of the log scale
        norms = np.asarray(history.step_layer_norm, float).reshape(len(steps), -1)
        ax_layers = axes[2]
        for j, name in enumerate(history.layer_names):
            ax_layers.plot(steps, np.where(norms[:, j] > 0, norms[:, j], np.nan), lw=0.8,
                           label=name)
        ax_layers.set_ylabel("layer grad norm")
        ax_layers.set_yscale("log")
        # Where the monitor raised alerts: merged bands on this panel only, at most
        # _MAX_SPANS of them, so that thousands of alerts leave the curves readable.
        labelled = set()
        for kind, start, end, _ in _alert_spans(history.alerts, len(steps)):
            ax_layers.axvspan(start, end, color=_ALERT_COLORS.get(kind, "tab:red"), alpha=0.15,
                              lw=0, label=None if kind in labelled else f"{kind} alerts")
            labelled.add(kind)
        ax_layers.legend(fontsize=7, ncol=min(4, len(history.layer_names) + 2), loc="best")
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        # Decades labelled 0.01, 0.1, 1 (not mathtext's 10^-2...) and no minor ticks: half
        # the plot's drawing time (each tick is a few artists, each label a text layout).
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
    fig.suptitle("funcgrad train: loss and gradient norms per step"
                 + (f" ({len(history.alerts)} monitor alerts, shaded)"
                    if layers and history.alerts else ""))
    fig.savefig(path, dpi=110)
    return path


#: Most alert bands `_plot` draws; `_ALERT_COLORS` gives each kind of alert its colour.
_MAX_SPANS = 30
_ALERT_COLORS = {"nonfinite": "black", "explosion": "tab:red", "vanishing": "tab:purple",
                 "dead_relu": "tab:brown"}


def _alert_spans(alerts, n_steps: int, *, max_spans: int = _MAX_SPANS):
    """Merged bands ``(kind, start, end, count)`` (steps) covering every alert, at most
    `max_spans`.

    Alerts of one kind closer than a gap merge into one band; the gap starts at 1% of the run
    and doubles until the bands fit. Each band is at least 0.5% of the run wide, so a
    one-step alert stays visible on 200,000 steps.
    """
    by_kind: dict[str, list[int]] = {}
    for alert in alerts:
        by_kind.setdefault(alert.kind, []).append(alert.step)
    gap = max(1, n_steps // 100)
    while True:
        spans = []
        for kind, found in by_kind.items():
            found = sorted(found)
            start = end = found[0]
            count = 0
            for step in found:
                if step - end > gap:
                    spans.append((kind, start, end, count))
                    start, count = step, 0
                end, count = step, count + 1
            spans.append((kind, start, end, count))
        if len(spans) <= max_spans:
            break
        gap *= 2
    width = max(1.0, n_steps / 200)
    return [(kind, start - width / 2, end + width / 2, count)
            for kind, start, end, count in spans]
