"""``funcgrad launch -n 2 -- funcgrad train --distributed`` trains like ``funcgrad train`` on one
process (same seed): the digits MLP, with ``--accumulate``, the CNN, a resumed run, a run that
crashes. Every run goes through _audited_train.py, which reports the files each process
wrote: process 1 writes none (process 0 writes metrics.json and training.png; orbax writes
the checkpoints).

Hard limits: the launcher stops a run after 60 s, and each subprocess is killed after 90 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _run import run_watched  # noqa: E402

AUDITED = os.path.join(os.path.dirname(__file__), "_audited_train.py")
EPOCHS = 3
STEPS = EPOCHS * 45  # 1437 train digits in batches of 32


def _run(command: list[str], status: int = 0) -> subprocess.CompletedProcess:
    """`command`, failed if it hangs (its processes stop computing: _run.py's watchdog), never
    for being slow."""
    done, _ = run_watched(command)
    assert done.returncode == status, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _train(out: str, *flags: str, processes: int, epochs: int = EPOCHS, status: int = 0,
           fail_at_epoch: int | None = None, fail_process: int | None = None,
           ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``funcgrad train`` (seed 3, clip norm 1) into `out` on 1 process, or on 2 under
    ``funcgrad launch`` with --distributed; the run, and the paths process 0 wrote into `out`
    (outside orbax's checkpoints). Checks that process 1 wrote none."""
    audited = [sys.executable, AUDITED, "--watch", out,
               *(["--fail-at-epoch", str(fail_at_epoch)] if fail_at_epoch else []),
               *(["--fail-process", str(fail_process)] if fail_process is not None else []),
               "--"]
    train = [*audited, "train", "--epochs", str(epochs), "--seed", "3", "--out", out,
             "--no-progress", "--clip-norm", "1.0", *flags]
    if processes == 1:
        done = _run(train, status=status)
    else:
        done = _run([sys.executable, "-m", "funcgrad", "launch", "-n", str(processes),
                     "--init-timeout", "120", "--grace", "2", "--",
                     *train, "--distributed"], status=status)
    wrote = {}
    for line in done.stdout.splitlines():
        head, _, paths = line.partition("WROTE ")
        if paths:
            wrote[head.strip("[] ")] = json.loads(paths)
    if processes == 1:
        return done, wrote[""]
    assert sorted(wrote) == [str(i) for i in range(processes)], done.stdout[-3000:]
    for i in range(1, processes):
        assert wrote[str(i)] == [], f"process {i} wrote {wrote[str(i)]} into {out}"
    return done, wrote["0"]


def _metrics(out: str) -> dict:
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def _checkpointed(out: str) -> dict[str, np.ndarray]:
    """The arrays of the run's latest checkpoint, by their TrainState path."""
    import jax

    from funcgrad.train.checkpoint import _orbax
    ocp = _orbax()  # orbax, with its own deprecated uses of JAX silenced

    root = os.path.join(out, "checkpoints")
    folder = os.path.join(root, str(max(int(n) for n in os.listdir(root) if n.isdigit())))
    with open(os.path.join(folder, "meta", "metadata")) as f:
        paths = [leaf["path"] for leaf in json.load(f)["leaves"]]
    with warnings.catch_warnings(), ocp.PyTreeCheckpointer() as checkpointer:
        warnings.simplefilter("ignore")
        where = os.path.join(folder, "state")
        tree = checkpointer.metadata(where)
        tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        arrays = checkpointer.restore(where, restore_args=args)
    return {paths[int(name[4:])]: np.asarray(a) for name, a in arrays.items()}


def _assert_trains_like(one: str, two: str) -> tuple[dict, dict]:
    """The runs in `one` (1 process) and `two` (2 processes) have the same test accuracy at
    every epoch and the same per-step losses and gradient norms to 1e-5; their metrics."""
    m1, m2 = _metrics(one), _metrics(two)
    assert m2["config"]["distributed"] is True
    accuracy = [[row["eval/test_accuracy"] for row in m["epochs"]] for m in (m1, m2)]
    assert accuracy[0] == accuracy[1], accuracy
    np.testing.assert_allclose(m1["steps"]["loss"], m2["steps"]["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["steps"]["grad_norm"], m2["steps"]["grad_norm"], rtol=1e-5,
                               atol=1e-6)
    return m1, m2


def _assert_params_close(one: str, two: str, steps: int) -> None:
    """The final checkpoints of `one` and `two` (written by orbax from the replicated state of
    both processes) have the same leaves, `steps` steps, and params within 1e-5·max|p|."""
    s1, s2 = _checkpointed(one), _checkpointed(two)
    assert s1.keys() == s2.keys()
    params = [k for k in s1 if k.startswith("state.params")]
    scale = max(float(np.max(np.abs(s1[k]))) for k in params)
    # Each step's gradient equals the one-device one to 1e-6·max|g| (test_distributed.py
    # asserts that step by step); over 135 Adam steps the params drift further apart than one
    # step's rounding, because Adam divides each element's moment by sqrt(v) + 1e-8, so an
    # element whose gradient is near 0 turns a 1e-7 gradient difference into a larger update
    # difference. Measured (MLP): 9.2e-7 = 1.9e-6·max|p| (jax 0.12.0.1), under 1e-6·max|p|
    # (0.10.2); allowed: 1e-5·max|p|, still far below one update (lr = 1e-3).
    for k in params:
        assert np.max(np.abs(s1[k].astype(np.float64) - s2[k])) <= 1e-5 * scale, k
    assert int(s1["state.step"]) == int(s2["state.step"]) == steps


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, list[str]]:
    """A 2-process run of EPOCHS epochs (shared: the second method of two tests): its folder,
    the launcher's run and what process 0 wrote."""
    out = str(tmp_path_factory.mktemp("two") / "out")
    return out, *_train(out, processes=2)


def test_two_processes_train_like_one(tmp_path, two_processes):
    one = str(tmp_path / "one")
    _train(one, processes=1)
    two, done, wrote = two_processes
    assert "data-parallel over 2 devices of 2 processes" in done.stdout
    # Only process 0 reports: its lines carry "[0] "; process 1 prints no epoch lines.
    assert "[0] epoch   3" in done.stdout and "[1] epoch" not in done.stdout
    assert sorted(wrote) == ["metrics.json", "training.png"]
    _assert_trains_like(one, two)
    _assert_params_close(one, two, STEPS)


def test_accumulate_on_two_processes_trains_like_one(tmp_path):
    # 45 micro-batches per epoch: 22 groups of 2 and a last group of one 29-row micro-batch
    # (rows that do not divide among 2 devices: computed whole on each).
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _train(one, "--accumulate", "2", processes=1)
    done, _ = _train(two, "--accumulate", "2", processes=2)
    assert "2 micro-batches per update" in done.stdout
    m1, _ = _assert_trains_like(one, two)
    assert len(m1["steps"]["loss"]) == EPOCHS * 23
    _assert_params_close(one, two, EPOCHS * 23)


def test_cnn_on_two_processes_trains_like_one(tmp_path):
    # BatchNorm normalises with the global batch's statistics on 2 processes as on one, and
    # dropout's masks are the same bits on 1 and 2 devices (partitionable threefry: each
    # device draws its own rows' part of the global batch's mask). Measured with one block of
    # 8 channels: losses and norms within 2.4e-7, params within 1e-7·max|p|, over 2 and 3
    # epochs (jax 0.10.2 and 0.12.0.1). With the default blocks of 32 and 64 channels a
    # rounding difference is amplified once (losses within 1e-6 for 83 steps, 4e-6 at step 84,
    # up to 4e-4 by step 135, the same test accuracies over 3 epochs): hence the smaller net,
    # which also compiles faster.
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    flags = ("--model", "cnn", "--channels", "8")
    _train(one, *flags, processes=1, epochs=2)
    done, _ = _train(two, *flags, processes=2, epochs=2)
    assert "CNN 8x8x1 -> conv 8 -> 10" in done.stdout and "dropout 0.25" in done.stdout
    _assert_trains_like(one, two)
    _assert_params_close(one, two, 2 * 45)


def test_a_resumed_two_process_run_ends_as_the_uninterrupted_one(tmp_path, two_processes):
    whole = two_processes[0]
    part, moved = str(tmp_path / "part"), str(tmp_path / "moved")
    _train(part, processes=2, epochs=1)
    # Into another --out first (process 0 deletes the earlier run there and copies the
    # checkpoints), then in place.
    os.makedirs(moved)
    open(os.path.join(moved, "training.png"), "w").close()
    done, wrote = _train(moved, "--resume", part, "--overwrite", processes=2)
    assert "[0] funcgrad: note: --overwrite: deleted" in done.stderr
    assert "[1] funcgrad: note" not in done.stderr
    assert "checkpoints" in wrote  # the copy, by process 0 only
    done, _ = _train(part, "--resume", part, processes=2)
    assert "[0] epoch   2" in done.stdout and "[0] epoch   1" not in done.stdout
    end = _checkpointed(whole)
    assert int(end["state.step"]) == STEPS
    expected = {k: v for k, v in _metrics(whole).items() if k != "config"}
    for resumed in (moved, part):
        arrays = _checkpointed(resumed)
        assert arrays.keys() == end.keys()
        for k, a in end.items():
            np.testing.assert_array_equal(arrays[k], a, err_msg=k)
            assert arrays[k].dtype == a.dtype, k
        assert {k: v for k, v in _metrics(resumed).items() if k != "config"} == expected


def test_a_crashed_two_process_run_leaves_one_metrics_file_by_process_0(tmp_path):
    # The test accuracy raises at epoch 2 on every process (a crash inside fit): the run
    # writes metrics.json with the history so far. On 2 processes, process 0 alone writes it
    # (_train checks process 1 wrote nothing). One process also checkpoints the state at the
    # crash; several keep their last periodic checkpoint (epoch 1's, --checkpoint-every 1)
    # and say so: a save waits for every process, and they need not all have failed (the
    # next test).
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _train(one, "--checkpoint-every", "1", processes=1, status=1, fail_at_epoch=2)
    done, wrote = _train(two, "--checkpoint-every", "1", processes=2, status=1,
                         fail_at_epoch=2)
    assert wrote == ["metrics.json"]
    assert sorted(os.listdir(two)) == ["checkpoints", "metrics.json"]
    assert [n for n in os.listdir(os.path.join(two, "checkpoints")) if n.isdigit()] == ["45"]
    assert "the state at the error is not checkpointed" in done.stderr
    assert "the last state (step 90) is checkpointed" not in done.stderr
    assert done.stderr.count("the history so far is in") == 1
    assert "[0] funcgrad train: the history so far is in" in done.stderr
    m1, m2 = _assert_trains_like(one, two)
    assert m1["error"] == "RuntimeError: planted failure at epoch 2's evaluation on process 0"
    assert m2["error"] == m1["error"]
    assert len(m2["epochs"]) == 1 and len(m2["steps"]["loss"]) == 2 * 45
    assert {k: v for k, v in m2["config"].items() if k not in ("out", "distributed")} == {
        k: v for k, v in m1["config"].items() if k not in ("out", "distributed")}


def test_a_failure_on_one_process_ends_the_run_in_seconds(tmp_path):
    # Process 1 alone raises at epoch 2's evaluation while process 0 goes on into epoch 2's
    # steps, whose all-reduce waits for process 1. Process 1 exits at once (no wait at JAX's
    # shutdown barrier, which would wait for process 0: 300 s), process 0's collective then
    # fails, and the launcher ends the run (a run left waiting is stopped as a hang by the
    # watchdog, and fails).
    done, _ = _train(str(tmp_path / "two"), processes=2, status=1, fail_at_epoch=2,
                     fail_process=1)
    assert "RuntimeError: planted failure at epoch 2's evaluation on process 1" in done.stderr
    assert "timed out" not in done.stderr, done.stderr[-3000:]
