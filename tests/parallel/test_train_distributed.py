"""``funcgrad launch -n 2 -- funcgrad train --distributed`` trains the digits MLP to the same
test accuracy, history and params as ``funcgrad train`` on one process (same seed).

Hard limits: the launcher stops the run after 60 s, and each subprocess is killed after 90 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

EPOCHS = 3
STEPS = EPOCHS * 45  # 1437 train digits in batches of 32


def _run(command: list[str], limit: float = 90) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{command[:6]} did not end within {limit} s:\n{(e.stdout or '')[-3000:]}"
                    f"\n{(e.stderr or '')[-3000:]}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _train(out: str, *, processes: int) -> subprocess.CompletedProcess:
    train = [sys.executable, "-m", "funcgrad", "train", "--epochs", str(EPOCHS), "--seed", "3",
             "--out", out, "--no-progress", "--clip-norm", "1.0"]
    if processes == 1:
        return _run(train)
    return _run([sys.executable, "-m", "funcgrad", "launch", "-n", str(processes),
                 "--timeout", "60", "--init-timeout", "20", "--grace", "2", "--",
                 *train, "--distributed"])


def _checkpointed(out: str) -> dict[str, np.ndarray]:
    """The arrays of the run's final checkpoint, by their TrainState path."""
    import jax
    import orbax.checkpoint as ocp

    folder = os.path.join(out, "checkpoints", str(STEPS))
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


def test_two_processes_train_like_one(tmp_path):
    start = time.perf_counter()
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _train(one, processes=1)
    done = _train(two, processes=2)
    seconds = time.perf_counter() - start
    assert "data-parallel over 2 devices of 2 processes" in done.stdout
    # Only process 0 reports: its lines carry "[0] "; process 1 prints no epoch lines.
    assert "[0] epoch   3" in done.stdout and "[1] epoch" not in done.stdout
    with open(os.path.join(one, "metrics.json")) as f:
        m1 = json.load(f)
    with open(os.path.join(two, "metrics.json")) as f:
        m2 = json.load(f)
    assert m2["config"]["distributed"] is True
    accuracy = [[row["eval/test_accuracy"] for row in m["epochs"]] for m in (m1, m2)]
    assert accuracy[0] == accuracy[1], accuracy
    np.testing.assert_allclose(m1["steps"]["loss"], m2["steps"]["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["steps"]["grad_norm"], m2["steps"]["grad_norm"], rtol=1e-5,
                               atol=1e-6)
    # The params (and the whole state) of the final checkpoints, written by orbax from the
    # replicated state of both processes.
    s1, s2 = _checkpointed(one), _checkpointed(two)
    assert s1.keys() == s2.keys()
    params = [k for k in s1 if k.startswith("state.params")]
    scale = max(float(np.max(np.abs(s1[k]))) for k in params)
    # Each step's gradient equals the one-device one to 1e-6·max|g| (test_distributed.py
    # asserts that step by step); over 135 Adam steps the params drift further apart than one
    # step's rounding, because Adam divides each element's moment by sqrt(v) + 1e-8, so an
    # element whose gradient is near 0 turns a 1e-7 gradient difference into a larger update
    # difference. Measured: 9.2e-7 = 1.9e-6·max|p| (jax 0.12.0.1), under 1e-6·max|p| (0.10.2);
    # allowed: 1e-5·max|p|, still far below one update (lr = 1e-3).
    for k in params:
        assert np.max(np.abs(s1[k].astype(np.float64) - s2[k])) <= 1e-5 * scale, k
    assert int(s2["state.step"]) == STEPS
    assert seconds < 150
