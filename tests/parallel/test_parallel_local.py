"""funcgrad.parallel in this process: the errors that come before any collective, a one-device
mesh (no collective exists), the HLO parser, and the collectives of a step compiled for 4
simulated CPU devices.

Why the simulated-device test is safe: XLA:CPU's in-process all-reduce rendezvous can stall
when collectives of back-to-back steps run on simulated devices (measured on jax 0.10.2, see
issue 27). This test only lowers and compiles the step and reads its HLO text; it never
executes the program, so no rendezvous is ever entered. It runs in a subprocess because the
device count is fixed when JAX's backend starts (XLA_FLAGS), with a hard timeout anyway.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import funcgrad as fg
from funcgrad.parallel.collectives import parse_collectives
from funcgrad.parallel.zero import opt_state_spec


def _loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _setup(rows=8):
    params = fg.mlp_init(jax.random.key(0), (6, 5, 3))
    tx = optax.adam(1e-2)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(rows, 6)).astype(np.float32),
             "y": rng.integers(0, 3, size=rows).astype(np.int32)}
    return params, tx, batch


def test_one_device_mesh_step_is_the_plain_step():
    params, tx, batch = _setup()
    tx = optax.chain(fg.grad_monitor(), fg.clip_by_global_norm(0.1), tx)
    plain = fg.make_train_step(_loss, tx)
    state = plain.init(params)
    mesh = fg.data_mesh()
    meshed = fg.data_parallel(fg.make_train_step(_loss, tx), mesh)
    assert meshed.mesh is mesh and meshed.data_axis == "data" and plain.mesh is None
    s1, s2 = state, fg.replicate(state, mesh)
    for _ in range(3):
        s1, m1 = plain(s1, batch)
        s2, m2 = meshed(s2, fg.shard_batch(batch, mesh))
        np.testing.assert_array_equal(m1["loss"], m2["loss"])
        np.testing.assert_array_equal(m1["grad_norm"], m2["grad_norm"])
        assert m2["monitor"].values is not None
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_array_equal(a, b)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(s2.params))
    assert len(fg.collectives(meshed, s2, batch)) == 0  # one device: nothing to communicate


def test_mesh_errors_name_the_fix():
    _, tx, _ = _setup()
    devices = np.array(jax.devices()[:1])
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        fg.data_parallel(fg.make_train_step(_loss, tx), jax.devices())
    other = jax.sharding.Mesh(devices, ("batch",))
    with pytest.raises(ValueError, match=r"axes \('batch',\) and no data axis 'data'.*"
                                         r"data_axis="):
        fg.data_parallel(fg.make_train_step(_loss, tx), other)
    assert fg.data_parallel(fg.make_train_step(_loss, tx), other,
                            data_axis="batch").data_axis == "batch"
    explicit = jax.sharding.Mesh(devices, ("data",),
                                 axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match="Explicit.*fg.data_mesh"):
        fg.data_parallel(fg.make_train_step(_loss, tx), explicit)
    with pytest.raises(ValueError, match="jit=False"):
        fg.data_parallel(fg.make_train_step(_loss, tx, jit=False), fg.data_mesh())
    with pytest.raises(ValueError, match="detect_anomaly"):
        fg.data_parallel(fg.detect_anomaly(fg.make_train_step(_loss, tx)), fg.data_mesh())
    with pytest.raises(TypeError, match=r"shard_opt_state= is no longer a keyword; wrap the "
                                        r"step: funcgrad\.data_parallel\(step, mesh, "
                                        r"shard_opt_state=True\)"):
        fg.make_train_step(_loss, tx, shard_opt_state=True)
    with pytest.raises(ValueError, match="already data-parallel"):
        fg.data_parallel(fg.data_parallel(fg.make_train_step(_loss, tx), fg.data_mesh()),
                         fg.data_mesh())
    with pytest.raises(TypeError, match="expected a TrainStep"):
        fg.data_parallel(_loss, fg.data_mesh())


@pytest.mark.parametrize("shape, size, spec", [
    ((64, 32), 4, P("data")), ((10, 32), 4, P(None, "data")), ((10,), 4, P()), ((), 4, P()),
    ((3, 5), 2, P()), ((2, 8), 4, P(None, "data")), ((64, 32), 1, P())])
def test_zero1_splits_the_first_axis_that_divides(shape, size, spec):
    # A (10, 32) leaf on 4 devices: 10 does not divide, 32 does; (2, 8): 2 < 4 devices.
    assert opt_state_spec(shape, size, "data") == spec


def test_zero1_on_one_device_is_the_plain_step():
    params, tx, batch = _setup()
    tx = optax.chain(fg.clip_by_global_norm(0.1), tx)
    plain = fg.make_train_step(_loss, tx)
    state = plain.init(params)
    zero = fg.data_parallel(fg.make_train_step(_loss, tx), fg.data_mesh(),
                            shard_opt_state=True)
    assert zero.shard_opt_state and not plain.shard_opt_state
    s1, s2 = state, zero.place_state(state)
    assert zero.place_state(s2) is s2  # placed already: as is
    for _ in range(3):
        s1, _ = plain(s1, batch)
        s2, _ = zero(s2, batch)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_array_equal(a, b)


def test_batch_errors_and_placement_in_one_process():
    params, tx, batch = _setup()
    mesh = fg.data_mesh()
    with pytest.raises(ValueError, match=r"batch\['t'\] has shape \(\), with no row axis"):
        fg.shard_batch({"x": batch["x"], "t": np.float32(1)}, mesh)
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        fg.shard_batch({"x": batch["x"], "y": batch["y"][:3]}, mesh)
    assert fg.process_rows(8, mesh) == slice(0, 8)
    got = fg.process_batch(batch, mesh, rows=slice(0, 8))
    np.testing.assert_array_equal(got["x"], batch["x"])
    with pytest.raises(ValueError, match="shards are swapped"):
        fg.process_batch(batch, mesh, rows=np.arange(1, 9))
    # Stacked micro-batches: a Microbatches is split along its rows, axis 1 (mask too).
    mbs = fg.stack_microbatches([batch, {k: v[:5] for k, v in batch.items()}])
    placed = fg.shard_batch(mbs, mesh)
    assert isinstance(placed, fg.Microbatches)
    assert placed.mask.sharding.spec == P(None, "data") == placed.data["x"].sharding.spec
    np.testing.assert_array_equal(fg.process_batch(mbs, mesh).mask, mbs.mask)
    step = fg.data_parallel(fg.make_train_step(_loss, tx), mesh)
    with pytest.raises(ValueError, match=r"batch\['t'\] has 0 axes; every leaf of a sharded "
                                         r"batch needs at least 1.*loss's closure"):
        step(step.init(params), {**batch, "t": jnp.float32(1)})


def test_process_agreement_and_global_batches_in_one_process():
    """In one process: gather_from_processes is this process's row (no communication), the
    loaders' agreement check passes, and global_batches is the local rows, rows split over
    the data axis (axis 1 of stacked batches)."""
    from funcgrad.parallel.placement import gather_from_processes
    from funcgrad.train.loop.placement import global_batches, local_batches_agree

    every, texts = gather_from_processes([3, 0, 2**31 - 1], "x (4,) float32")
    assert every.dtype == np.int32 and every.tolist() == [[3, 0, 2**31 - 1]]
    assert texts == ["x (4,) float32"]
    with pytest.raises(ValueError, match="fit in int32"):
        gather_from_processes([2**31])
    _, _, batch = _setup()
    mesh = fg.data_mesh()
    stacked = {k: np.stack([v, v]) for k, v in batch.items()}
    local_batches_agree([batch, batch], True, epoch=1, step=0)
    local_batches_agree([], True, epoch=1, step=0)
    got = global_batches(stacked, mesh, "data", row_axis=1)
    np.testing.assert_array_equal(got["x"], stacked["x"])
    assert got["y"].sharding.spec == jax.sharding.PartitionSpec(None, "data")


def test_replicate_keeps_placed_leaves_and_typed_keys():
    params, tx, _ = _setup()
    mesh = fg.data_mesh()
    keyed = fg.make_train_step(fg.Loss(lambda p, b, *, key: _loss(p, b), takes_key=True), tx)
    state = keyed.init(params, seed=3)
    placed = fg.replicate(state, mesh)
    again = fg.replicate(placed, mesh)
    assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(again)))
    assert jax.dtypes.issubdtype(placed.key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(placed.key), jax.random.key_data(state.key))


# A program with the shapes XLA prints: a fused tuple all-reduce in the entry, an async
# all-gather pair, and an all-reduce in a while body (plus a computation it calls).
HLO = """HloModule jit_step, entry_computation_layout={(f32[4,3]{1,0})->f32[4,3]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%inner.3 (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %all-reduce.9 = f32[8]{0} all-reduce(%p), channel_id=4, replica_groups={{0,1}}, \
to_apply=%add
}

%body.7 (arg: (s32[], f32[8])) -> (s32[], f32[8]) {
  %all-reduce.2 = f32[8]{0} all-reduce(%g), channel_id=3, replica_groups={{0,1}}, \
to_apply=%add
  %call.1 = f32[8]{0} call(%all-reduce.2), to_apply=%inner.3
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %call.1)
}

ENTRY %main.42 (Arg_0.1: f32[4,3], /*index=1*/Arg_1.2: f32[3]) -> (f32[4,3], f32[3]) {
  %all-reduce.5 = (f32[4,3]{1,0}, f32[3]{0}, f32[]) all-reduce(%a, %b, %c), channel_id=1, \
replica_groups=[1,2]<=[2], use_global_device_ids=true, to_apply=%add
  %all-gather-start = ((f32[2,3]{1,0}), f32[4,3]{1,0}) all-gather-start(%d), channel_id=2, \
replica_groups={{0,1}}, dimensions={0}
  %all-gather-done = f32[4,3]{1,0} all-gather-done(%all-gather-start)
  %while.1 = (s32[], f32[8]{0}) while(%init), condition=%cond.6, body=%body.7
  ROOT %r = (f32[4,3]{1,0}, f32[3]{0}) tuple(%x, %y)
}
"""


def test_parse_collectives():
    report = parse_collectives(HLO)
    assert [(c.kind, c.name) for c in report] == [
        ("all-reduce", "all-reduce.9"), ("all-reduce", "all-reduce.2"),
        ("all-reduce", "all-reduce.5"), ("all-gather", "all-gather-start")]
    inner, body, fused, gather = report
    assert fused.shapes == ("f32[4,3]", "f32[3]", "f32[]") and fused.bytes == 4 * (12 + 3 + 1)
    assert fused.computation == "main.42" and not fused.in_loop
    assert fused.replica_groups == "[1,2]<=[2]" and fused.group_size == 2
    assert inner.group_size == 2  # {{0,1}}
    assert gather.shapes == ("f32[4,3]",) and gather.bytes == 48  # the done's result
    assert body.in_loop and body.computation == "body.7" and inner.in_loop
    # A while body is one loop deep, and so is what it calls (a call is not a loop).
    assert (fused.loop_depth, body.loop_depth, inner.loop_depth) == (0, 1, 1)
    assert report.count("all-reduce") == 3 and report.count("all-gather") == 1
    assert report.bytes == 32 + 32 + 64 + 48
    text = str(report)
    assert text.startswith("collectives: 4 (3 all-reduce, 1 all-gather), 176 bytes")
    assert "(in a loop: once per iteration)" in text
    assert json.loads(json.dumps(report.to_dict()))[2]["shapes"] == list(fused.shapes)
    assert str(parse_collectives("")).startswith("collectives: none")
    with pytest.raises(TypeError, match="jitted function"):
        fg.collectives(lambda x: x)


@pytest.mark.parametrize("groups, size", [
    ("{{0,1,2,3}}", 4), ("{{0,1},{2,3}}", 2), ("[2,4]<=[8]", 4),
    ("mesh['axis_0'=4] {'axis_0'}", 4), ("mesh['axis_0'=4,'axis_1'=1] {'axis_0'}", 4),
    ("mesh['data'=2,'model'=4] {'data','model'}", 8), ("mesh['data'=2,'model'=4] {'model'}", 4),
    ("{}", None), ("", None)])
def test_group_size_in_each_form_xla_writes(groups, size):
    hlo = ("HloModule m\n\nENTRY %main.1 (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n"
           f"  ROOT %all-reduce.1 = f32[8]{{0}} all-reduce(%p), replica_groups={groups}, "
           "to_apply=%add\n}\n")
    (row,) = parse_collectives(hlo)
    assert row.replica_groups == groups and row.group_size == size


SIMULATED = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np, optax, funcgrad as fg
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    loss = lambda p, b: fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])
    tx = optax.adam(1e-3)
    mesh = fg.data_mesh()
    clipped = optax.chain(fg.clip_by_global_norm(1.0), tx)
    step = fg.data_parallel(fg.make_train_step(loss, clipped), mesh)
    state = step.init(params)
    batch = {"x": jax.ShapeDtypeStruct((32, 64), np.float32),
             "y": jax.ShapeDtypeStruct((32,), np.int32)}
    out = {"report": fg.collectives(step, state, batch).to_dict(),
           "memory": str(fg.memory_report(step, state, batch))}
    try:  # the divisibility error comes at trace time: still nothing runs
        step.lower(state, {"x": jax.ShapeDtypeStruct((30, 64), np.float32),
                           "y": jax.ShapeDtypeStruct((30,), np.int32)})
    except ValueError as e:
        out["indivisible"] = str(e)
    # Accumulating, 4 updates of 4 micro-batches in one call: rows split over the devices.
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
    per_example = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        fg.mlp_apply(p, b["x"]), b["y"])
    accumulating = fg.data_parallel(fg.make_train_step(fg.accumulate(per_example, 4), tx),
                                    mesh)
    stacked = {"x": jax.ShapeDtypeStruct((16, 8, 64), np.float32, sharding=rows),
               "y": jax.ShapeDtypeStruct((16, 8), np.int32, sharding=rows)}
    out["accumulating"] = fg.collectives(accumulating, accumulating.init(params),
                                         stacked).to_dict()
    # ZeRO-1: the compiled step's argument bytes per device, with and without.
    zero = fg.data_parallel(fg.make_train_step(loss, clipped), mesh, shard_opt_state=True)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          jax.eval_shape(lambda s: s, state), zero.state_shardings(state))
    out["zero"] = fg.collectives(zero, placed, batch).to_dict()
    out["argument_bytes"] = [
        s.lower(st, batch).compile().memory_analysis().argument_size_in_bytes
        for s, st in ((step, state), (zero, placed))]
    print("RESULT " + json.dumps(out))
""")


def test_collectives_of_a_step_compiled_for_four_simulated_devices():
    done = subprocess.run([sys.executable, "-c", SIMULATED], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("RESULT ", 1)[1])
    report = out["report"]
    assert [c["kind"] for c in report] == ["all-reduce"], report
    (grads,) = report
    # The 4 gradients (w and b of 2 layers) and the loss's global sum, in one tuple.
    assert grads["bytes"] == 4 * (64 * 32 + 32 + 32 * 10 + 10 + 1)
    assert len(grads["shapes"]) == 5 and not grads["in_loop"]
    # Over all 4 devices, however XLA writes the groups ("mesh['axis_0'=4] {'axis_0'}",
    # "mesh['axis_0'=4,'axis_1'=1] {'axis_0'}", "mesh['data'=4] {'data'}", "{{0,1,2,3}}").
    assert grads["group_size"] == 4, grads["replica_groups"]
    assert "collectives: 1 (1 all-reduce), 9,644 bytes" in out["memory"]
    assert "30 rows does not divide among the 4 devices" in out["indivisible"]
    assert "Pad it to 32 rows" in out["indivisible"]
    # Under accumulation: one all-reduce per update, in the loop over the 4 updates (depth 1),
    # of the gradients, the loss sum and the example count; none per micro-batch (depth 2),
    # where summing each micro-batch's partial gradients over the devices would put it.
    (acc,) = out["accumulating"]
    assert acc["kind"] == "all-reduce" and acc["loop_depth"] == 1, out["accumulating"]
    assert acc["bytes"] == 4 * (64 * 32 + 32 + 32 * 10 + 10 + 1 + 1)
    # ZeRO-1 on 4 devices: Adam's mu and nu of w0 (64, 32), b0 (32,) and w1 (32, 10) split in
    # 4 (the (10,) bias does not divide: replicated), so each device holds 3/4 less of them:
    # 2 moments * (2048 + 32 + 320) floats * 4 bytes * 3/4 = 14,400 bytes fewer.
    plain_bytes, zero_bytes = out["argument_bytes"]
    assert plain_bytes - zero_bytes == 2 * (2048 + 32 + 320) * 4 * 3 // 4, out["argument_bytes"]
    # The gradient all-reduce, and one all-gather of each sharded update (1/4 each device's).
    kinds = sorted(c["kind"] for c in out["zero"])
    assert kinds == ["all-gather"] * 3 + ["all-reduce"], out["zero"]
