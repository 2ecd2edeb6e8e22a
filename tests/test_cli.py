"""The main job: `funcgrad train` writes its history and plot; bad flags get one-line errors."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from funcgrad.cli import main


def test_train_writes_metrics_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--epochs", "2", "--batch-size", "64", "--out", str(out),
                   "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "epoch   2" in printed and "eval/test_accuracy" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    # ceil(1437 / 64) = 23 steps per epoch, 2 epochs, numbered 1 and 2 as printed.
    assert len(metrics["steps"]["loss"]) == 46 and len(metrics["epochs"]) == 2
    assert [row["epoch"] for row in metrics["epochs"]] == [1, 2]
    assert "epoch   1" in printed and "epoch   0" not in printed
    assert metrics["epochs"][-1]["steps"] == 46 and metrics["sizes"] == [64, 128, 10]
    assert metrics["config"]["model"] == "mlp" and "channels" not in metrics["config"]
    assert 0.5 < metrics["epochs"][-1]["eval/test_accuracy"] <= 1.0
    assert metrics["config"]["optimizer"] == "adam" and metrics["nonfinite"] is None
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nonfinite_run_exits_1_with_report(tmp_path, capsys):
    # SGD with lr = 1e6 blows up within a few steps; the run must stop and say where.
    # The report is printed once on stderr (no duplicate warning: warnings are errors here).
    # Its epoch is the first: "epoch 1" in the error and in metrics.json, as in the log lines.
    status = main(["train", "--optimizer", "sgd", "--lr", "1e6", "--epochs", "1",
                   "--out", str(tmp_path), "--no-progress"])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("non-finite value at step") == 1 and "(epoch 1, batch" in err
    report = json.loads((tmp_path / "metrics.json").read_text())["nonfinite"]
    assert report["step"] >= 1 and report["epoch"] == 1


@pytest.mark.float16
def test_float16_with_dynamic_loss_scale(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--dtype", "float16", "--loss-scale", "dynamic", "--epochs", "1",
                   "--batch-size", "64", "--out", str(out), "--no-progress"])
    assert status == 0
    assert "compute float16, dynamic loss scale" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    row = metrics["epochs"][-1]
    # The scale starts at 2**15 and only halves (a skip) or doubles (after 2000 finite steps,
    # more than the 23 steps here): it stays a power of two no larger than 2**15.
    assert (row["loss_scale"] <= 2 ** 15
            and math.log2(row["loss_scale"]) == int(math.log2(row["loss_scale"])))
    assert row["skipped"] == len(metrics["skipped_steps"])
    assert row["steps"] == 23 and 0.5 < row["eval/test_accuracy"] <= 1.0


def test_a_loss_scale_without_a_half_dtype_is_a_usage_error(tmp_path, capsys):
    # float32 gradients do not flush to zero where float16's do (6e-8): scaling changes
    # nothing there, so the flag alone is refused before any training (fg.mixed_precision).
    status = main(["train", "--loss-scale", "dynamic", "--epochs", "1", "--out",
                   str(tmp_path / "run"), "--no-progress"])
    assert status == 2
    err = capsys.readouterr().err
    assert "argument --loss-scale" in err and "--dtype float16 (or bfloat16)" in err
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_accumulate_flag(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--accumulate", "4", "--epochs", "1", "--out", str(out),
                   "--no-progress"])
    assert status == 0
    assert "4 micro-batches per update (effective batch 128)" in capsys.readouterr().out
    # ceil(1437 / 32) = 45 micro-batches: 11 groups of 4 and a tail of 1, applied: 12 updates.
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["steps"]["loss"]) == 12 and metrics["dropped_examples"] == 0


def test_remat_flag_trains_the_same_values(tmp_path, capsys):
    # Remat changes what the backward pass keeps, not what it computes: the same run without
    # --remat (the second method) gives the same losses, to float32 rounding of a separately
    # compiled recomputation.
    runs = {}
    for name, extra in (("plain", []), ("remat", ["--remat", "2"])):
        status = main(["train", "--hidden", "16", "16", "16", "--epochs", "1", "--no-monitor",
                       "--out", str(tmp_path / name), "--no-progress", *extra])
        assert status == 0
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert runs["remat"]["config"]["remat"] == 2 and runs["plain"]["config"]["remat"] is None
    # 4 layers in segments of 2: the first rematerialised, the last kept.
    assert "remat segments [2, 2] (the last kept)" in capsys.readouterr().out
    np.testing.assert_allclose(runs["remat"]["steps"]["loss"], runs["plain"]["steps"]["loss"],
                               rtol=1e-4)


def test_accumulate_beyond_the_data_says_so(tmp_path, capsys):
    # 1437 train digits in micro-batches of 32: ceil(1437 / 32) = 45 per epoch. --accumulate
    # 1000 asks for 32000 examples per update; each epoch is one update over all 1437.
    status = main(["train", "--accumulate", "1000", "--epochs", "2", "--out", str(tmp_path),
                   "--no-progress", "--no-monitor"])
    assert status == 0
    captured = capsys.readouterr()
    assert "effective batch 1437)" in captured.out and "32000" not in captured.out
    assert ("--accumulate 1000 x --batch-size 32 = 32000 examples per update exceeds the 1437 "
            "train digits: each epoch is one update over all of them (45 micro-batches)"
            in captured.err)
    assert len(json.loads((tmp_path / "metrics.json").read_text())["steps"]["loss"]) == 2


@pytest.mark.float16
def test_accumulate_with_float16_and_dynamic_loss_scaling(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--accumulate", "4", "--dtype", "float16", "--loss-scale",
                   "dynamic", "--epochs", "1", "--out", str(out), "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "compute float16, dynamic loss scale, 4 micro-batches per update" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    row = metrics["epochs"][-1]
    # 12 updates as in test_accumulate_flag, skipped ones included; each skip halves the scale
    # once from 2**15 (no growth within 2000 steps): scale = 2**15 / 2**skipped.
    assert len(metrics["steps"]["loss"]) + row["skipped"] == 12
    assert row["loss_scale"] == 2.0 ** 15 / 2 ** row["skipped"]


def test_cnn_trains_through_the_contract(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--model", "cnn", "--epochs", "3", "--lr", "3e-3", "--out", str(out),
                   "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    assert printed.startswith("funcgrad train: CNN 8x8x1 -> conv 32 -> conv 64 -> 10 (3x3 conv, "
                              "BatchNorm, ReLU, 2x2 max-pool; dropout 0.25), adam lr=0.003")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["model"] == "cnn" and metrics["channels"] == [32, 64]
    assert "hidden" not in metrics["config"] and "sizes" not in metrics
    # ceil(1437 / 32) = 45 steps per epoch, 3 epochs.
    assert len(metrics["steps"]["loss"]) == 135 and metrics["nonfinite"] is None
    # The monitor names the CNN's layers by their pytree paths.
    assert sorted(metrics["steps"]["layer_norm"]) == [
        "params['bn0']", "params['bn1']", "params['conv0']", "params['conv1']", "params['dense']"]
    # Evaluated with BatchNorm's running statistics after 3 epochs: 0.975 measured here. The
    # same run evaluated with the statistics left at their init (mean 0, variance 1: the
    # silent failure of issue 13) gave 0.825 (measured by evaluating the initial model state
    # alongside), so 0.92 tells them apart.
    accuracy = metrics["epochs"][-1]["eval/test_accuracy"]
    assert accuracy > 0.92
    assert f"final test accuracy {accuracy:.4f}" in printed


@pytest.mark.float16
def test_cnn_with_accumulation_half_precision_clipping_and_anomaly_detection(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--model", "cnn", "--channels", "8", "16", "--accumulate", "4",
                   "--dtype", "float16", "--loss-scale", "dynamic", "--clip-norm", "1",
                   "--detect-anomaly", "--epochs", "1", "--out", str(out), "--no-progress"])
    assert status == 0
    captured = capsys.readouterr()
    assert ("conv 8 -> conv 16 -> 10" in captured.out and "clip_norm=1, compute float16, "
            "dynamic loss scale, 4 micro-batches per update" in captured.out)
    # BatchNorm couples the examples of a micro-batch: said once, as a note, not a warning
    # (warnings are errors here).
    assert captured.err.count("own BatchNorm statistics (ghost batch norm)") == 1
    metrics = json.loads((out / "metrics.json").read_text())
    # 45 micro-batches: 11 groups of 4 and a tail of 1, applied: 12 updates, skipped included.
    assert len(metrics["steps"]["loss"]) + metrics["epochs"][-1]["skipped"] == 12


def test_cnn_nonfinite_run_is_located(tmp_path, capsys):
    # SGD with lr = 1e6 blows the CNN up at its second step; --detect-anomaly names the
    # primitive and the line in funcgrad/demo/cnn.py, through the model state and the key.
    status = main(["train", "--model", "cnn", "--channels", "8", "16", "--optimizer", "sgd",
                   "--lr", "1e6", "--epochs", "1", "--detect-anomaly", "--no-monitor",
                   "--out", str(tmp_path), "--no-progress"])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("non-finite value at step") == 1
    assert "find_nonfinite: first non-finite value" in err and "cnn.py:" in err
    assert json.loads((tmp_path / "metrics.json").read_text())["nonfinite"]["epoch"] == 1


@pytest.mark.parametrize("argv, message", [
    (["train", "--lr", "-1"], "argument --lr: expected a positive float, got '-1'"),
    (["train", "--epochs", "two"], "argument --epochs: expected a positive int, got 'two'"),
    (["train", "--optimizer", "rmsprop"], "argument --optimizer: invalid choice: 'rmsprop'"),
    (["train", "--momentum", "1.5"],
     "funcgrad train: error: argument --momentum: expected a number in [0, 1)"),
    (["train", "--hidden"], "argument --hidden: expected at least one argument"),
    (["train", "--test-size", "1"], "argument --test-size: expected a number in (0, 1)"),
    (["train", "--test-size", "0.001"], "at least 10 of the 1797 digits in each split"),
    (["train", "--seed", "-1"], "argument --seed: expected an int in [0, 2**32)"),
    (["train", "--lr", "inf"], "argument --lr: expected a positive float, got 'inf'"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["train", "--accumulate", "0"], "argument --accumulate: expected a positive int, got '0'"),
    (["train", "--remat", "0"], "argument --remat: expected 'sqrt' or a positive int, got '0'"),
    (["train", "--hidden", "8", "--remat", "3"],
     "argument --remat: a segment of 3 layers does not fit the MLP's 2 layers"),
    (["train", "--model", "cnn", "--remat", "2"],
     "argument --remat: applies to --model mlp only (got --model cnn); drop it"),
    (["train", "--momentum", "0.5"],
     "funcgrad train: error: argument --momentum: applies to --optimizer momentum only"),
    (["train", "--out", __file__], "funcgrad train: error: argument --out: "),
    ([], "the following arguments are required: command"),
    (["train", "--model", "cnn", "--hidden", "64"],
     "funcgrad train: error: argument --hidden: applies to --model mlp only (got --model cnn)"),
    (["train", "--model", "cnn", "--activation", "tanh"],
     "argument --activation: applies to --model mlp only"),
    (["train", "--dropout", "0.5"],
     "argument --dropout: applies to --model cnn only (got --model mlp); drop it or add "
     "--model cnn"),
    (["train", "--channels", "8"], "argument --channels: applies to --model cnn only"),
    (["train", "--model", "cnn", "--channels", "4", "4", "4", "4"],
     "argument --channels: each block halves the 8x8 image, so at most 3 blocks; got 4"),
    (["train", "--model", "cnn", "--dropout", "1"],
     "argument --dropout: expected a number in [0, 1), got '1'"),
    (["train", "--model", "rnn"], "argument --model: invalid choice: 'rnn'"),
    # No abbreviations: argparse took --epoch as --epochs (its only flag with that prefix).
    # (With --out a file, a parser that took it would fail on --out instead, at once.)
    (["train", "--epoch", "3", "--out", __file__],
     "unrecognized arguments: --epoch 3; did you mean --epochs? (see funcgrad --help)"),
    (["train", "--no-prog", "--batchsize=8", "--out", __file__],
     "unrecognized arguments: --no-prog --batchsize=8; did you mean --no-progress for "
     "--no-prog, --batch-size for --batchsize?"),
], ids=["negative_lr", "word_epochs", "unknown_optimizer", "momentum_range", "empty_hidden",
        "test_size", "tiny_test_size", "negative_seed", "infinite_lr", "unknown_flag", "dtype",
        "accumulate",
        "remat_zero", "remat_too_long", "cnn_remat",
        "momentum_without_momentum_optimizer", "out_is_a_file", "no_command", "cnn_hidden",
        "cnn_activation", "mlp_dropout", "mlp_channels", "cnn_too_many_blocks",
        "cnn_dropout_one", "unknown_model", "abbreviated_flag", "misspelt_flags"])
def test_bad_flags_give_one_line(argv, message, capsys):
    # In-process: the parser is the same object `python -m funcgrad` runs (its entry point is
    # checked in a subprocess below), and a subprocess per flag cost an import of JAX each.
    # An uncaught exception (a traceback) propagates here instead of SystemExit and fails.
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_a_bad_flag_through_python_m_funcgrad_is_one_line():
    # The real entry point (funcgrad/__main__.py) in a fresh interpreter: exit status 2 and one
    # line on stderr, nothing printed by importing the package first.
    proc = subprocess.run([sys.executable, "-m", "funcgrad", "train", "--lr", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "argument --lr: expected a positive float, got '-1'" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr


def test_version():
    import funcgrad
    proc = subprocess.run([sys.executable, "-m", "funcgrad", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"funcgrad {funcgrad.__version__}"


def test_unwritable_output_folder_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = subprocess.run([sys.executable, "-m", "funcgrad", "train", "--out",
                           str(blocker / "run")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("funcgrad: error:") and "Traceback" not in proc.stderr


def test_the_plot_merges_thousands_of_alerts_into_a_few_bands(tmp_path, monkeypatch):
    # 2,264 alerts (the count of the converged 5,000-epoch run) over 10,000 steps: 2,000
    # vanishing alerts every 5 steps from step 0, and 264 explosions in two bursts (steps
    # 100-231 and 8000-8131). The plot drew one line per alert on every panel (6,792 lines over
    # the curves); now at most 30 shaded bands on the layer panel, covering every alert.
    import matplotlib.figure

    from funcgrad.cli import _plot
    from funcgrad.train.alerts import Alert
    from funcgrad.train.fit import History

    alerts = ([Alert(5 * i, "vanishing", "params[0]", 1e-7, 1e-6) for i in range(2000)]
              + [Alert(s, "explosion", "global", 1e3, 10.0)
                 for s in [*range(100, 232), *range(8000, 8132)]])
    history = History(step_loss=[1.0] * 10_000, step_grad_norm=[1.0] * 10_000,
                      layer_names=("params[0]", "params[1]"),
                      step_layer_norm=[[1e-7, 1.0]] * 10_000, alerts=alerts)
    figures = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (figures.append(fig), real_savefig(fig, *a, **k)))
    _plot(history, str(tmp_path / "training.png"))
    (fig,) = figures
    lines = sum(len(ax.lines) for ax in fig.axes)
    bands = sum(len(ax.patches) for ax in fig.axes)
    assert lines == 4                        # loss, global norm, two layer curves: no alert lines
    from funcgrad.cli import _MAX_SPANS, _alert_spans
    assert 0 < bands <= _MAX_SPANS
    spans = _alert_spans(alerts, 10_000)
    assert len(spans) == bands and sum(count for *_, count in spans) == 2264
    for alert in alerts:                     # every alert lies inside a band of its kind
        assert any(k == alert.kind and a <= alert.step <= b for k, a, b, _ in spans)
    # The two explosion bursts are 7,769 steps apart: they stay two bands, not one.
    assert sorted((round(a), round(b)) for k, a, b, _ in spans if k == "explosion") == [
        (75, 256), (7975, 8156)]


def test_memory_report_is_printed_and_written(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["train", "--epochs", "1", "--batch-size", "256", "--hidden", "16",
                   "--no-monitor", "--memory-report", "--out", str(out), "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    memory = json.loads((out / "metrics.json").read_text())["memory"]
    assert memory["mode"] == "step" and "estimated peak" in printed
    # The step's arguments hold at least the MLP 64 -> 16 -> 10's float32 params, twice for
    # Adam's two moments besides the params: 3 * (64*16 + 16 + 16*10 + 10) * 4 bytes, and the
    # batch: 256 * 64 float32 pixels + 256 int32 labels.
    params = (64 * 16 + 16 + 16 * 10 + 10) * 4
    assert memory["argument_bytes"] >= 3 * params + 256 * 64 * 4 + 256 * 4
    assert memory["peak_bytes"] == (memory["argument_bytes"] + memory["output_bytes"]
                                    + memory["temp_bytes"] - memory["alias_bytes"])
    assert f"{memory['peak_bytes']:,}" in printed


def test_ctrl_c_keeps_the_run_and_resume_finishes_it_as_one_run_would(tmp_path, capsys,
                                                                     monkeypatch):
    # Ctrl-C while epoch 2 is evaluated: exit status 130 with metrics.json (2 epochs), the plot
    # and a checkpoint. Then --resume DIR --epochs 3 trains epoch 3 only, and its history and
    # final accuracy equal those of one uninterrupted 3-epoch run (same flags).
    import os
    import signal

    import funcgrad.cli._training as training  # where the command calls _mlp
    real_mlp = training._mlp
    calls = []

    def mlp_with_ctrl_c(args, data, accumulate):
        model = real_mlp(args, data, accumulate)

        def test_accuracy(*p):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return model.test_accuracy(*p)
        return model._replace(test_accuracy=test_accuracy)

    common = ["--batch-size", "128", "--hidden", "16", "--no-progress", "--no-monitor"]
    out = tmp_path / "run"
    monkeypatch.setattr(training, "_mlp", mlp_with_ctrl_c)
    assert main(["train", "--epochs", "3", "--out", str(out), *common]) == 130
    assert "interrupted after step 24" in capsys.readouterr().err  # 12 steps an epoch
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["epochs"]) == 2 and (out / "training.png").exists()
    assert sorted(os.listdir(out / "checkpoints")) == ["24"]
    monkeypatch.setattr(training, "_mlp", real_mlp)
    assert main(["train", "--epochs", "3", "--resume", str(out), *common]) == 0
    resumed = json.loads((out / "metrics.json").read_text())
    assert main(["train", "--epochs", "3", "--out", str(tmp_path / "straight"), *common]) == 0
    straight = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    assert resumed["epochs"] == straight["epochs"] and len(resumed["epochs"]) == 3
    assert resumed["steps"]["loss"] == straight["steps"]["loss"]


def test_skip_nonfinite_batches_goes_on(tmp_path, capsys):
    # SGD with lr 1e6 blows up: with --on-nonfinite skip every non-finite step is skipped
    # (params untouched), counted and listed, and the run completes its epoch with status 0.
    status = main(["train", "--optimizer", "sgd", "--lr", "1e6", "--epochs", "1",
                   "--on-nonfinite", "skip", "--out", str(tmp_path), "--no-progress",
                   "--no-monitor"])
    assert status == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    skipped = metrics["skipped_batches"]
    assert skipped and all(s["epoch"] == 1 for s in skipped)
    assert len(metrics["steps"]["loss"]) + len(skipped) == 45  # ceil(1437 / 32) steps
    assert f"{len(skipped)} non-finite batch(es) skipped" in capsys.readouterr().out


def test_resume_needs_a_run_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--resume", str(tmp_path)])
    assert exit_.value.code == 2
    assert "holds no checkpoints/ folder" in capsys.readouterr().err


_SMALL = ["train", "--epochs", "1", "--batch-size", "256", "--hidden", "16", "--no-monitor",
          "--no-progress"]


def test_a_warm_run_reads_the_digits_cache_and_never_imports_sklearn_or_pyplot(
        tmp_path, monkeypatch, capsys):
    import jax
    compile_dir = jax.config.jax_compilation_cache_dir  # the suite's (tests/conftest.py)
    assert main([*_SMALL, "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "a")]) == 0
    (split,) = (tmp_path / "c" / "digits").iterdir()
    for name in ("sklearn.datasets", "sklearn.model_selection", "sklearn.preprocessing",
                 "matplotlib.pyplot"):  # importing any of them now fails
        monkeypatch.setitem(sys.modules, name, None)
    assert main([*_SMALL, "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "b")]) == 0
    assert list((tmp_path / "c" / "digits").iterdir()) == [split]
    first, second = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in "ab")
    assert first["steps"] == second["steps"] and first["epochs"] == second["epochs"]
    # A JAX cache configured already (here by JAX_COMPILATION_CACHE_DIR) is kept, not moved.
    assert jax.config.jax_compilation_cache_dir == compile_dir
    assert not any((tmp_path / "c" / "jax").iterdir())


def test_jax_compilation_cache_goes_under_the_cache_folder_when_none_is_set(
        tmp_path, monkeypatch, capsys):
    import jax

    from funcgrad.cli import _use_caches
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", None)  # as in a fresh `funcgrad train`
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # JAX's default
    try:
        assert _use_caches(str(tmp_path / "c")) == str(tmp_path / "c")
        after = (jax.config.jax_compilation_cache_dir,
                 jax.config.jax_persistent_cache_min_compile_time_secs)
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    assert after == (str(tmp_path / "c" / "jax"), 0.0) and (tmp_path / "c" / "jax").is_dir()


def test_an_unusable_cache_folder_or_home_still_trains(tmp_path, monkeypatch, capsys):
    from funcgrad.cli import _use_caches
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder would go")
    out = tmp_path / "run"
    assert main([*_SMALL, "--cache-dir", str(blocker / "cache"), "--out", str(out)]) == 0
    assert "no cache folder" in capsys.readouterr().err and (out / "metrics.json").exists()
    # The default folder under a home that cannot hold it (read-only, or a file): no cache.
    for name in ("FUNCGRAD_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(blocker / "home"))
    assert _use_caches(None) is None
    assert f"{blocker / 'home' / '.cache' / 'funcgrad'}: " in capsys.readouterr().err


def test_the_plot_has_its_three_panels(tmp_path, monkeypatch):
    import matplotlib.figure

    from funcgrad.cli import _plot
    from funcgrad.train.fit import History
    figures = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (figures.append(fig), real_savefig(fig, *a, **k)))
    history = History(step_loss=[2.0, 1.0, 0.5], step_grad_norm=[3.0, 2.0, 1.0],
                      layer_names=("params[0]", "params[1]"),
                      step_layer_norm=[[1.0, 2.0], [0.0, 1.0], [0.5, 0.5]], alerts=[])
    path = tmp_path / "training.png"
    _plot(history, str(path))
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "loss (nats)", "global grad norm (pre-clip)", "layer grad norm"]
    assert [ax.get_yscale() for ax in fig.axes] == ["log"] * 3
    assert fig.axes[-1].get_xlabel() == "step" and fig.axes[-1].get_legend() is not None
    assert [len(ax.lines) for ax in fig.axes] == [1, 1, 2]
    # 7 x 8 inches at 110 dpi: 770 x 880 pixels (the PNG's IHDR width and height).
    png = path.read_bytes()
    assert int.from_bytes(png[16:20], "big") == 770 and int.from_bytes(png[20:24], "big") == 880
    for ax in fig.axes:  # no panel overlaps the next or leaves the figure
        box = ax.get_position()
        assert 0 < box.x0 < box.x1 < 1 and 0 < box.y0 < box.y1 < 1
    boxes = [ax.get_position() for ax in fig.axes]
    assert all(upper.y0 > lower.y1 for upper, lower in zip(boxes, boxes[1:]))


def test_the_last_lines_breakdown_takes_compiling_out_of_each_stretch():
    import jax.monitoring

    from funcgrad.cli import _Clock
    times = iter([100.0, 101.5, 103.0, 103.3])
    clock = _Clock(now=lambda: next(times))            # starts at 100
    for event, start, end in [("/jax/core/compile/jaxpr_trace_duration", 100.5, 101.0),
                              ("/jax/core/compile/jaxpr_to_mlir_module_duration", 100.6, 100.8),
                              ("/jax/core/compile/backend_compile_duration", 102.0, 102.5),
                              ("/jax/some/other_event", 100.0, 103.0)]:
        jax.monitoring.record_event_time_span(event, start, end, fun_name="f")
    clock.lap("data")                                  # 101.5
    clock.lap("train")                                 # 103.0
    # compile: [100.5, 101] (the nested span inside it) + [102, 102.5] = 1.0 s; data: 1.5 s
    # less the 0.5 s of compiling in it; train: 1.5 - 0.5; setup: 103.0 -> 103.3; total 3.3.
    assert clock.summary() == ("3.3 s: data 1.00 s, compile 1.00 s, train 1.00 s, "
                               "plot 0.00 s, setup 0.30 s")


def test_the_console_entry_runs_exit_handlers_flushes_and_exits_with_mains_status(
        tmp_path, monkeypatch, capsys):
    import atexit
    import os

    from funcgrad import cli
    calls = []

    class Exited(Exception):
        pass

    def fake_exit(status):
        calls.append(("exit", status))
        raise Exited

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(sys, "argv", ["funcgrad", "train", "--out", str(blocker / "run")])
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: calls.append(("atexit",)))
    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(Exited):
        cli.console_main()
    assert calls == [("atexit",), ("exit", 1)]  # main's status: 1, the unwritable --out
    assert capsys.readouterr().err.startswith("funcgrad: error:")


def test_resume_keeps_the_runs_settings_and_refuses_changes(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--no-progress", "--no-monitor"]
    assert main(["train", "--epochs", "1", "--batch-size", "256", "--lr", "0.01", "--hidden",
                 "8", "--out", str(out), *common]) == 0
    # A flag that changes what the run trains: refused, naming the run's value.
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--resume", str(out), "--epochs", "2", "--lr", "0.5", *common])
    assert exit_.value.code == 2
    assert "trained with --lr 0.01" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--resume", str(out), "--epochs", "1", *common])
    assert "has done 1 epochs; pass --epochs above 1" in capsys.readouterr().err
    # Without the flags, the run's own (batch 256, lr 0.01, hidden 8) carry on: 6 steps an
    # epoch (ceil(1437 / 256)), 12 in all.
    assert main(["train", "--resume", str(out), "--epochs", "2", *common]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["lr"] == 0.01 and metrics["config"]["hidden"] == [8]
    assert metrics["epochs"][-1]["steps"] == 12 and len(metrics["epochs"]) == 2


# --- issue 24, point 5.2: an earlier run in --out; resume errors in the flags' terms ---------

def _exit_2(argv, capsys) -> str:
    """The one line of a parser error (exit status 2), raised before anything is trained."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_out_folder_with_an_earlier_run_is_refused_before_training(tmp_path, capsys,
                                                                      monkeypatch):
    import os

    import funcgrad.cli.train as train_command  # where the command calls _train
    out = tmp_path / "run"
    assert main([*_SMALL, "--out", str(out)]) == 0  # batch 256: ceil(1437 / 256) = 6 steps
    (out / "notes.txt").write_text("the user's own file")
    before = {name: (out / name).read_bytes() for name in ("metrics.json", "training.png")}
    # The same command again: refused before training (a _train call would fail the test),
    # naming what is there and the three ways on; the folder is left as it was.
    monkeypatch.setattr(train_command, "_train", lambda *a: pytest.fail("trained"))
    line = _exit_2([*_SMALL, "--out", str(out)], capsys)
    assert line == (f"funcgrad train: error: argument --out: {out} holds an earlier run "
                    f"(metrics.json, training.png, checkpoints/); continue it with --resume "
                    f"{out}, write this run elsewhere with another --out DIR, or replace it "
                    "with --overwrite (see funcgrad train --help)")
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(out / "checkpoints")) == ["6"]
    # Any one of the three counts: a checkpoints/ folder alone (a run that crashed early).
    (tmp_path / "crashed" / "checkpoints").mkdir(parents=True)
    assert "holds an earlier run (checkpoints/)" in _exit_2(
        [*_SMALL, "--out", str(tmp_path / "crashed")], capsys)
    # Resuming into another folder that holds a run: refused the same way (it was a
    # ValueError after loading the data, exit 1).
    assert "argument --out: " + str(tmp_path / "crashed") + " holds an earlier run" in _exit_2(
        ["train", "--resume", str(out), "--epochs", "2", "--out", str(tmp_path / "crashed"),
         "--no-progress"], capsys)
    # --overwrite with --resume into the run's own folder would delete what it resumes.
    assert "argument --overwrite: it would delete the run that --resume" in _exit_2(
        ["train", "--resume", str(out), "--epochs", "2", "--overwrite"], capsys)
    monkeypatch.undo()
    # --overwrite: the earlier run's three entries go before training, the user's file stays.
    # 2 epochs of 6 steps end at step 12; with the old checkpoints kept the folder would also
    # hold "6" (and a later run of 1 epoch, step 6, could not checkpoint at all).
    assert main([*_SMALL, "--epochs", "2", "--out", str(out), "--overwrite"]) == 0
    assert "--overwrite: deleted the earlier run's metrics.json, training.png, checkpoints/" \
        in capsys.readouterr().err
    assert sorted(os.listdir(out / "checkpoints")) == ["12"]
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert len(json.loads((out / "metrics.json").read_text())["epochs"]) == 2


def test_resume_names_the_flags_when_metrics_json_is_another_runs(tmp_path, capsys):
    import shutil
    out, other = tmp_path / "run", tmp_path / "other"
    assert main([*_SMALL, "--out", str(out)]) == 0                             # batch 256
    assert main([*_SMALL, "--batch-size", "128", "--out", str(other)]) == 0    # batch 128
    # The folder of the issue: the checkpoints of one run beside another run's metrics.json.
    shutil.copy(other / "metrics.json", out / "metrics.json")
    line = _exit_2(["train", "--resume", str(out), "--epochs", "2"], capsys)
    assert line == (
        f"funcgrad train: error: argument --resume: the checkpoints in {out / 'checkpoints'} "
        "were trained with --batch-size 256, but --batch-size 128 comes from "
        f"{out / 'metrics.json'}'s config, which is then another run's (one written into {out} "
        "over it); continue the checkpointed run by passing --batch-size 256, or start a new "
        "run with another --out (see funcgrad train --help)")
    assert "resume=True" not in line and "batch_size" not in line  # fit's words
    # A given flag that differs from the checkpoint: named with the checkpoint's value.
    assert ("argument --batch-size: the run in " + str(out) + " trained with --batch-size 256 "
            "(its checkpoint at step 6), not --batch-size 64") in _exit_2(
        ["train", "--resume", str(out), "--epochs", "2", "--batch-size", "64"], capsys)
    # --test-size through the train split's size: 0.5 holds out ceil(898.5) = 899 of 1797.
    assert ("trained on 1437 train digits (its checkpoint at step 6), not --test-size 0.5 "
            "leaves 898") in _exit_2(
        ["train", "--resume", str(out), "--epochs", "2", "--test-size", "0.5"], capsys)
    # The fix the message names works: 2 epochs of ceil(1437 / 256) = 6 steps, 12 in all.
    assert main(["train", "--resume", str(out), "--epochs", "2", "--batch-size", "256",
                 "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epochs"][-1]["steps"] == 12 and metrics["config"]["batch_size"] == 256


def test_resume_without_the_runs_flags_names_them(tmp_path, capsys):
    # A run's metrics.json lost: what the checkpoint records (batch 256) is taken from it, the
    # other flags fall back to their defaults (hidden 128, monitor on), which build another
    # state than the checkpoint's (hidden 16, no monitor).
    out = tmp_path / "run"
    assert main([*_SMALL, "--out", str(out)]) == 0
    (out / "metrics.json").unlink()
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--epochs", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"funcgrad: error: --resume {out}: the checkpoint at step 6 does not "
                          "have the structure of the flags' state")
    assert ("(--model, --hidden or --channels, --optimizer, --loss-scale, --no-monitor) build "
            f"another state than the checkpointed run's: {out} has no metrics.json to take them "
            "from. Pass the flags that run was started with") in err
    assert "like" not in err.replace("likewise", "")  # restore_checkpoint's word for it
    # With them, it resumes.
    assert main(["train", "--resume", str(out), "--epochs", "2", "--hidden", "16",
                 "--no-monitor", "--no-progress"]) == 0
    # 2 epochs of ceil(1437 / 256) = 6 steps: the checkpoint's batch size, not the default 32.
    assert json.loads((out / "metrics.json").read_text())["epochs"][-1]["steps"] == 12
