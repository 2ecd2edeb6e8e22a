"""One process of a multi-process test, started by ``funcgrad launch`` (tests/parallel/_run.py).

``python _worker.py SCENARIO`` initializes jax.distributed from the launcher's environment
(a 10 s shutdown timeout: a process left behind fails in seconds), runs the
scenario and prints one line ``RESULT {json}``. Every comparison has a second method computed
in the same process without any collective: the one-device step (no mesh) on the same global
batch, held whole on this process's own device.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import funcgrad as fg

T0 = time.perf_counter()
# Heartbeats: 120 s. At 10 s a loaded 2-core machine (load 10) starved a process long enough
# that the coordination service declared it dead (1 run in 6 of state_keys_scale): slow is not
# dead. A process that really dies is seen by the launcher at once, and a hung run by
# _run.py's watchdog (its processes stop computing).
INFO = fg.distributed_init(heartbeat_timeout=120, shutdown_timeout=10)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

PID, N = INFO.process_id, INFO.num_processes
MESH = fg.data_mesh()
RESULT: dict = {"process": PID, "processes": N, "devices": len(jax.devices())}


def local(tree):
    """This process's copy of replicated arrays, as NumPy."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = x.addressable_data(0)
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return jax.tree.map(one, tree)


def max_abs(tree) -> float:
    return max((float(np.max(np.abs(x))) for x in jax.tree.leaves(tree) if np.size(x)),
               default=0.0)


def max_diff(a, b) -> float:
    """The largest |a - b| over the leaves; NaN/inf in the same places count as equal."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        if not np.all(same | (np.isfinite(x) & np.isfinite(y))):
            return float("inf")
        if x.size:
            worst = max(worst, float(np.max(np.where(same, 0.0, np.abs(x - y)))))
    return worst


def record_grads() -> optax.GradientTransformation:
    """An optax stage whose state is the last gradient it was given (after clipping): the
    step's gradient, read back exactly."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda updates, state, params=None: (updates, updates))


def global_rows(batch: dict, axis: int = 0) -> dict:
    """This process's rows of a global batch held whole by every process."""
    rows = batch[next(iter(batch))].shape[axis]
    mine = fg.process_rows(rows, MESH)
    index = (slice(None),) * axis + (mine,)
    return {k: np.asarray(v)[index] for k, v in batch.items()}


def compare(name: str, one, many, steps) -> None:
    """Runs `steps` (a list of global batches) through both steps; records per-step errors:
    the recorded gradients relative to max|g|, params, model state, metrics."""
    s1, sm = one[1], fg.replicate(many[1], MESH)
    rows = []
    for batch in steps:
        s1, m1 = one[0](s1, batch)
        sharded = fg.process_batch(global_rows(batch), MESH,
                                   rows=fg.process_rows(len(batch["x"]), MESH))
        sm, mm = many[0](sm, sharded)
        p1, pm = local(s1.params), local(sm.params)
        g1 = local(_recorded(s1.opt_state))
        gm = local(_recorded(sm.opt_state))
        scale = max(max_abs(g1), 1e-30)
        rows.append({
            "grad_err": max_diff(g1, gm) / scale, "max_g": scale,
            "param_err": max_diff(p1, pm), "max_p": max_abs(p1),
            "loss": [float(m1["loss"]), float(local(mm["loss"]))],
            "grad_norm": [float(m1["grad_norm"]), float(local(mm["grad_norm"]))],
            "skipped": [int(m1["skipped"]), int(local(mm["skipped"]))],
            "model_state_err": max_diff(local(s1.model_state), local(sm.model_state)),
            "key_same": bool(np.array_equal(local(s1.key), local(sm.key)))
            if s1.key is not None else None,
        })
        if "monitor" in m1:
            rows[-1]["monitor_err"] = max_diff(local(m1["monitor"].values),
                                               local(mm["monitor"].values))
        if "loss_scale" in m1:
            rows[-1]["loss_scale"] = [float(m1["loss_scale"]), float(local(mm["loss_scale"]))]
    RESULT[name] = rows
    RESULT[name + "/fingerprint"] = float(sum(np.sum(np.asarray(x, np.float64) * (i + 1))
                                              for i, x in enumerate(jax.tree.leaves(
                                                  local(sm.params)))))


#: The states of funcgrad's transformations (fg.grad_monitor, fg.clip_by_global_norm, ...).
_RECORDS = (fg.MonitorState, fg.ClipState, fg.ZeroNonfiniteState)


def _recorded(opt_state):
    """The record_grads stage's state in an ``optax.chain(..., record_grads(), ...)`` state:
    the first that is not a record of funcgrad's transformations (the monitor and the clip
    come before it), also under fg.train_only's partition (frozen leaves are empty nodes
    there: no leaves)."""
    if hasattr(opt_state, "inner_states"):  # optax.partition: the trained part
        opt_state = opt_state.inner_states["trainable"].inner_state
    return next(s for s in opt_state if not isinstance(s, _RECORDS))


def data(rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(rows, 16)).astype(np.float32),
            "y": rng.integers(0, 10, size=rows).astype(np.int32)}


def mlp_loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def _step(loss, tx, mesh=None, shard_opt_state=False, *, has_state=False, takes_key=False,
          compute_dtype=None, loss_scale=None, accumulate=None, **options):
    """A train step from keywords, each scenario's options in one dict: the loss's pieces
    (fg.Loss's flags, fg.mixed_precision, fg.accumulate), make_train_step's own `options`, and
    fg.data_parallel when a mesh is given."""
    if has_state or takes_key:
        loss = fg.Loss(loss, has_state=has_state, takes_key=takes_key)
    if compute_dtype is not None or loss_scale is not None:
        loss = fg.mixed_precision(loss, compute_dtype or "float32", loss_scale=loss_scale)
    if accumulate is not None:
        loss = fg.accumulate(loss, accumulate)
    step = fg.make_train_step(loss, tx, **options)
    return (step if mesh is None
            else fg.data_parallel(step, mesh, shard_opt_state=shard_opt_state))


def both(loss, tx, params, init=None, **options):
    """The one-device step and the mesh step with the same options, and the state the
    one-device step makes for `params` (``step.init(params, **init)``)."""
    one = _step(loss, tx, **options)
    state = one.init(params, **(init or {}))
    return (one, state), (_step(loss, tx, mesh=MESH, **options), state)


def scenario_step() -> None:
    """The plain step with clipping, the monitor and the guard (a NaN in process 1's rows at
    step 2), then a masked token-weighted loss with unequal real tokens per process and a
    frozen layer; then the collectives of the compiled step."""
    params = fg.mlp_init(jax.random.key(0), (16, 32, 10))
    # The monitor sees the gradient, the clip scales it, record_grads keeps the clipped one.
    tx = optax.chain(fg.grad_monitor(), fg.clip_by_global_norm(0.5), record_grads(),
                     optax.adam(1e-2))
    one, many = both(mlp_loss, tx, params)
    state = one[1]
    steps = [data(16, s) for s in range(4)]
    steps[2]["x"][-1, 0] = np.nan  # the last row: process N-1's
    compare("clip_monitor_guard", one, many, steps)
    mesh_step = many[0]

    # Token-weighted: sum of per-token losses over real tokens / number of real tokens.
    def token_loss(params, batch):
        x = batch["x"]
        logits = fg.mlp_apply(params, x.reshape(-1, x.shape[-1])).reshape(*x.shape[:2], -1)
        per = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jnp.sum(per * batch["mask"]) / jnp.sum(batch["mask"])

    rng = np.random.default_rng(7)
    B, T = 8, 6
    mask = np.zeros((B, T), np.float32)
    mask[: B // 2] = 1.0            # process 0's rows: every token real
    mask[B // 2:, :1] = 1.0         # process 1's rows: one real token each
    tokens = [{"x": rng.normal(size=(B, T, 16)).astype(np.float32),
               "y": rng.integers(0, 10, size=(B, T)).astype(np.int32), "mask": mask}
              for _ in range(3)]
    tx2 = optax.chain(record_grads(), optax.sgd(0.1))
    frozen = fg.trainable_mask(params, freeze="0/*")
    one, many = both(token_loss, tx2, params, trainable=frozen)
    compare("token_weighted_frozen", one, many, tokens)
    # The mean of per-process means, which the step must not compute: how far it is.
    g = lambda b: jax.grad(token_loss)(params, b)
    halves = [{k: v[i * B // 2:(i + 1) * B // 2] for k, v in tokens[0].items()} for i in (0, 1)]
    wrong = jax.tree.map(lambda a, b: (a + b) / 2, g(halves[0]), g(halves[1]))
    right = g(tokens[0])
    RESULT["mean_of_means_err"] = max_diff(wrong, right) / max_abs(right)

    batch = fg.process_batch(global_rows(steps[0]), MESH)
    report = fg.collectives(mesh_step, fg.replicate(state, MESH), batch)
    shapes = {f"f32[{','.join(map(str, np.shape(p)))}]" for p in jax.tree.leaves(params)}
    RESULT["collectives"] = report.to_dict()
    RESULT["param_shapes"] = sorted(shapes)


def scenario_smoke() -> None:
    """A short parity run of the plain step and its collectives (the stress script's)."""
    params = fg.mlp_init(jax.random.key(0), (16, 32, 10))
    tx = optax.chain(fg.clip_by_global_norm(0.5), record_grads(), optax.adam(1e-2))
    one, many = both(mlp_loss, tx, params)
    state = one[1]
    compare("smoke", one, many, [data(12, s) for s in range(3)])  # 12 rows: 1 to 4 processes
    # The metrics a user reads on the host: scalars replicated on every process.
    _, metrics = many[0](fg.replicate(state, MESH), fg.process_batch(global_rows(data(12, 0)),
                                                                      MESH))
    RESULT["host_loss"] = float(metrics["loss"])
    RESULT["loss_replicated"] = bool(metrics["loss"].is_fully_replicated)


def _split_rows(stacked: dict) -> dict:
    """Stacked micro-batches ``(M, m, ...)`` held whole by every process, as this process's
    rows of each (axis 1 split over the mesh), one global array per leaf."""
    rows = jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec(None, "data"))
    return {k: jax.make_array_from_process_local_data(rows, v, np.shape(stacked[k]))
            for k, v in global_rows(stacked, axis=1).items()}


def _device_parts(stacked: dict) -> list[dict]:
    """Device d's rows of every micro-batch, for each d (one device per process)."""
    m = next(iter(stacked.values())).shape[1]
    part = m // N
    return [{k: v[:, d * part:(d + 1) * part] for k, v in stacked.items()} for d in range(N)]


def scenario_accumulate() -> None:
    """accumulate=2 over the devices: equal to the one-device accumulating step (one update
    per call; then 2 updates and a partial group, with a mask whose real rows differ per
    device), the first update equal to the full-batch step's; the collectives: one gradient
    all-reduce per update, none per micro-batch. Then BatchNorm under accumulation: each
    device normalises its own rows of a micro-batch, so the second method is the one-device
    step over the devices' parts as micro-batches of their own (gradient) and the mean of each
    device's part run alone (model state)."""
    params = fg.mlp_init(jax.random.key(1), (16, 32, 10))

    def per_example(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            fg.mlp_apply(params, batch["x"]), batch["y"])

    tx = optax.chain(fg.clip_by_global_norm(1.0), record_grads(), optax.sgd(0.1))
    one = fg.make_train_step(fg.accumulate(per_example, 2), tx)
    many = fg.data_parallel(fg.make_train_step(fg.accumulate(per_example, 2), tx), MESH)
    full = fg.make_train_step(lambda p, b: jnp.mean(per_example(p, b)), tx)
    state = one.init(params)
    s1, sm, sf = state, fg.replicate(state, MESH), state

    def row(s1, sm, m1, mm, **extra):
        g1, gm = local(_recorded(s1.opt_state)), local(_recorded(sm.opt_state))
        scale = max_abs(g1)
        return {"grad_err": max_diff(g1, gm) / scale, **extra,
                "param_err": max_diff(local(s1.params), local(sm.params)),
                "loss": [float(np.mean(m1["loss"])), float(np.mean(local(mm["loss"])))],
                "examples": [np.asarray(m1["examples"]).tolist(),
                             np.asarray(local(mm["examples"])).tolist()]}

    rows = []
    for seed in range(3):
        batch = data(16, 10 + seed)
        stacked = {k: v.reshape(2, 8, *v.shape[1:]) for k, v in batch.items()}
        s1, m1 = one(s1, stacked)
        sm, mm = many(sm, _split_rows(stacked))
        sf, mf = full(sf, batch)
        gf = local(_recorded(sf.opt_state))
        rows.append(row(s1, sm, m1, mm, full_batch_err=max_diff(
            local(_recorded(s1.opt_state)), gf) / max_abs(gf) if seed == 0 else None))
    RESULT["accumulate"] = rows
    report = fg.collectives(many, fg.replicate(state, MESH), _split_rows(stacked))
    RESULT["collectives"] = report.to_dict()

    # 5 micro-batches of 8: 2 updates of 2 and a partial group (tail="apply"); the last
    # device's rows of micro-batches 1 and 4 are padding (False in the mask), so the devices
    # hold different numbers of real examples.
    batch = data(40, 20)
    stacked = {k: v.reshape(5, 8, *v.shape[1:]) for k, v in batch.items()}
    mask = np.ones((5, 8), bool)
    mask[[1, 4], 8 - 8 // N:] = False
    with_mask = dict(stacked, mask=mask)
    s1, m1 = one(state, stacked, mask)
    mesh_args = _split_rows(with_mask)
    sharded_mask = mesh_args.pop("mask")
    sm, mm = many(fg.replicate(state, MESH), mesh_args, sharded_mask)
    RESULT["accumulate_masked"] = row(s1, sm, m1, mm)
    # The same micro-batches as a fg.Microbatches, each process passing its own rows of them
    # (fg.process_batch splits axis 1 of a Microbatches), and held whole (fg.shard_batch).
    local_mbs = fg.Microbatches({k: v[:, fg.process_rows(8, MESH)] for k, v in stacked.items()},
                                mask[:, fg.process_rows(8, MESH)])
    sp, mp = many(fg.replicate(state, MESH), fg.process_batch(local_mbs, MESH))
    ss, ms = many(fg.replicate(state, MESH), fg.shard_batch(fg.Microbatches(stacked, mask),
                                                            MESH))
    RESULT["accumulate_microbatches"] = {"process_batch": row(s1, sp, m1, mp),
                                         "shard_batch": row(s1, ss, m1, ms)}
    RESULT["collectives_masked"] = fg.collectives(
        many, fg.replicate(state, MESH), mesh_args, sharded_mask).to_dict()

    # BatchNorm (model state) under accumulation, clipped: a one-layer net that
    # normalises its hidden features over the rows it is given and keeps running means.
    bn_params = {"w": jax.random.normal(jax.random.key(2), (16, 8)) / 4,
                 "v": jax.random.normal(jax.random.key(3), (8, 10)) / 3}
    stats = {"mean": jnp.zeros(8), "var": jnp.ones(8)}

    def bn_loss(params, batch, *, model_state):
        h = batch["x"] @ params["w"]
        mean, var = jnp.mean(h, axis=0), jnp.var(h, axis=0)
        logits = jax.nn.relu((h - mean) / jnp.sqrt(var + 1e-5)) @ params["v"]
        new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * mean,
                     "var": 0.9 * model_state["var"] + 0.1 * var}
        return (optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]),
                new_state)

    # (A loss scale needs a float16/bfloat16 compute dtype; scaled steps over devices are
    # scenario_state_keys_scale's.)
    options = dict(has_state=True)  # tx clips, as above
    bn_state = _step(bn_loss, tx, **options).init(bn_params, model_state=stats)
    rng = np.random.default_rng(5)
    stacked = {"x": rng.normal(size=(2, 8, 16)).astype(np.float32),
               "y": rng.integers(0, 10, size=(2, 8)).astype(np.int32)}
    parts = _device_parts(stacked)
    # The gradient: the devices' parts as 2N micro-batches of their own, in one update.
    resplit = {k: np.concatenate([p[k] for p in parts]) for k in stacked}
    ref = _step(bn_loss, tx, accumulate=2 * N, **options)
    s_ref, _ = ref(bn_state, resplit)
    # The model state: the mean over the devices of each device's part run alone.
    alone = _step(bn_loss, tx, accumulate=2, **options)
    states = [alone(bn_state, p)[0].model_state for p in parts]
    mean_state = jax.tree.map(lambda *v: np.mean(np.stack(v), axis=0), *states)
    bn_many = _step(bn_loss, tx, accumulate=2, mesh=MESH, **options)
    s_bn, m_bn = bn_many(fg.replicate(bn_state, MESH), _split_rows(stacked))
    g_ref = local(_recorded(s_ref.opt_state))
    RESULT["accumulate_bn"] = {
        "grad_err": max_diff(g_ref, local(_recorded(s_bn.opt_state))) / max_abs(g_ref),
        "model_state_err": max_diff(mean_state, local(s_bn.model_state)),
        "max_state": max_abs(mean_state),
        "state_spread": max_diff(states[0], states[-1]),
        "skipped": int(np.sum(local(m_bn["skipped"])))}


def scenario_state_keys_scale() -> None:
    """A CNN with BatchNorm (model state) and dropout (keys), and a loss scale whose first
    steps overflow (skipped, backed off): everything equal to the one-device step."""
    cnn_params, stats = fg.cnn_init(jax.random.key(0), channels=(4, 8))

    def loss(params, batch, *, model_state, key):
        logits, model_state = fg.cnn_apply(params, model_state, batch["x"], train=True,
                                           key=key)
        return fg.softmax_cross_entropy(logits, batch["y"]), model_state

    tx = optax.chain(fg.clip_by_global_norm(1.0), record_grads(), optax.adam(1e-3))
    ls = fg.dynamic_loss_scale(init_scale=2.0**127, max_scale=2.0**127,  # overflows at first
                               growth_interval=2)
    one, many = both(loss, tx, cnn_params, {"model_state": stats, "seed": 3}, has_state=True,
                     takes_key=True, loss_scale=ls, compute_dtype=jnp.bfloat16)
    rng = np.random.default_rng(5)
    steps = [{"x": rng.normal(size=(8, 64)).astype(np.float32),
              "y": rng.integers(0, 10, size=8).astype(np.int32)} for _ in range(4)]
    steps[1]["x"] *= 1e4  # gradients above 2: times the scale 2**127 they overflow (bfloat16
    #                       has float32's range)
    compare("bn_dropout_loss_scale", one, many, steps)


def scenario_mapped() -> None:
    """User code in shard_map style and pmap style with fg.data_parallel_value_and_grad,
    against the one-device gradient of the global token mean; and the naive habits."""
    params = fg.mlp_init(jax.random.key(2), (16, 8, 10))
    rng = np.random.default_rng(3)
    B = 8
    batch = {"x": rng.normal(size=(B, 16)).astype(np.float32),
             "y": rng.integers(0, 10, size=B).astype(np.int32),
             "w": np.array([1, 1, 1, 1, 1, 0, 0, 1], np.float32)}  # 4 real rows vs 2

    def sum_and_count(params, shard):
        per = optax.softmax_cross_entropy_with_integer_labels(
            fg.mlp_apply(params, shard["x"]), shard["y"])
        return jnp.sum(per * shard["w"]), jnp.sum(shard["w"])

    def global_mean(params, batch):
        s, n = sum_and_count(params, batch)
        return s / n

    right = jax.grad(global_mean)(params, batch)
    vg = fg.data_parallel_value_and_grad(sum_and_count, "data")
    P = jax.sharding.PartitionSpec
    sharded = fg.process_batch(global_rows(batch), MESH)
    reps = fg.replicate(params, MESH)
    smap = jax.jit(jax.shard_map(vg, mesh=MESH, in_specs=(P(), P("data")),
                                 out_specs=(P(), P())))
    loss_sm, g_sm = smap(reps, sharded)
    scale = max_abs(right)
    RESULT["shard_map_err"] = max_diff(local(g_sm), right) / scale
    RESULT["shard_map_loss"] = [float(local(loss_sm)), float(global_mean(params, batch))]
    mine = global_rows(batch)
    per_device = jax.tree.map(lambda v: v[None], mine)  # (local devices = 1, rows, ...)
    loss_pm, g_pm = jax.pmap(vg, axis_name="data", in_axes=(None, 0))(params, per_device)
    RESULT["pmap_err"] = max_diff(jax.tree.map(lambda g: np.asarray(g)[0], g_pm),
                                  right) / scale

    # The habits, with every row real (equal counts): each gradient over the right one.
    ones = {**batch, "w": np.ones(B, np.float32)}
    right1 = jax.grad(global_mean)(params, ones)
    local_mean = lambda p, shard: sum_and_count(p, shard)[0] / sum_and_count(p, shard)[1]

    def psum_loss(p, shard):
        s, n = sum_and_count(p, shard)
        return jax.lax.psum(s, "data") / jax.lax.psum(n, "data")

    habits = {
        "mean_then_pmean": lambda p, sh: jax.lax.pmean(jax.grad(local_mean)(p, sh), "data"),
        "mean_then_psum": lambda p, sh: jax.lax.psum(jax.grad(local_mean)(p, sh), "data"),
        "grad_of_psum_loss": lambda p, sh: jax.grad(psum_loss)(p, sh),
        "grad_of_psum_loss_then_pmean": lambda p, sh: jax.lax.pmean(
            jax.grad(psum_loss)(p, sh), "data"),
    }
    ratio = lambda g: float(np.median([np.sum(np.abs(np.asarray(a))) / np.sum(np.abs(b))
                                       for a, b in zip(jax.tree.leaves(g),
                                                       jax.tree.leaves(right1))]))
    sharded1 = fg.process_batch(global_rows(ones), MESH)
    per_device1 = jax.tree.map(lambda v: v[None], global_rows(ones))
    for name, habit in habits.items():
        g = jax.jit(jax.shard_map(habit, mesh=MESH, in_specs=(P(), P("data")),
                                  out_specs=P()))(reps, sharded1)
        RESULT[f"habit/shard_map/{name}"] = ratio(local(g))
        g = jax.pmap(habit, axis_name="data", in_axes=(None, 0))(params, per_device1)
        RESULT[f"habit/pmap/{name}"] = ratio(jax.tree.map(lambda x: np.asarray(x)[0], g))

    # The habit from one device: grad of the local mean, then pmean. Under shard_map the
    # replicated params' cotangent is already summed: N x (with equal counts).
    def naive(params, shard):
        g = jax.grad(lambda p: sum_and_count(p, shard)[0] / sum_and_count(p, shard)[1])(params)
        return jax.lax.pmean(g, "data")
    g_naive = jax.jit(jax.shard_map(naive, mesh=MESH, in_specs=(P(), P("data")),
                                    out_specs=P()))(reps, sharded)
    ratio = [float(np.sum(np.abs(local(a))) / np.sum(np.abs(b)))
             for a, b in zip(jax.tree.leaves(g_naive), jax.tree.leaves(right))]
    RESULT["shard_map_naive_ratio"] = float(np.median(ratio))


def scenario_uneven() -> None:
    """Process 1 runs one step fewer than the others: process 0's last step waits for it in
    the all-reduce. It must end with an error (JAX's shutdown barrier, 10 s here), not hang."""
    params = fg.mlp_init(jax.random.key(0), (16, 8, 10))
    tx = optax.sgd(0.1)
    step = fg.data_parallel(fg.make_train_step(mlp_loss, tx), MESH)
    state = fg.replicate(step.init(params), MESH)
    batch = fg.process_batch(global_rows(data(8, 0)), MESH)
    for _ in range(3 - (PID == 1)):
        state, metrics = step(state, batch)
        jax.block_until_ready(state)
    print(f"process {PID} finished its steps", flush=True)


def gathered(tree):
    """Every process's copy of `tree` whole, as NumPy: sharded leaves (a ZeRO-1 optimizer
    state) gathered from all processes, replicated ones read locally."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return local(x)
    return jax.tree.map(one, tree)


def scenario_zero() -> None:
    """ZeRO-1 (shard_opt_state=True): the optimizer state split over the processes, every
    number the one-device step's (clipping, a NaN step skipped, accumulation); each process
    holds its half of Adam's moments; the collectives: the gradient all-reduce and an
    all-gather of the sharded updates."""
    params = fg.mlp_init(jax.random.key(0), (16, 32, 10))
    tx = optax.chain(fg.clip_by_global_norm(0.5), record_grads(), optax.adam(1e-2))
    one = fg.make_train_step(mlp_loss, tx)
    many = fg.data_parallel(fg.make_train_step(mlp_loss, tx), MESH, shard_opt_state=True)
    state = one.init(params)
    s1, sm = state, many.place_state(state)
    steps = [data(16, 30 + s) for s in range(4)]
    steps[2]["x"][-1, 0] = np.nan  # the last process's rows: the update is skipped
    rows = []
    for batch in steps:
        s1, m1 = one(s1, batch)
        sm, mm = many(sm, fg.process_batch(global_rows(batch), MESH))
        g1 = local(_recorded(s1.opt_state))
        rows.append({"grad_err": max_diff(g1, gathered(_recorded(sm.opt_state)))
                     / max(max_abs(g1), 1e-30),
                     "param_err": max_diff(local(s1.params), local(sm.params)),
                     "opt_state_err": max_diff(local(s1.opt_state), gathered(sm.opt_state)),
                     "max_p": max_abs(local(s1.params)),
                     "skipped": [int(m1["skipped"]), int(local(mm["skipped"]))],
                     "loss": [float(m1["loss"]), float(local(mm["loss"]))]})
    RESULT["zero"] = rows
    mu = sm.opt_state[-1][0].mu  # adam's first moment, as a list of layers
    RESULT["zero_shards"] = {
        "w0": [list(mu[0]["w"].shape), list(mu[0]["w"].addressable_data(0).shape)],
        "b1": [list(mu[1]["b"].shape), list(mu[1]["b"].addressable_data(0).shape)],
        "params_w0": list(sm.params[0]["w"].addressable_data(0).shape)}
    RESULT["zero_collectives"] = fg.collectives(
        many, sm, fg.process_batch(global_rows(steps[0]), MESH)).to_dict()
    try:  # a replicated state given to the ZeRO-1 step
        many(fg.replicate(state, MESH), fg.process_batch(global_rows(steps[0]), MESH))
    except ValueError as e:
        RESULT["zero_unplaced"] = str(e)

    def per_example(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            fg.mlp_apply(params, batch["x"]), batch["y"])
    # Clipped at 1.0: a state of the same structure as the one above, which it continues.
    tx = optax.chain(fg.clip_by_global_norm(1.0), record_grads(), optax.adam(1e-2))
    one = fg.make_train_step(fg.accumulate(per_example, 2), tx)
    many = fg.data_parallel(fg.make_train_step(fg.accumulate(per_example, 2), tx), MESH,
                            shard_opt_state=True)
    stacked = {k: v.reshape(2, 8, *v.shape[1:]) for k, v in data(16, 40).items()}
    s1, _ = one(state, stacked)
    sm, _ = many(many.place_state(state), _split_rows(stacked))
    RESULT["zero_accumulate"] = {
        "param_err": max_diff(local(s1.params), local(sm.params)),
        "opt_state_err": max_diff(local(s1.opt_state), gathered(sm.opt_state))}


def scenario_bad() -> None:
    """The errors that must come before a collective: swapped shards, disagreeing shapes,
    params that differ per process, a batch that does not divide."""
    errors = {}
    rows = fg.process_rows(8, MESH)
    other = slice((rows.start + 4) % 8, (rows.start + 4) % 8 + 4)
    try:
        fg.process_batch({"x": np.zeros((4, 3), np.float32)}, MESH, rows=other)
    except ValueError as e:
        errors["swapped"] = str(e)
    try:
        fg.process_batch({"x": np.zeros((4 + PID, 3), np.float32)}, MESH)
    except ValueError as e:
        errors["shapes"] = str(e)
    try:
        fg.replicate(fg.mlp_init(jax.random.key(PID), (4, 2)), MESH)
    except ValueError as e:
        errors["params"] = str(e)
    tx = optax.sgd(0.1)
    st = fg.data_parallel(fg.make_train_step(mlp_loss, tx), MESH)
    state = st.init(fg.mlp_init(jax.random.key(0), (3, 2)))
    for name, rows in (("numpy_batch", 6), ("indivisible", 5)):
        try:
            st(state, {"x": np.zeros((rows, 3), np.float32), "y": np.zeros(rows, np.int32)})
        except ValueError as e:
            errors[name] = str(e)
    try:  # this process's rows as a jax.Array of its own device: no error from JAX itself
        st(state, {"x": jnp.zeros((4, 3)), "y": jnp.zeros(4, jnp.int32)})
    except ValueError as e:
        errors["local_jax_array"] = str(e)
    try:
        fg.process_batch({"x": np.zeros((3, 3), np.float32)}, MESH, check=False)
        fg.shard_batch({"x": np.zeros((5, 3), np.float32)}, MESH)
    except ValueError as e:
        errors["shard_batch"] = str(e)
    # fit with arrays: every process must pass the same whole dataset. Each process's own
    # half (fg.process_rows of it), or the same rows in an order of its own, trained on rows
    # mixed across the processes, silently; a dataset of another length aborted in gloo.
    rng = np.random.default_rng(0)  # the same 16 rows on every process (3 features, 2 classes)
    x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.integers(0, 2, 16).astype(np.int32)
    half = fg.process_rows(16, MESH)
    order = np.random.default_rng(PID).permutation(16)
    for name, (xs, ys) in {"fit_own_half": (x[half], y[half]),
                           "fit_own_order": (x[order], y[order]),
                           "fit_lengths": (x[:16 - 2 * PID], y[:16 - 2 * PID])}.items():
        try:
            fg.fit(st, state, fg.Batches(xs, ys, batch_size=4), epochs=1, progress=False)
        except ValueError as e:
            errors[name] = str(e)
    good = fg.fit(st, state, fg.Batches(x, y, batch_size=4), epochs=1, progress=False)
    RESULT["fit_good_steps"] = int(local(good.state.step))  # still in step: 16 / 4 = 4
    RESULT["errors"] = errors


def fit_rows(history) -> dict:
    """A `History`'s per-step and per-epoch numbers, as JSON."""
    return {"step_loss": [float(v) for v in history.step_loss],
            "grad_norm": [float(v) for v in history.step_grad_norm],
            "skipped": [str(s) for s in history.skipped_steps],
            "epochs": [{k: (float(v) if isinstance(v, (int, float, np.number)) else str(v))
                        for k, v in row.items()} for row in history.epochs]}


def _chunk_collectives(step, state, x, y) -> list:
    """The collectives of the mesh step's compiled chunk (one epoch's full batches): each
    batch's rows are split over the devices, so the gradient's all-reduce sits in the loop."""
    from funcgrad.parallel.collectives import parse_collectives
    from funcgrad.train.loop.placement import place_data, place_state

    runner = next(r for r in step._fit_runners.values() if r._programs)
    shape, program = next(iter(runner._programs.items()))
    data = place_data({"x": x, "y": y}, MESH)
    key = place_state(jax.random.key(1), MESH, check=False)
    args = ((np.int32(0), np.int32(1)) if shape[0] == "epochs"  # several epochs per call
            else (np.int32(0), np.int32(0), np.int32(45)))
    hlo = program.lower(state, data, key, *args).compile()
    return [{"kind": c.kind, "in_loop": c.in_loop} for c in parse_collectives(hlo.as_text())]


def scenario_fit() -> None:
    """`fit` with the mesh step (chunked, every process holding the whole dataset) against
    one-device `fit` on the same global data order, in this process; guarded and optimistic
    chunks, several epochs per call and one per call, a partial last batch (1437 % 32)."""
    digits = fg.load_digits(seed=0)
    x, y = digits.x_train.astype(np.float32), digits.y_train.astype(np.int32)
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    tx = fg.make_optimizer("adam", 1e-3)
    for name, chained, fit_options in (
            ("optimistic", optax.chain(fg.clip_by_global_norm(1.0), tx), {}),
            ("guarded_per_epoch", tx, {"options": fg.FitOptions(optimistic=False,
                                                                chunk=16)})):
        runs = {}
        for where, mesh in (("one", None), ("mesh", MESH)):
            step = _step(mlp_loss, chained, mesh=mesh)
            start = time.perf_counter()
            result = fg.fit(step, step.init(params),
                            fg.Batches(x, y, batch_size=32, seed=1), epochs=3, progress=False,
                            **fit_options)
            runs[where] = (result, time.perf_counter() - start, step)
        one, many = runs["one"][0], runs["mesh"][0]
        p1, pm = local(one.state.params), local(many.state.params)
        RESULT[name] = {"param_err": max_diff(p1, pm), "max_p": max_abs(p1),
                        "one": fit_rows(one.history), "mesh": fit_rows(many.history),
                        "steps": [int(local(one.state.step)), int(local(many.state.step))],
                        "seconds": [runs["one"][1], runs["mesh"][1]],
                        "chunked": runs["mesh"][2].unjitted is not None,
                        "sharding": str(many.state.params[0]["w"].sharding)
                        if isinstance(many.state.params, list) else None}
        RESULT[name]["collectives"] = _chunk_collectives(runs["mesh"][2], many.state, x, y)
        RESULT[name + "/fingerprint"] = float(sum(
            np.sum(np.asarray(v, np.float64) * (i + 1))
            for i, v in enumerate(jax.tree.leaves(pm))))


@contextlib.contextmanager
def run_folder(name: str):
    """A folder every process of this run sees (one per run: the coordinator's port in its
    name), removed by process 0 once every process is done with it."""
    port = os.environ["FUNCGRAD_COORDINATOR"].rsplit(":", 1)[1]
    root = os.path.join(tempfile.gettempdir(), f"funcgrad-{name}-test-{port}")
    try:
        yield root
    finally:
        multihost_sync(f"{name}-done")
        if PID == 0:
            shutil.rmtree(root, ignore_errors=True)


def bitwise(a, b) -> bool:
    """Whether two pytrees of arrays are equal bit for bit."""
    return all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def scenario_resume() -> None:
    """Orbax checkpoints of the mesh step's replicated state, written by both processes into
    one folder: 2 epochs, stop, resume to 4 equals 4 without stopping, bit for bit."""
    digits = fg.load_digits(seed=0)
    x, y = digits.x_train.astype(np.float32), digits.y_train.astype(np.int32)
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    tx = fg.make_optimizer("adam", 1e-3)
    step = fg.data_parallel(
        fg.make_train_step(mlp_loss, optax.chain(fg.clip_by_global_norm(1.0), tx)), MESH)
    data = fg.Batches(x, y, batch_size=32, seed=1)
    with run_folder("resume") as root:
        whole = fg.fit(step, step.init(params), data, epochs=4, progress=False,
                       checkpoint=fg.Checkpointing(os.path.join(root, "whole")))
        first = fg.fit(step, step.init(params), data, epochs=2, progress=False,
                       checkpoint=fg.Checkpointing(os.path.join(root, "parts")))
        resumed = fg.fit(step, step.init(params), data, epochs=4, progress=False,
                         checkpoint=fg.Checkpointing(os.path.join(root, "parts"), resume=True))
        saved = sorted(os.listdir(os.path.join(root, "parts")))
    a, b = local(whole.state), local(resumed.state)
    RESULT["resume"] = {
        "bitwise": bitwise(a, b),
        "leaves": len(jax.tree.leaves(a)),
        "steps": [int(a.step), int(b.step), int(local(first.state.step))],
        "history_same": whole.history.step_loss == resumed.history.step_loss
        and whole.history.epochs == resumed.history.epochs,
        "saved": saved,
        "sharding": str(resumed.state.params[0]["w"].sharding)}


def _digits_batches(n: int, size: int, epochs: int) -> list:
    """The global batches of each epoch: the first `n` train digits in batches of `size`
    (fg.Batches' order, the last batch smaller)."""
    digits = fg.load_digits(seed=0)
    x, y = digits.x_train[:n].astype(np.float32), digits.y_train[:n].astype(np.int32)
    data = fg.Batches(x, y, batch_size=size, seed=1)
    return [list(data.epoch(e)) for e in range(epochs)]


def own_rows(batch: dict) -> dict:
    """This process's part of a global batch (its rows, fg.process_rows)."""
    mine = fg.process_rows(len(batch["x"]), MESH)
    return {k: v[mine] for k, v in batch.items()}


def _loader_fits(name: str, loss, options: dict, size: int, fit_options: dict,
                 max_norm: float | None = None):
    """One-device `fit` (process 0 only: the second method, no collective) on the global
    batches, and the mesh step's `fit` with each process's loader yielding its own rows of
    them (Adam, clipped to `max_norm` when given); records their numbers under `name`.
    Returns the mesh run, (params, optimizer) and the loader."""
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    tx = fg.make_optimizer("adam", 1e-3)
    if max_norm is not None:
        tx = optax.chain(fg.clip_by_global_norm(max_norm), tx)
    batches = _digits_batches(420, size, EPOCHS)  # the last batch: 420 % size rows
    runs = {}
    for where, mesh in (("one", None), ("mesh", MESH)):
        if mesh is None and PID != 0:
            continue
        step = _step(loss, tx, mesh=mesh, **options)
        loader = ((lambda e: batches[e]) if mesh is None
                  else (lambda e: (own_rows(b) for b in batches[e])))
        start = time.perf_counter()
        result = fg.fit(step, step.init(params), loader, epochs=EPOCHS,
                        progress=False, **fit_options)
        runs[where] = (result, time.perf_counter() - start)
    many = runs["mesh"][0]
    pm = local(many.state.params)
    RESULT[name] = {"mesh": fit_rows(many.history), "seconds": [runs["mesh"][1]],
                    "sharding": str(many.state.params[0]["w"].sharding),
                    "steps": [int(local(many.state.step))]}
    if PID == 0:
        one = runs["one"][0]
        p1 = local(one.state.params)
        RESULT[name].update(param_err=max_diff(p1, pm), max_p=max_abs(p1),
                            one=fit_rows(one.history))
        RESULT[name]["seconds"].insert(0, runs["one"][1])
        RESULT[name]["steps"].insert(0, int(local(one.state.step)))
    RESULT[name + "/fingerprint"] = float(sum(np.sum(np.asarray(v, np.float64) * (i + 1))
                                              for i, v in enumerate(jax.tree.leaves(pm))))
    loader = lambda e: (own_rows(b) for b in batches[e])
    return many, (params, tx), loader


#: Epochs of the per-process loader scenarios.
EPOCHS = 2


def scenario_fit_loader() -> None:
    """`fit` with the mesh step and a loader per process (each yields its own rows of every
    global batch: chunks of stacked batches, a short last batch of 4 = 2 + 2 rows) with an
    evaluation split, against one-device `fit` whose loader yields the global batches; then
    1 epoch with a checkpoint, resumed to 2: bit for bit the 2 epochs without stopping."""
    RESULT["funcgrad"] = fg.__file__  # the copy under test (PYTHONPATH)
    digits = fg.load_digits(seed=0)
    split = {"x": digits.x_test.astype(np.float32), "y": digits.y_test.astype(np.int32)}
    many, (params, tx), loader = _loader_fits("plain", mlp_loss, {}, 32, {"evaluate": split},
                                              max_norm=1.0)
    with run_folder("loader") as root:
        step = _step(mlp_loss, tx, mesh=MESH)  # tx: the clipped Adam of _loader_fits
        fg.fit(step, step.init(params), loader, epochs=1,
               checkpoint=fg.Checkpointing(root), progress=False)
        resumed = fg.fit(step, step.init(params), loader, epochs=EPOCHS,
                         checkpoint=fg.Checkpointing(root, resume=True), progress=False)
    a, b = local(many.state), local(resumed.state)
    RESULT["resume"] = {
        "bitwise": bitwise(a, b),
        "steps": int(b.step),
        "history_same": many.history.step_loss == resumed.history.step_loss}


def scenario_fit_loader_accumulate() -> None:
    """As scenario_fit_loader with accumulate=2: each process's loader yields its own rows
    of every micro-batch, fit groups them (a partial last group: one micro-batch of 4 = 2 + 2
    rows, padded to 8 per process and masked); an evaluation function of the params."""
    digits = fg.load_digits(seed=0)
    test_x, test_y = digits.x_test.astype(np.float32), digits.y_test.astype(np.int32)

    def per_example(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            fg.mlp_apply(params, batch["x"]), batch["y"])

    def accuracy(params):  # the params replicated over the mesh: this process's copy
        logits = fg.mlp_apply(local(params), test_x)
        return {"accuracy": float(np.mean(np.argmax(logits, -1) == test_y))}

    _loader_fits("accumulate", per_example, {"accumulate": 2}, 16, {"evaluate": accuracy})


def scenario_fit_loader_bad() -> None:
    """Per-process loaders that disagree: fit raises on every process, naming the fix, before
    a collective of the step waits for a batch that never comes; each case's time, and a
    good fit afterwards (the processes are still in step)."""
    params = fg.mlp_init(jax.random.key(0), (16, 8, 10))
    tx = optax.sgd(0.1)
    batches = [data(8, s) for s in range(6)]  # 6 global batches of 8 rows: 4 per process

    def per_example(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            fg.mlp_apply(params, batch["x"]), batch["y"])

    mine = [own_rows(b) for b in batches]
    cases = {
        "fewer_batches": (mlp_loss, {}, mine[:-1] if PID == 1 else mine),
        "dtype": (mlp_loss, {}, [{**b, "x": b["x"].astype(np.float64)} if PID == 1 and i == 2
                                 else b for i, b in enumerate(mine)]),
        "rows": (mlp_loss, {}, [own_rows(data(8 + 2 * PID, 9))] + mine),
        "fewer_microbatches": (per_example, {"accumulate": 4}, mine[:-1] if PID == 1 else mine),
    }
    errors, seconds = {}, {}
    for name, (loss, options, loader) in cases.items():
        step = _step(loss, tx, mesh=MESH, **options)
        start = time.perf_counter()
        try:
            fg.fit(step, step.init(params), loader, epochs=1, progress=False)
        except ValueError as e:
            errors[name] = str(e)
        seconds[name] = time.perf_counter() - start
    step = fg.data_parallel(fg.make_train_step(mlp_loss, tx), MESH)
    good = fg.fit(step, step.init(params), mine, epochs=1, progress=False)
    RESULT["errors"], RESULT["error_seconds"] = errors, seconds
    RESULT["good_steps"] = int(local(good.state.step))
    # A NaN in process 1's rows of batch 3: both stop there, with the state from before it.
    nan = [{**b, "x": b["x"].copy()} for b in mine]
    if PID == 1:
        nan[3]["x"][0, 0] = np.nan
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the report, also as a warning
        stopped = fg.fit(step, step.init(params), nan, epochs=1, progress=False)
    RESULT["nonfinite"] = {"step": stopped.nonfinite.step, "batch": stopped.nonfinite.batch,
                           "state_step": int(local(stopped.state.step)),
                           "finite": bool(np.isfinite(max_abs(local(stopped.state.params))))}
    # A non-finite update from a finite loss and gradient (Adam with eps=0 on a leaf the
    # loss never uses: g = m = v = 0, so its update is 0/0): the guard skips step 0, fit stops
    # there, and the report names the leaf; the step is rerun on that global batch, sliced
    # from the chunk's stacked batches on every process.
    adam0 = optax.adam(0.1, eps=0.0)
    unused = fg.data_parallel(fg.make_train_step(lambda p, b: mlp_loss(p["mlp"], b), adam0), MESH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = fg.fit(unused, unused.init({"mlp": params, "u": jnp.zeros(1)}),
                     mine, epochs=1, progress=False)
    RESULT["update"] = {"step": got.nonfinite.step, "loss": got.nonfinite.loss,
                        "state_step": int(local(got.state.step)), "text": got.nonfinite.update}


def scenario_fit_zero() -> None:
    """`fit` with a ZeRO-1 step (shard_opt_state=True) on array data: equal to one-device
    `fit`, the optimizer state still split after it; 1 epoch with an orbax checkpoint of the
    split state, resumed to 2: bit for bit the 2 epochs without stopping."""
    digits = fg.load_digits(seed=0)
    x, y = digits.x_train[:420].astype(np.float32), digits.y_train[:420].astype(np.int32)
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    tx = fg.make_optimizer("adam", 1e-3)
    data = fg.Batches(x, y, batch_size=32, seed=1)
    tx = optax.chain(fg.clip_by_global_norm(1.0), tx)
    plain = fg.make_train_step(mlp_loss, tx)
    one = fg.fit(plain, plain.init(params), data, epochs=EPOCHS, progress=False)
    step = fg.data_parallel(fg.make_train_step(mlp_loss, tx), MESH, shard_opt_state=True)
    many = fg.fit(step, step.init(params), data, epochs=EPOCHS, progress=False)
    with run_folder("zero") as root:
        fg.fit(step, step.init(params), data, epochs=1, progress=False,
               checkpoint=fg.Checkpointing(root))
        resumed = fg.fit(step, step.init(params), data, epochs=EPOCHS,
                         progress=False, checkpoint=fg.Checkpointing(root, resume=True))
    # adam's first moment of the (64, 32) weight: adam's state follows the clip's
    mu = many.state.opt_state[1][0].mu[0]["w"]
    a, b = gathered(many.state), gathered(resumed.state)
    p1 = local(one.state.params)
    RESULT["fit_zero"] = {
        "param_err": max_diff(p1, local(many.state.params)), "max_p": max_abs(p1),
        "opt_state_err": max_diff(local(one.state.opt_state), a.opt_state),
        "losses": [one.history.step_loss, many.history.step_loss],
        "mu_shard": list(mu.addressable_data(0).shape),
        "resumed_mu_shard": list(resumed.state.opt_state[1][0].mu[0]["w"]
                                 .addressable_data(0).shape),
        "bitwise": bitwise(a, b),
        "history_same": many.history.step_loss == resumed.history.step_loss}


def multihost_sync(name: str) -> None:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        globals()[f"scenario_{name}"]()
    RESULT["seconds"] = time.perf_counter() - T0
    print("RESULT " + json.dumps(RESULT), flush=True)
