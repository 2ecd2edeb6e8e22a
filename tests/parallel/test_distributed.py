"""Data parallelism across processes, the real engine: ``funcgrad launch -n 2`` runs
tests/parallel/_worker.py as two processes of one jax.distributed run (one CPU device each,
gloo collectives). Each compares the mesh step with the one-device step on the same global
batch, computed in the same process without any collective (the second method).

Nothing here can hang, and nothing fails for being slow: _run.launch stops a run whose
processes stop computing (under 1 s of CPU in 120 s: a deadlock waits on a socket or a
barrier) and reports their output; the worker initializes with a 120 s heartbeat and a 10 s
shutdown timeout (a process left behind fails in seconds). Each run picks a free port (the
OS binds port 0), so xdist workers do not clash.
"""
from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _run import launch  # noqa: E402

#: The issue's bound: |g_mesh - g_one| <= 1e-6 * max|g| (float32).
TOL = 1e-6


def _same_on_every_process(results: list[dict], key: str) -> None:
    fingerprints = [r[key] for r in results]
    assert len(set(fingerprints)) == 1, fingerprints


def _check_rows(rows: list[dict], tol: float = TOL) -> None:
    """`tol`: float32's agreement, or a bfloat16 step's (its spacing, 2**-7, where the
    devices' partial sums are rounded to bfloat16 before they are added)."""
    for i, row in enumerate(rows):
        assert row["grad_err"] <= tol, (i, row)
        assert row["param_err"] <= tol * max(1.0, row.get("max_p", 1.0)), (i, row)
        assert row["skipped"][0] == row["skipped"][1], (i, row)
        a, b = row["loss"]
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol * max(1, abs(a)), row
        a, b = row["grad_norm"]
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol * max(1, abs(a)), row
        assert row["model_state_err"] <= tol, (i, row)
        if "monitor_err" in row:
            assert row["monitor_err"] <= 1e-5, (i, row)
        if row["key_same"] is not None:
            assert row["key_same"], (i, row)


def test_step_equals_one_device_step_and_communicates_once():
    results, seconds = launch("step")
    r = results[0]
    assert r["processes"] == 2 and r["devices"] == 2
    # Clipping (0.5 < every step's norm), the monitor, the guard (a NaN row on process 1).
    rows = r["clip_monitor_guard"]
    _check_rows(rows)
    assert [row["skipped"][0] for row in rows] == [0, 0, 1, 0]
    assert all(row["grad_norm"][0] > 0.5 for row in rows if row["skipped"][0] == 0)
    # A masked token mean with 24 real tokens on process 0 and 4 on process 1, layer 0 frozen.
    _check_rows(r["token_weighted_frozen"])
    assert r["mean_of_means_err"] > 0.1  # what a mean of per-process means would be off by
    for key in ("clip_monitor_guard/fingerprint", "token_weighted_frozen/fingerprint"):
        _same_on_every_process(results, key)
    # One all-reduce carries every parameter's gradient (one fused tuple: each parameter's
    # element count among its arrays; XLA may hold a matrix's gradient transposed); no
    # all-gather at all (the params stay replicated).
    sizes = sorted(_elements(s) for s in r["param_shapes"])
    carrying = [c for c in r["collectives"] if c["kind"] == "all-reduce"
                and _contains(sorted(_elements(s) for s in c["shapes"]), sizes)]
    assert len(carrying) == 1 and not carrying[0]["in_loop"], r["collectives"]
    assert [c["kind"] for c in r["collectives"] if c["kind"] != "all-reduce"] == []
    assert carrying[0]["bytes"] >= 4 * sum(sizes)


def _elements(shape: str) -> int:
    """The element count of an HLO array type such as "f32[32,10]"."""
    dims = shape[shape.index("[") + 1:-1]
    return math.prod(int(d) for d in dims.split(",") if d)


def _contains(have: list[int], want: list[int]) -> bool:
    """Whether the multiset `have` contains the multiset `want`."""
    rest = list(have)
    for w in want:
        if w not in rest:
            return False
        rest.remove(w)
    return True


def _gradient_all_reduces(collectives: list[dict]) -> list[dict]:
    """The all-reduces carrying the gradient (tuples of several arrays)."""
    return [c for c in collectives if c["kind"] == "all-reduce" and len(c["shapes"]) > 1]


def test_accumulation_over_devices_equals_the_full_batch():
    results, _ = launch("accumulate")
    r = results[0]
    for row in r["accumulate"]:
        assert row["grad_err"] <= TOL and row["param_err"] <= TOL, row
        assert abs(row["loss"][0] - row["loss"][1]) <= 1e-6 * abs(row["loss"][0]), row
    assert r["accumulate"][0]["full_batch_err"] <= TOL
    # One update per call: the devices accumulate their own rows and sum once, after the
    # micro-batches (not inside the scan over them): one all-reduce, outside any loop, of the
    # 4 gradients, the loss sum and the example count, and nothing else.
    (grads,) = _gradient_all_reduces(r["collectives"])
    assert grads["loop_depth"] == 0 and len(grads["shapes"]) == 6, r["collectives"]
    assert [c["kind"] for c in r["collectives"]] == ["all-reduce"], r["collectives"]
    # 2 updates and a partial group, the devices holding different numbers of real rows:
    # still the one-device step's numbers (the example counts too: 12, 16 and 4 per update
    # with 2 processes); one all-reduce per update: in the loop over the groups (depth 1)
    # and once for the partial group (depth 0); none inside the loop over micro-batches.
    masked = r["accumulate_masked"]
    assert masked["grad_err"] <= TOL and masked["param_err"] <= TOL, masked
    assert masked["examples"][0] == masked["examples"][1]
    for how, got in r["accumulate_microbatches"].items():
        assert got["grad_err"] <= TOL and got["param_err"] <= TOL, (how, got)
        assert got["examples"][0] == got["examples"][1], (how, got)
    depths = sorted(c["loop_depth"] for c in _gradient_all_reduces(r["collectives_masked"]))
    assert depths == [0, 1], r["collectives_masked"]
    # BatchNorm under accumulation: the gradient of each device normalising its own rows, the
    # model state the mean of the devices' (which differ: the spread is not 0).
    bn = r["accumulate_bn"]
    assert bn["grad_err"] <= TOL and bn["skipped"] == 0, bn
    assert bn["model_state_err"] <= 1e-6 * bn["max_state"] < bn["state_spread"], bn


def test_zero1_sharded_optimizer_state_equals_one_device():
    results, _ = launch("zero")
    for r in results:
        for i, row in enumerate(r["zero"]):
            assert row["grad_err"] <= TOL, (i, row)
            assert row["param_err"] <= TOL * row["max_p"] and row["opt_state_err"] <= TOL, row
            assert row["skipped"] == ([1, 1] if i == 2 else [0, 0]), row
        assert r["zero_accumulate"]["param_err"] <= TOL, r["zero_accumulate"]
        assert r["zero_accumulate"]["opt_state_err"] <= TOL, r["zero_accumulate"]
        # Each process holds half of each moment (rows of a (16, 32) weight, half of a (10,)
        # bias) and all of the params.
        shards = r["zero_shards"]
        assert shards == {"w0": [[16, 32], [8, 32]], "b1": [[10], [5]],
                          "params_w0": [16, 32]}, shards
    # The pair: one all-reduce of the gradients (4 leaves and the loss), then an all-gather of
    # each sharded update (the new params' 3,616 bytes = (16*32 + 32 + 32*10 + 10) * 4),
    # nothing else.
    report = results[0]["zero_collectives"]
    (grads,) = _gradient_all_reduces(report)
    assert len(grads["shapes"]) == 5 and grads["bytes"] == 3500, report
    gathers = [c for c in report if c["kind"] == "all-gather"]
    assert sum(c["bytes"] for c in gathers) == 4 * (16 * 32 + 32 + 32 * 10 + 10), report
    assert len(report) == 1 + len(gathers), report
    assert "step.place_state(state)" in results[0]["zero_unplaced"]


def test_model_state_keys_and_loss_scale_equal_one_device():
    results, _ = launch("state_keys_scale")
    rows = results[0]["bn_dropout_loss_scale"]
    # Computed in bfloat16 (a loss scale needs a half dtype): each device's partial gradient
    # is rounded to bfloat16 (spacing 2**-7) before the sum, and BatchNorm's statistics too;
    # measured 0.0105 of the largest gradient on jax 0.12.1. A wrong gradient is off by O(1).
    _check_rows(rows, tol=2.0**-5)
    # Step 1's gradients overflow at the scale 2**127: both skip it and back the scale off.
    assert rows[1]["skipped"] == [1, 1]
    assert [row["loss_scale"][0] == row["loss_scale"][1] for row in rows] == [True] * 4
    assert rows[2]["loss_scale"][0] < rows[0]["loss_scale"][0]
    _same_on_every_process(results, "bn_dropout_loss_scale/fingerprint")


def test_shard_map_and_pmap_user_code_get_the_1x_gradient():
    results, _ = launch("mapped")
    r = results[0]
    assert r["shard_map_err"] <= TOL and r["pmap_err"] <= TOL, r
    assert abs(r["shard_map_loss"][0] - r["shard_map_loss"][1]) <= 1e-6
    # The one-device habit (grad of the local mean, then pmean) under shard_map: about N x
    # (not exactly 2: the two processes hold 4 and 2 real rows, and means of means differ).
    assert 1.5 < r["shard_map_naive_ratio"] < 2.5, r
    # The habits of docs/guide/distributed.md's table, every row real (N = 2): the gradient's
    # size over the right one.
    for results_of in results:
        got = {k.split("/", 1)[1]: round(v, 6) for k, v in results_of.items()
               if k.startswith("habit/")}
        per_device = got.pop("pmap/grad_of_psum_loss")
        assert got == {"shard_map/mean_then_pmean": 2.0, "pmap/mean_then_pmean": 1.0,
                       "shard_map/mean_then_psum": 4.0, "pmap/mean_then_psum": 2.0,
                       "shard_map/grad_of_psum_loss": 1.0,
                       "shard_map/grad_of_psum_loss_then_pmean": 1.0,
                       "pmap/grad_of_psum_loss_then_pmean": 1.0}, got
        assert per_device != 1.0  # N x this device's own share: differs per device
    assert (results[0]["habit/pmap/grad_of_psum_loss"]
            != results[1]["habit/pmap/grad_of_psum_loss"])


def test_bad_input_fails_clearly_before_any_collective():
    results, _ = launch("bad")
    for r in results:
        e = r["errors"]
        assert "shards are swapped" in e["swapped"] and "fg.process_rows" in e["swapped"]
        assert "rows per process {0: 4, 1: 5}" in e["shapes"]
        assert "processes hold different values for tree[0]['w']" in e["params"]
        assert "fg.process_batch" in e["numpy_batch"]
        # A process's own jax.Array: JAX would silently mix the processes' rows.
        assert ("batch['x'] is a jax.Array on this process's devices only" in
                e["local_jax_array"] and "fg.process_batch(local_rows" in e["local_jax_array"])
        for key in ("indivisible", "shard_batch"):
            assert "5 rows does not divide among the 2 devices" in e[key]
            assert "Pad it to 6 rows" in e[key]
        for key in ("fit_own_half", "fit_own_order", "fit_lengths"):
            assert "fit: the processes passed different data (the leaves ['x', 'y'] differ" \
                in e[key], e.get(key)
            assert "pass a loader that yields this process's rows" in e[key]
        assert "process 0: x (16, 3) float32" in e["fit_lengths"]
        assert "process 1: x (14, 3) float32" in e["fit_lengths"]
        assert r["fit_good_steps"] == 4


def test_processes_running_different_step_counts_fail_instead_of_hanging():
    done, seconds = launch("uneven", failing=True)
    # It ends (a hang fails in _run's watchdog) with an error: the 10 s shutdown barrier.
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "[1] process 1 finished its steps" in done.stdout
    assert "[0] process 0 finished its steps" not in done.stdout
    assert "Shutdown barrier" in done.stderr or "barrier" in done.stderr.lower(), \
        done.stderr[-3000:]


@pytest.mark.parametrize("n", [1, 3, 4])
def test_other_process_counts(n):
    results, _ = launch("smoke", n=n)
    assert len(results) == n and results[0]["devices"] == n
    _check_rows(results[0]["smoke"])
    _same_on_every_process(results, "smoke/fingerprint")
    assert all(r["loss_replicated"] for r in results)
    # float() works on every process, and reads the mesh step's first loss again.
    assert results[0]["host_loss"] == pytest.approx(results[0]["smoke"][0]["loss"][1], rel=1e-6)


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(u - v) <= tol * max(1.0, abs(u)) for u, v in zip(a, b))


def test_fit_with_the_mesh_step_equals_one_device_fit():
    """`fit` runs the mesh step in chunks (the batch's rows split over the processes, the
    state replicated) and ends where one-device `fit` on the same global order ends: params
    within 1e-6·max|p|, the same per-step losses and norms, the same epoch rows."""
    results, seconds = launch("fit")
    for r in results:
        for name in ("optimistic", "guarded_per_epoch"):
            run = r[name]
            assert run["chunked"], run
            assert "spec=P()" in run["sharding"], run["sharding"]
            assert run["steps"][0] == run["steps"][1] == 3 * 45, run["steps"]
            assert run["param_err"] <= TOL * max(1.0, run["max_p"]), run["param_err"]
            # The rows are split: each device differentiates its own, and one all-reduce per
            # step sums the gradients (inside the chunk's loop); nothing is all-gathered.
            kinds = [(c["kind"], c["in_loop"]) for c in run["collectives"]]
            assert ("all-reduce", True) in kinds, kinds
            assert not any(k == "all-gather" for k, _ in kinds), kinds
            one, many = run["one"], run["mesh"]
            assert _close(one["step_loss"], many["step_loss"])
            assert _close(one["grad_norm"], many["grad_norm"])
            assert one["skipped"] == many["skipped"]
            assert len(one["epochs"]) == len(many["epochs"]) == 3
            for a, b in zip(one["epochs"], many["epochs"]):
                assert a.keys() == b.keys()
                assert _close([v for v in a.values() if isinstance(v, float)],
                              [v for v in b.values() if isinstance(v, float)]), (a, b)
    for name in ("optimistic/fingerprint", "guarded_per_epoch/fingerprint"):
        _same_on_every_process(results, name)


def test_checkpoint_and_resume_of_a_mesh_run_is_bit_identical():
    """Both processes save the replicated state with orbax into one folder; 2 epochs, then a
    resumed run to 4, ends bit for bit where 4 epochs without stopping end."""
    results, seconds = launch("resume")
    for r in results:
        run = r["resume"]
        assert run["steps"] == [4 * 45, 4 * 45, 2 * 45], run
        assert run["bitwise"] and run["history_same"], run
        assert "spec=P()" in run["sharding"], run
        assert "90" in run["saved"] and "180" in run["saved"], run


def _same_steps(one: list[float], many: list[float], tol: float = 1e-6) -> bool:
    return len(one) == len(many) and all(abs(a - b) <= tol * max(1.0, abs(a))
                                         for a, b in zip(one, many))


def _check_loader_run(results: list[dict], name: str, steps: int) -> None:
    """Process 0's one-device fit on the global batches against the 2-process fit whose
    loaders yield each process's rows: params, per-step losses and norms, epoch rows."""
    run = results[0][name]
    assert run["steps"] == [steps, steps], run["steps"]
    assert run["param_err"] <= TOL * max(1.0, run["max_p"]), run["param_err"]
    one, many = run["one"], run["mesh"]
    assert _same_steps(one["step_loss"], many["step_loss"])
    assert _same_steps(one["grad_norm"], many["grad_norm"], 1e-5)
    assert one["skipped"] == many["skipped"] == []
    assert len(one["epochs"]) == len(many["epochs"]) == 2
    for a, b in zip(one["epochs"], many["epochs"]):
        assert a.keys() == b.keys() and any(k.startswith("eval/") for k in a), (a, b)
        assert _close([v for v in a.values() if isinstance(v, float)],
                      [v for v in b.values() if isinstance(v, float)], 1e-6), (a, b)
    assert "spec=P()" in run["sharding"], run["sharding"]
    for r in results:  # every process ends with the same history and params
        assert r[name]["mesh"] == many
    _same_on_every_process(results, name + "/fingerprint")


def test_fit_with_per_process_loaders_equals_one_device_fit():
    """Each process's loader yields its own half of every global batch (420 digits in
    batches of 32: 13 of 16 + 16 rows and a last of 2 + 2); fit assembles the global batches
    per chunk and ends where one-device fit on the global batches ends. An evaluation split
    on every process; 1 epoch checkpointed and resumed to 2 ends bit for bit the same."""
    results, seconds = launch("fit_loader")
    import funcgrad  # the copy under test: the checkout, or the installed package

    assert results[0]["funcgrad"] == funcgrad.__file__, results[0]["funcgrad"]
    _check_loader_run(results, "plain", 2 * 14)
    for r in results:
        assert r["resume"] == {"bitwise": True, "steps": 2 * 14, "history_same": True}


def test_fit_with_per_process_loaders_and_accumulation():
    """accumulate=2 with a loader per process yielding its rows of every micro-batch (420
    digits in micro-batches of 16: 26 of 8 + 8 rows and a last of 2 + 2, so the last group
    is one micro-batch padded on each process), and an evaluation function."""
    results, seconds = launch("fit_loader_accumulate")
    _check_loader_run(results, "accumulate", 2 * 14)


def test_disagreeing_per_process_loaders_fail_at_once_on_every_process():
    """Loaders that yield other counts, rows or dtypes on one process: fit raises the same
    ValueError on every process, naming the fix, within seconds (before a collective of the
    step could wait for a batch that never comes); the processes stay in step after it. A NaN
    in one process's rows stops both at that step."""
    results, seconds = launch("fit_loader_bad")
    for r in results:
        e = r["errors"]
        assert e.keys() == {"fewer_batches", "dtype", "rows", "fewer_microbatches"}, e
        assert e == results[0]["errors"]  # the same words everywhere
        for text in e.values():
            assert "the processes' loaders disagree in epoch 1" in text
            assert "fg.process_rows(B, mesh)" in text and "drop_last=True" in text
        assert ("process 0: 6 batches (x (4, 16) float32, y (4,) int32), then its epoch "
                "ends; process 1: 5 batches" in e["fewer_batches"])
        assert ("process 1: 2 batches (x (4, 16) float32, y (4,) int32), then one of "
                "(x (4, 16) float64, y (4,) int32)" in e["dtype"]), e["dtype"]
        assert "process 1: 1 batch (x (5, 16) float32" in e["rows"], e["rows"]
        assert "group of micro-batches (data/x (2, 4, 16)" in e["fewer_microbatches"]
        assert "(data/x (1, 4, 16)" in e["fewer_microbatches"]
        assert r["good_steps"] == 6
        assert r["nonfinite"] == {"step": 3, "batch": 3, "state_step": 3, "finite": True}
        # Adam with eps=0 and a leaf u the loss never uses: u's update is 0/0 at step 0
        # while the loss (finite digits-like data) and the gradient are finite.
        update = r["update"]
        assert update["step"] == 0 and update["state_step"] == 0, update
        assert math.isfinite(update["loss"]), update
        assert "params['u']" in update["text"] and "holds NaN/inf" in update["text"], update
        assert "params['mlp']" not in update["text"], update


def test_fit_with_zero1_equals_one_device_fit_and_resumes_bit_for_bit():
    results, seconds = launch("fit_zero")
    for r in results:
        run = r["fit_zero"]
        assert run["param_err"] <= TOL * max(1.0, run["max_p"]), run
        assert run["opt_state_err"] <= TOL, run
        assert _same_steps(*run["losses"]), run["losses"]
        assert len(run["losses"][0]) == 2 * 14  # 2 epochs of 420 digits in batches of 32
        # Each process holds half of the (64, 32) weight's first moment, also after a resume
        # from the orbax checkpoint of the split state.
        assert run["mu_shard"] == run["resumed_mu_shard"] == [32, 32], run
        assert run["bitwise"] and run["history_same"], run
