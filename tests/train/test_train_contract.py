"""The loss contract (funcgrad.train.loss): model state, PRNG keys and aux through the train step.

Every reference below is a second method: the same training written by hand with
``jax.value_and_grad(has_aux=True)`` and optax, drawing the keys the contract documents
(``fold_in(key, step)``; under accumulation ``fold_in(fold_in(key, step), j)``).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg

D, C, N = 5, 3, 8
RATE = 0.5  # dropout keep probability


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, D)).astype(np.float32),
            "y": rng.integers(0, C, size=n).astype(np.int32)}


def _params():
    return {"w": jnp.asarray(np.random.default_rng(1).normal(size=(D, C)) * 0.3, jnp.float32)}


def _model_state():
    return {"mean": jnp.zeros((D,), jnp.float32), "count": jnp.zeros((), jnp.int32)}


def _forward(params, batch, model_state, key):
    """A batch-normalising layer with a running mean (momentum 0.9) and inverted dropout."""
    x = batch["x"]
    mu = x.mean(0)
    new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * mu,
                 "count": model_state["count"] + 1}
    keep = jax.random.bernoulli(key, RATE, x.shape)
    h = jnp.where(keep, (x - mu[None]) / RATE, 0.0)
    logits = h @ params["w"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, new_state, {"keep": keep}


def loss(params, batch, *, model_state, key):
    losses, new_state, aux = _forward(params, batch, model_state, key)
    return losses.mean(), (new_state, aux)


def per_example_loss(params, batch, *, model_state, key):
    losses, new_state, aux = _forward(params, batch, model_state, key)
    return losses, (new_state, aux)


def _reference(steps, batches, seed=0, lr=0.05):
    """The hand-written loop: keys fold_in(key(seed), step)."""
    opt = optax.adam(lr)
    params, model_state = _params(), _model_state()
    opt_state = opt.init(params)
    base = jax.random.key(seed)
    keeps = []

    @jax.jit
    def one(params, opt_state, model_state, batch, key):
        (value, (model_state, aux)), grads = jax.value_and_grad(
            lambda p: loss(p, batch, model_state=model_state, key=key), has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state, aux

    for s in range(steps):
        params, opt_state, model_state, aux = one(params, opt_state, model_state,
                                                  batches[s % len(batches)],
                                                  jax.random.fold_in(base, s))
        keeps.append(np.asarray(aux["keep"]))
    return params, model_state, keeps


def _funcgrad_run(steps, batches, *, seed=0, state=None, step=None, lr=0.05):
    opt = optax.adam(lr)
    step = step or fg.make_train_step(fg.Loss(loss, has_aux=True, has_state=True, takes_key=True),
                                      opt)
    if state is None:
        state = step.init(_params(), model_state=_model_state(), seed=seed)
    keeps = []
    for _ in range(steps):
        s = int(state.step)
        state, metrics = step(state, batches[s % len(batches)])
        keeps.append(np.asarray(metrics["aux"]["keep"]))
    return state, keeps


def test_state_key_and_aux_match_the_hand_written_loop():
    batches = [_data(seed=i) for i in range(3)]
    state, keeps = _funcgrad_run(6, batches)
    params, model_state, ref_keeps = _reference(6, batches)
    np.testing.assert_allclose(state.params["w"], params["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.model_state["mean"], model_state["mean"], rtol=1e-6)
    assert int(state.model_state["count"]) == 6  # one update of the running state per step
    for mine, ref in zip(keeps, ref_keeps):
        np.testing.assert_array_equal(mine, ref)
    # a fresh mask every step (10 masks of 40 bits agreeing by chance: 2**-40 each)
    assert all(not np.array_equal(a, b) for a, b in zip(keeps, keeps[1:]))


def test_a_rerun_and_a_resumed_run_draw_the_same_keys():
    batches = [_data(seed=i) for i in range(3)]
    full, keeps = _funcgrad_run(5, batches)
    again, keeps_again = _funcgrad_run(5, batches)
    half, first = _funcgrad_run(2, batches)
    resumed, rest = _funcgrad_run(3, batches, state=half)
    for a, b in zip(keeps, keeps_again):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(keeps, first + rest):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(full.params["w"], resumed.params["w"])
    np.testing.assert_array_equal(full.params["w"], again.params["w"])
    # another seed draws other masks
    _, other = _funcgrad_run(1, batches, seed=1)
    assert not np.array_equal(other[0], keeps[0])


def test_accumulation_threads_the_state_and_draws_one_key_per_micro_batch():
    opt = optax.sgd(0.1)
    k = 2
    mbs = fg.stack_microbatches([_data(4, seed=i) for i in range(4)])  # 4 micro-batches of 4
    contract = fg.Loss(per_example_loss, has_aux=True, has_state=True, takes_key=True)
    step = fg.make_train_step(fg.accumulate(contract, k), opt)
    state = step.init(_params(), model_state=_model_state(), seed=3)
    # The batch-normalising loss couples a micro-batch's examples, and funcgrad says so.
    with pytest.warns(fg.CoupledExamplesWarning, match=r"per_example_loss \(test_train_contract"):
        new, metrics = step(state, mbs)
    # Hand: update u (step u) over micro-batches 2u, 2u+1 with keys fold_in(fold_in(key, u), j),
    # the running mean updated once per micro-batch, in order; the mean gradient over the 8
    # examples of the group, one SGD step per group.
    params, model_state, base = _params(), _model_state(), jax.random.key(3)
    keeps = []
    for u in range(2):
        grads = jax.tree.map(jnp.zeros_like, params)
        for j in range(k):
            mb = jax.tree.map(lambda a, i=u * k + j: a[i], mbs.data)
            key = jax.random.fold_in(jax.random.fold_in(base, u), j)
            def summed(p, mb=mb, model_state=model_state, key=key):
                losses, new_state, aux = _forward(p, mb, model_state, key)
                return losses.sum(), (new_state, aux)

            (_, (model_state, aux)), g = jax.value_and_grad(summed, has_aux=True)(params)
            grads = jax.tree.map(lambda a, b: a + b, grads, g)
            keeps.append(np.asarray(aux["keep"]))
        params = jax.tree.map(lambda p, g: p - 0.1 * g / (k * 4), params, grads)
    np.testing.assert_allclose(new.params["w"], params["w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(new.model_state["mean"], model_state["mean"], rtol=1e-6)
    assert int(new.model_state["count"]) == 4
    assert metrics["aux"]["keep"].shape == (4, 4, D)  # one entry per micro-batch
    for j in range(4):
        np.testing.assert_array_equal(metrics["aux"]["keep"][j], keeps[j])


def test_a_skipped_step_keeps_the_model_state_and_a_nonfinite_state_skips():
    opt = optax.sgd(0.1)
    step = fg.make_train_step(fg.Loss(loss, has_aux=True, has_state=True, takes_key=True), opt)
    state = step.init(_params(), model_state=_model_state(), seed=0)
    bad = _data()
    bad["x"][0, 0] = np.nan
    new, metrics = step(state, bad)
    assert int(metrics["skipped"]) == 1
    np.testing.assert_array_equal(new.model_state["mean"], state.model_state["mean"])
    assert int(new.model_state["count"]) == 0

    def inf_state_loss(params, batch, *, model_state):
        value = jnp.mean((batch["x"] @ params["w"]) ** 2)
        return value, {"mean": model_state["mean"] + jnp.inf, "count": model_state["count"]}

    step = fg.make_train_step(fg.Loss(inf_state_loss, has_state=True), opt)
    state = step.init(_params(), model_state=_model_state())
    new, metrics = step(state, _data())
    assert int(metrics["skipped"]) == 1 and np.isfinite(float(metrics["loss"]))
    np.testing.assert_array_equal(new.params["w"], state.params["w"])
    assert "model_state['mean']" in step.explain_skipped_update(state, _data())


def test_mixed_precision_keeps_the_model_state_in_its_dtype():
    opt = optax.sgd(0.1)
    contract = fg.Loss(loss, has_aux=True, has_state=True, takes_key=True)
    step = fg.make_train_step(
        fg.mixed_precision(contract, jnp.bfloat16, loss_scale=fg.dynamic_loss_scale()), opt)
    state = step.init(_params(), model_state=_model_state(), seed=0)
    new, metrics = step(state, _data())
    assert new.model_state["mean"].dtype == jnp.float32
    assert new.params["w"].dtype == jnp.float32
    # the running mean is 0.1 * the batch mean of x, computed from bfloat16 inputs
    x16 = np.asarray(jnp.asarray(_data()["x"], jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(new.model_state["mean"], 0.1 * x16.mean(0), rtol=1e-2,
                               atol=1e-3)
    assert int(metrics["skipped"]) == 0


def test_monitor_and_detect_anomaly_work_with_state_and_key():
    opt = optax.chain(fg.grad_monitor(), optax.sgd(0.1))
    step = fg.detect_anomaly(fg.make_train_step(fg.Loss(loss, has_aux=True, has_state=True,
                                                        takes_key=True), opt))
    state = step.init(_params(), model_state=_model_state(), seed=0)
    new, metrics = step(state, _data())
    assert metrics["monitor"].leaf_names == ("params['w']",)
    np.testing.assert_allclose(float(metrics["monitor"].grad_norm), float(metrics["grad_norm"]),
                               rtol=1e-6)
    bad = _data()
    bad["x"][2, 1] = np.inf
    _, metrics = step(new, bad)
    report = metrics["anomaly"]
    assert not report.ok  # located in the forward pass of the loss bound to the step's key


def test_fit_evaluates_with_the_running_statistics():
    opt = optax.sgd(0.1)
    step = fg.make_train_step(fg.Loss(loss, has_aux=True, has_state=True, takes_key=True), opt)
    state = step.init(_params(), model_state=_model_state(), seed=0)
    data = _data(16)
    seen = []

    def evaluate(params, model_state):
        seen.append(np.asarray(model_state["mean"]))
        return {"count": float(model_state["count"])}

    result = fg.fit(step, state, fg.Batches(data["x"], data["y"], batch_size=8), epochs=2,
                    evaluate=evaluate, progress=False)
    assert [row["eval/count"] for row in result.history.epochs] == [2.0, 4.0]
    np.testing.assert_array_equal(seen[-1], result.state.model_state["mean"])


def test_contract_errors_are_clear():
    opt = optax.sgd(0.1)
    contract = fg.make_train_step(fg.Loss(loss, has_aux=True, has_state=True, takes_key=True),
                                  opt)
    # States made by other steps: each is what the step it is given to does not declare.
    state = contract.init(_params(), model_state=_model_state(), seed=0)  # model state and key
    plain = fg.make_train_step(lambda p, b: jnp.sum(b["x"] @ p["w"]), opt).init(_params())
    keyed_only = fg.make_train_step(fg.Loss(lambda p, b, *, key: jnp.sum(b["x"] @ p["w"]),
                                            takes_key=True), opt).init(_params(), seed=0)
    stateful_only = fg.make_train_step(
        fg.Loss(lambda p, b, *, model_state: (jnp.sum(b["x"] @ p["w"]), model_state),
                has_state=True), opt).init(_params(), model_state=_model_state())
    batch = _data()

    def returns_state(params, batch):
        return jnp.sum(batch["x"] @ params["w"]), _model_state()

    with pytest.raises(ValueError, match="declare has_state=True"):
        fg.make_train_step(returns_state, opt)(plain, batch)
    with pytest.raises(ValueError, match=r"model_state=\.\.\."):
        contract(keyed_only, batch)
    with pytest.raises(ValueError, match="not declared with has_state=True"):
        fg.make_train_step(lambda p, b: jnp.sum(b["x"] @ p["w"]), opt)(state, batch)
    with pytest.raises(ValueError, match="seed=0"):
        contract(stateful_only, batch)

    def drops_count(params, batch, *, model_state):
        return jnp.sum(batch["x"] @ params["w"]), {"mean": model_state["mean"]}

    step = fg.make_train_step(fg.Loss(drops_count, has_state=True), opt)
    with pytest.raises(ValueError, match=r"model_state\['count'\]: missing"):
        step(step.init(_params(), model_state=_model_state()), batch)

    def reshapes(params, batch, *, model_state):
        return (jnp.sum(batch["x"] @ params["w"]),
                {**model_state, "mean": model_state["mean"][None]})

    step = fg.make_train_step(fg.Loss(reshapes, has_state=True), opt)
    with pytest.raises(ValueError, match=r"model_state\['mean'\]: \(5,\) float32 -> \(1, 5\)"):
        step(step.init(_params(), model_state=_model_state()), batch)

    def string_aux(params, batch):
        return jnp.sum(batch["x"] @ params["w"]), {"note": "hello"}

    with pytest.raises(TypeError, match=r"aux\['note'\] is a str"):
        fg.make_train_step(fg.Loss(string_aux, has_aux=True), opt)(plain, batch)
    with pytest.raises(ValueError, match=r"must return \(loss, aux\)"):
        fg.make_train_step(fg.Loss(lambda p, b: jnp.sum(b["x"] @ p["w"]), has_aux=True),
                           opt)(plain, batch)
    with pytest.raises(ValueError, match="not both"):
        contract.init(_params(), model_state=_model_state(), seed=0, key=jax.random.key(0))
    with pytest.raises(TypeError, match="one PRNG key"):
        contract.init(_params(), model_state=_model_state(), key=jnp.zeros((3,), jnp.float32))
    # The contract is declared once: a Loss is not wrapped in another.
    with pytest.raises(TypeError, match="fn is already a funcgrad.Loss"):
        fg.Loss(fg.Loss(lambda p, b, **kw: loss(p, b, **kw), has_aux=True), has_state=True)


def test_loss_bind_feeds_the_analysis_tools():
    """Loss.bind fixes state and key: check_grads verifies the gradient the step uses."""
    contract = fg.Loss(loss, has_aux=True, has_state=True, takes_key=True)
    bound = contract.bind(_model_state(), jax.random.key(0))
    report = fg.check_grads(bound, _params(), _data())
    assert report.ok
    out = contract(_params(), _data(), model_state=_model_state(), key=jax.random.key(0))
    assert isinstance(out, fg.LossOutput) and out.aux["keep"].shape == (N, D)
    np.testing.assert_allclose(float(bound(_params(), _data())), float(out.loss))


def test_a_signature_that_contradicts_the_flags_is_named_at_make_time():
    opt = optax.sgd(0.1)

    def keyed(params, batch, *, key):
        return jnp.sum(batch["x"] @ params["w"])

    def plain(params, batch):
        return jnp.sum(batch["x"] @ params["w"])

    with pytest.raises(TypeError, match="requires key=, but the loss is not declared with "
                                        "takes_key=True"):
        fg.make_train_step(keyed, opt)
    with pytest.raises(TypeError, match="has_state=True, but .*plain takes no model_state="):
        fg.make_train_step(fg.Loss(plain, has_state=True), opt)
    with pytest.raises(TypeError, match="takes_key=True, but .*plain takes no key="):
        fg.make_train_step(fg.Loss(plain, takes_key=True), opt)
    # **kwargs accepts both; a defaulted parameter is optional
    fg.make_train_step(fg.Loss(lambda p, b, **kw: plain(p, b), takes_key=True), opt)
    fg.make_train_step(lambda p, b, key=None: plain(p, b), opt)


def test_an_accumulating_step_given_one_batch_says_it_takes_stacked_micro_batches():
    opt = optax.sgd(0.1)
    per_example = lambda p, b: jnp.sum(b["x"] @ p["w"], axis=1)
    step = fg.make_train_step(fg.accumulate(per_example, 2), opt)
    with pytest.raises(ValueError, match=r"accumulates \(funcgrad.accumulate\(loss, 2\)\): it "
                                         r"takes micro-batches "
                                         r"stacked.*microbatches\['y'\] has shape \(8,\)"):
        step(step.init(_params()), _data())
