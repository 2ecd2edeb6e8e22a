"""`fit`: the guard that keeps the last finite state, logging, accumulation groups, the error
for a wrong step, and a short run on real data (concept 10)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import half_squared_norm, mlp_problem

import funcgrad as fg


def test_fit_keeps_the_state_from_before_a_nan_batch():
    # One clean step on 5 rows (one batch of 5); then a second fit from that state meets a NaN
    # in its first batch: the loss is NaN, so the second fit must hand the first state back.
    params, batch, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    step = fg.make_train_step(loss_fn, tx)
    x, y = np.asarray(batch["x"]), np.asarray(batch["y"])
    first = fg.fit(step, step.init(params), fg.Batches(x, y, batch_size=5), epochs=1,
                   progress=False)
    bad_x = x.copy()
    bad_x[2, 3] = np.nan
    with pytest.warns(RuntimeWarning, match=r"step 0 \(epoch 1, batch 0\): loss=nan"):
        second = fg.fit(step, first.state, fg.Batches(bad_x, y, batch_size=5), epochs=1,
                        progress=False)
    for a, b in zip(jax.tree.leaves(second.state), jax.tree.leaves(first.state)):
        np.testing.assert_array_equal(a, b)  # params, both Adam moments, counts, step: untouched
    assert int(second.state.step) == 1 and math.isnan(second.nonfinite.loss)


def test_fit_stops_at_first_overflow_and_keeps_last_finite_state():
    # SGD with lr=1000 on L = p^2: p <- p - 1000*2p = -1999 p, so p_k = (-1999)^k from p_0 = 1.
    # Step k computes L(p_k) = 1999^(2k). In float32 (max ~3.4e38) 1999^10 ~ 1.0e33 is finite but
    # 1999^12 ~ 4.1e39 overflows to inf, so steps 0..5 apply and step 6 is refused:
    # the state keeps p_6 = 1999^6 ~ 6.37e19 with 6 steps counted. The global norm of step 6's
    # gradient 2*p_6 ~ 1.3e20 is inf as well: optax.tree.norm squares it (~1.6e40 > 3.4e38).
    tx = optax.sgd(1000.0)
    step = fg.make_train_step(lambda p, b: p["p"] ** 2, tx)
    state = step.init({"p": jnp.float32(1.0)})
    x = np.zeros((8, 1), np.float32)
    with pytest.warns(RuntimeWarning, match="non-finite value at step 6"):
        result = fg.fit(step, state, fg.Batches(x, np.zeros(8), batch_size=1), epochs=2,
                        progress=False)
    report = result.nonfinite
    assert (report.step, report.epoch, report.batch) == (6, 1, 6)
    assert math.isinf(report.loss) and math.isinf(report.grad_norm)
    assert int(result.state.step) == 6
    assert float(result.state.params["p"]) == pytest.approx(1999.0 ** 6, rel=1e-6)
    assert len(result.history.step_loss) == 6 and result.history.epochs == []


def test_fit_never_returns_params_overflowed_by_an_update():
    # SGD lr=1e38 on L = -w from w = 3e38 (float32 max ~3.40e38): step 0 has loss -3e38 and
    # gradient -1, both finite, but its update makes w = 3e38 + 1e38 = inf. The step's guard
    # on the new params skips it, so fit stops at step 0 with the initial state (w = 3e38,
    # step 0) and names the leaf.
    tx = optax.sgd(1e38)
    step = fg.make_train_step(lambda p, b: -p["w"], tx)
    with pytest.warns(RuntimeWarning, match=r"non-finite value at step 0.*params\['w'\] "
                      r"\(float32\): its update is finite but the new value overflows"):
        result = fg.fit(step, step.init({"w": jnp.float32(3e38)}),
                        fg.Batches(np.zeros((4, 1)), np.zeros(4), batch_size=1), epochs=1,
                        progress=False)
    assert float(result.state.params["w"]) == pytest.approx(3e38, rel=1e-6)
    assert int(result.state.step) == 0


def test_fit_logs_through_the_progress_bar():
    lines = []
    tx = optax.sgd(0.1)
    step = fg.make_train_step(half_squared_norm, tx)
    fg.fit(step, step.init({"p": jnp.ones(2)}),
           fg.Batches(np.zeros((4, 1)), np.zeros(4), batch_size=2), epochs=2,
           progress=fg.Progress(lines.append, bar=True))
    # L = |p|^2/2 from p = (1, 1), lr 0.1: step losses 1.0 then 0.81 (p -> 0.9p); mean 0.905.
    assert len(lines) == 2 and lines[0].startswith("epoch   1  loss 0.9")


def test_fit_reaches_095_on_digits_quickly():
    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 128, 10))

    def loss_fn(p, b):
        return fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])

    acc = jax.jit(lambda p: fg.accuracy(fg.mlp_apply(p, data.x_test), data.y_test))
    tx = fg.make_optimizer("adam", 1e-3)
    step = fg.make_train_step(loss_fn, tx)
    result = fg.fit(step, step.init(params),
                    fg.Batches(data.x_train, data.y_train, batch_size=32), epochs=8,
                    evaluate=lambda p: {"test_accuracy": acc(p)}, progress=False)
    history = result.history
    assert result.nonfinite is None
    assert history.epochs[-1]["eval/test_accuracy"] >= 0.95
    # ceil(1437 / 32) = 45 steps per epoch; each row's loss is the mean of its epoch's steps.
    assert len(history.step_loss) == 8 * 45 and history.epochs[-1]["steps"] == 360
    assert history.epochs[1]["loss"] == pytest.approx(np.mean(history.step_loss[45:90]))
    assert history.epochs[-1]["loss"] < history.epochs[0]["loss"] / 5


@pytest.mark.parametrize("tail, updates, dropped", [
    # 1437 digits in micro-batches of 32: ceil(1437 / 32) = 45 per epoch, the last holding
    # 1437 - 44 * 32 = 29. Groups of 4: 11 full groups and a tail of 1 micro-batch.
    # "apply": 12 updates per epoch, 24 in 2; "drop": 11 per epoch, 29 examples dropped each.
    ("apply", 24, 0),
    ("drop", 22, 58),
])
def test_fit_with_accumulation_counts_updates_and_the_tail(tail, updates, dropped):
    data = fg.load_digits(seed=0)
    params = fg.mlp_init(jax.random.key(0), (64, 16, 10))

    def per_example(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(fg.mlp_apply(p, b["x"]), b["y"])

    tx = optax.adam(1e-3)
    step = fg.make_train_step(fg.accumulate(per_example, 4, tail=tail), tx)
    result = fg.fit(step, step.init(params),
                    fg.Batches(data.x_train, data.y_train, batch_size=32), epochs=2,
                    progress=False)
    assert len(result.history.step_loss) == updates and int(result.state.step) == updates
    assert result.history.dropped_examples == dropped
    assert result.state.opt_state[0].count == updates       # Adam ran once per update


def test_fit_refuses_a_run_whose_every_group_would_be_dropped():
    # 50 examples in batches of 32 make 2 micro-batches per epoch, fewer than one group of 4:
    # with tail="drop" no update would ever be applied.
    tx = optax.sgd(0.1)
    per_example = lambda p, b: jnp.sum((b["x"] @ p["w"] - b["y"]) ** 2, axis=-1)
    step = fg.make_train_step(fg.accumulate(per_example, 4, tail="drop"), tx)
    x, y = np.ones((50, 3), np.float32), np.zeros((50, 1), np.float32)
    state = step.init({"w": jnp.zeros((3, 1))})
    with pytest.raises(ValueError, match=r"make 2 micro-batches per epoch, fewer than one group "
                                         r"of accumulate=4.*no update would ever be applied"):
        fg.fit(step, state, fg.Batches(x, y, batch_size=32), epochs=1, progress=False)
    # tail="apply" trains on them: one update per epoch (said: the group of 4 x 32 exceeds the
    # 50 rows). Hand: the gradient of the mean of (x·w - y)^2 at w = 0, y = 0 is 0, so w stays
    # 0 and the loss is 0.
    step = fg.make_train_step(fg.accumulate(per_example, 4), tx)
    with pytest.warns(UserWarning, match="exceed the 50 examples of x"):
        result = fg.fit(step, state, fg.Batches(x, y, batch_size=32), epochs=1, progress=False)
    assert int(result.state.step) == 1 and result.history.step_loss == [0.0]


def test_a_nan_loss_with_a_finite_gradient_points_at_the_targets():
    # Label 10 of 10 classes in batch 0: the loss is NaN, the gradient finite (the example's
    # term drops out of it), so the report blames the targets, not the learning rate.
    data = fg.load_digits(seed=0)
    y = data.y_train[:64].copy()
    y[3] = 10
    tx = optax.adam(1e-3)
    loss = lambda p, b: fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])
    step = fg.make_train_step(loss, tx)
    state = step.init(fg.mlp_init(jax.random.key(0), (64, 8, 10)))
    with pytest.warns(RuntimeWarning):
        result = fg.fit(step, state,
                        fg.Batches(data.x_train[:64], y, batch_size=64), epochs=1, progress=False)
    report = result.nonfinite
    assert math.isnan(report.loss) and math.isfinite(report.grad_norm)
    assert "label outside [0, classes)" in str(report) and "Try a lower learning" not in str(report)


def test_a_label_out_of_range_is_named_by_its_row_and_value():
    # Issue 24, point 5.2: the whole digits train split (1437 rows) in batches of 32, with
    # y[1000] = 10 for a model of 10 outputs. The report named the 32 rows of the step and
    # none of them as the bad one. The row and the value are ours (set here): the second
    # method is the data itself; the hand count: 10 appears in y once, and y spans 0..10.
    data = fg.load_digits(seed=0)
    y = data.y_train.copy()
    y[1000] = 10
    tx = optax.adam(1e-3)
    loss = lambda p, b: fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])
    step = fg.make_train_step(loss, tx)
    state = step.init(fg.mlp_init(jax.random.key(0), (64, 16, 10)))
    with pytest.warns(RuntimeWarning, match=r"The loss of row 1000 \(y=10\) alone is not "
                                            r"finite \(1 of the step's 32 examples"):
        result = fg.fit(step, state,
                        fg.Batches(data.x_train, y, batch_size=32), epochs=2, progress=False)
    report = result.nonfinite
    assert 1000 in report.examples and report.bad_count == 1
    (bad,) = report.bad_examples
    assert (bad["row"], bad["y"], bad["rows_with_y"], bad["range_of_y"]) == (1000, 10, 1, [0, 10])
    assert math.isnan(bad["loss"]) and bad["nonfinite_inputs"] == []
    assert "check that value (y=10 in 1 row of the data; y spans 0..10 in the data)" in str(report)
    assert report.to_dict()["bad_examples"] == [bad]


def test_labels_numbered_from_one_and_a_nan_input_are_named_with_accumulation():
    # Labels 1..10 instead of 0..9: every row of class 9 becomes a 10 (y = 9 holds 144 of the
    # 1437 train digits: counted below from the data, the second method). With accumulate=2
    # the loss is per example (optax's), the step spans 2 batches of 16.
    data = fg.load_digits(seed=0)
    y = data.y_train + 1
    tens = int(np.count_nonzero(data.y_train == 9))
    tx = optax.adam(1e-3)
    per_example = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        fg.mlp_apply(p, b["x"]), b["y"])
    step = fg.make_train_step(fg.accumulate(per_example, 2), tx)
    # The plain step below trains the same optimizer: it takes this state too.
    state = step.init(fg.mlp_init(jax.random.key(0), (64, 16, 10)))
    with pytest.warns(RuntimeWarning):
        result = fg.fit(step, state, fg.Batches(data.x_train, y, batch_size=16), epochs=1,
                        progress=False)
    report = result.nonfinite
    # The bad rows are exactly the step's examples whose label is 10.
    expected = [r for r in report.examples if y[r] == 10]
    assert [e["row"] for e in report.bad_examples] == expected[:8]
    assert report.bad_count == len(expected) >= 1
    assert all(e["rows_with_y"] == tens and e["range_of_y"] == [1, 10]
               for e in report.bad_examples)
    assert f"y=10 in {tens} rows of the data; y spans 1..10 in the data" in str(report)
    # A NaN pixel in row 7: named as an input, with the fix.
    x = data.x_train.copy()
    x[7, 3] = np.nan
    loss = lambda p, b: fg.softmax_cross_entropy(fg.mlp_apply(p, b["x"]), b["y"])
    with pytest.warns(RuntimeWarning, match=r"row 7 \(y=\d, NaN/inf in x\) alone is not "
                                            r"finite.*fix or drop that row of the data"):
        result = fg.fit(fg.make_train_step(loss, tx), state,
                        fg.Batches(x, data.y_train, batch_size=32), epochs=1, progress=False)
    assert [e["nonfinite_inputs"] for e in result.nonfinite.bad_examples] == [["x"]]


def test_a_loss_no_single_example_makes_non_finite_names_no_row():
    # A loss that is inf for any batch of more than one example and 0 for a batch of one
    # (a stand-in for a loss coupled through the batch): no example is at fault alone, so
    # none is named and the report keeps its general advice.
    tx = optax.sgd(0.1)
    loss = lambda p, b: jnp.sum(p * b["x"]) * 0 + (jnp.inf if b["x"].shape[0] > 1 else 0.0)
    x, y = np.ones((8, 1), np.float32), np.zeros(8, np.int32)
    step = fg.make_train_step(loss, tx)
    state = step.init(jnp.float32(1.0))
    with pytest.warns(RuntimeWarning):
        result = fg.fit(step, state, fg.Batches(x, y, batch_size=4),
                        epochs=1, progress=False)
    report = result.nonfinite
    assert math.isinf(report.loss) and report.bad_examples == () and report.bad_count == 0
    assert "alone" not in str(report) and "check the targets and inputs" in str(report)


def test_fit_takes_python_lists():
    # Hand: one SGD step (lr 0.5) on mean((w x - y)^2) from w = 0 with x = y = [1, 1]:
    # gradient -2 mean(x (y - w x)) = -2, so w = 1 and the next loss is 0.
    tx = optax.sgd(0.5)
    loss = lambda p, b: jnp.mean((b["x"] * p - b["y"]) ** 2)
    step = fg.make_train_step(loss, tx)
    result = fg.fit(step, step.init(jnp.float32(0.0)),
                    fg.Batches([1.0, 1.0], [1.0, 1.0], batch_size=2), epochs=1, progress=False)
    np.testing.assert_allclose(result.state.params, 1.0)


def test_fit_names_a_loss_function_passed_as_the_step():
    data = fg.load_digits(seed=0)
    params, tx = fg.mlp_init(jax.random.key(0), (64, 10)), optax.sgd(0.1)

    def loss_fn(params, batch):
        return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])

    state = fg.make_train_step(loss_fn, tx).init(params)

    # loss_fn(state, batch) fails inside mlp_apply; the note says what fit expected.
    with pytest.raises(ValueError) as error:
        fg.fit(loss_fn, state, fg.Batches(data.x_train, data.y_train, batch_size=32), epochs=1,
               progress=False)
    assert any("step = funcgrad.make_train_step(loss_fn, optimizer)" in note
               for note in error.value.__notes__)
    # A function that runs but returns something else than (TrainState, metrics).
    with pytest.raises(TypeError, match=r"step returned an array of shape \(\) and dtype float32, "
                                        r"not \(TrainState, metrics\)"):
        fg.fit(lambda s, b: loss_fn(s.params, b), state,
               fg.Batches(data.x_train, data.y_train, batch_size=32), epochs=1, progress=False)


def test_nonfinite_report_with_accumulation_names_the_batches_of_the_update():
    # As in test_fit_stops_at_first_overflow_and_keeps_last_finite_state, with per-example
    # losses p^2 and 2 batches of 1 per update: update k has p_k = (-1999)^k, and update 6's
    # loss 1999^12 overflows. Update 6 takes batches 12 and 13 of epoch 0.
    tx = optax.sgd(1000.0)
    step = fg.make_train_step(fg.accumulate(lambda p, b: p["p"] ** 2 * jnp.ones_like(b["x"][:, 0]),
                                            2), tx)
    state = step.init({"p": jnp.float32(1.0)})
    with pytest.warns(RuntimeWarning, match=r"step 6 \(epoch 1, batches 12-13, accumulated\)"):
        result = fg.fit(step, state,
                        fg.Batches(np.zeros((32, 1), np.float32), np.zeros(32), batch_size=1),
                        epochs=1, progress=False)
    report = result.nonfinite
    assert (report.step, report.batch, report.batches) == (6, 12, 2)
    assert float(result.state.params["p"]) == pytest.approx(1999.0 ** 6, rel=1e-6)


def _quadratic_run(**kwargs):
    """L = |p|^2 / 2 from p = (1, 1), SGD lr 0.1, 4 rows in batches of 2: 2 steps per epoch."""
    step = fg.make_train_step(half_squared_norm, optax.sgd(0.1))
    return fg.fit(step, step.init({"p": jnp.ones(2)}),
                  fg.Batches(np.zeros((4, 1)), np.zeros(4), batch_size=2), **kwargs)


def test_evaluate_numbers_never_replace_the_training_numbers():
    # Hand: p -> 0.9 p each step. Step losses |p|^2/2 = 1.0, 0.81; gradient norms |p| =
    # sqrt(2), 0.9 sqrt(2). Epoch 1's row: loss (1 + 0.81)/2 = 0.905, grad_norm 0.95 sqrt(2).
    # An evaluate returning "loss", "grad_norm" and "epoch" lands under "eval/...", beside them.
    lines = []
    result = _quadratic_run(epochs=1, progress=lines.append,
                            evaluate=lambda p: {"loss": 123.0, "grad_norm": 7.0, "epoch": 9})
    row = result.history.epochs[0]
    assert row["loss"] == pytest.approx(0.905) and row["grad_norm"] == pytest.approx(0.95 * 2 ** .5)
    assert row["epoch"] == 1
    assert (row["eval/loss"], row["eval/grad_norm"], row["eval/epoch"]) == (123.0, 7.0, 9.0)
    assert result.history.to_dict()["epochs"][0] == row
    assert lines == ["epoch   1  loss 0.9050  grad_norm 1.3435  eval/loss 123.0000  "
                     "eval/grad_norm 7.0000  eval/epoch 9.0000"]


def test_epochs_are_numbered_from_1_wherever_a_user_sees_them(monkeypatch):
    # The rows, the log line, the progress bar and the non-finite report all say "epoch 1" for
    # the first pass over the data (PyTorch's and Keras's habit); steps stay 0-based indices.
    import tqdm.auto
    postfixes = []

    class Bar(tqdm.auto.tqdm):
        def set_postfix(self, **kwargs):
            postfixes.append(kwargs["epoch"])
            super().set_postfix(**kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    lines = []
    result = _quadratic_run(epochs=2, progress=lines.append)
    assert [row["epoch"] for row in result.history.epochs] == [1, 2]
    assert [line.split()[:2] for line in lines] == [["epoch", "1"], ["epoch", "2"]]
    # The bar is off (lines only) but fed the same way: once per chunk of steps (here one
    # chunk of both batches per epoch).
    assert postfixes == [1, 2]
    # A NaN in the first batch of the second pass (a loader: epoch -> batches): reported as
    # epoch 2, step 2 (two steps applied in epoch 1), batch 0.
    tx = optax.sgd(0.1)
    step = fg.make_train_step(lambda p, b: jnp.sum(p["p"] ** 2) / 2 + jnp.sum(b["x"]), tx)
    state = step.init({"p": jnp.ones(2)})

    def loader(epoch):
        bad = np.nan if epoch == 1 else 0.0
        return [{"x": np.full((2, 1), bad)}, {"x": np.zeros((2, 1))}]

    with pytest.warns(RuntimeWarning, match=r"non-finite value at step 2 \(epoch 2, batch 0\)"):
        result = fg.fit(step, state, loader, epochs=2, progress=False)
    assert result.nonfinite.epoch == 2 and result.nonfinite.to_dict()["epoch"] == 2


def test_a_step_whose_metrics_lack_the_global_norm_is_named():
    # A hand-written step returning only the loss: fit records the global gradient norm of
    # every step, so it says what the metrics must hold instead of KeyError: 'grad_norm'.
    tx = optax.sgd(0.1)

    def my_step(state, batch):
        loss, grads = jax.value_and_grad(half_squared_norm)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state)
        return state._replace(params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state), {"loss": loss}

    with pytest.raises(TypeError, match=r"metrics have no 'grad_norm' \(keys: 'loss'\).*"
                                        r"optax.global_norm\(grads\).*make_train_step"):
        fg.fit(my_step, fg.make_train_step(half_squared_norm, tx).init({"p": jnp.ones(2)}),
               fg.Batches(np.zeros((4, 1)), np.zeros(4), batch_size=2), epochs=1, progress=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"step": "adam"}, r"fit: step must be a function .* got a str \('adam'\)"),
    ({"evaluate": "accuracy"}, r"fit: evaluate must be a function of the params .* got a str"),
    ({"progress": "print"}, r"fit: progress must be True, False, a function of one string "
                            r"\(e.g. print\) or a funcgrad.Progress, got str"),
], ids=["step", "evaluate", "progress"])
def test_a_string_where_a_function_belongs_is_named(kwargs, match):
    # Each gave "TypeError: 'str' object is not callable" from inside the loop.
    tx = optax.sgd(0.1)
    step = fg.make_train_step(half_squared_norm, tx)
    args = {"step": step} | kwargs
    with pytest.raises(TypeError, match=match):
        fg.fit(args.pop("step"), step.init({"p": jnp.ones(2)}),
               fg.Batches(np.zeros((4, 1)), np.zeros(4), batch_size=2), epochs=1,
               **{"progress": False} | args)


def test_fit_takes_a_dict_of_inputs_and_counts_rows_on_its_leaves():
    # Two inputs per example, x = {"a": (64, 3), "b": (64, 1)}, and the loss of a linear model
    # mean((a.w + b*c - y)^2). With a = 1, b = 2, y = 5 for every row, one full-batch SGD step
    # (lr 0.05) from w = 0, c = 0: residual r = -5, dL/dw_j = 2 r a_j = -10, dL/dc = 2 r b = -20,
    # so w_j = 0.5 and c = 1. It counted the dict's 2 keys as rows before.
    tx = optax.sgd(0.05)
    loss = lambda p, bt: jnp.mean((bt["x"]["a"] @ p["w"] + bt["x"]["b"][:, 0] * p["c"]
                                   - bt["y"]) ** 2)
    x = {"a": np.ones((64, 3), np.float32), "b": np.full((64, 1), 2.0, np.float32)}
    step = fg.make_train_step(loss, tx)
    state = step.init({"w": jnp.zeros(3), "c": jnp.float32(0.0)})
    result = fg.fit(step, state,
                    fg.Batches(x, np.full(64, 5.0, np.float32), batch_size=64), epochs=1,
                    progress=False)
    np.testing.assert_allclose(result.state.params["w"], [0.5] * 3, rtol=1e-6)
    np.testing.assert_allclose(result.state.params["c"], 1.0, rtol=1e-6)
    # Leaves that disagree are named by their paths.
    with pytest.raises(ValueError, match=r"x\['b'\] has 32 rows but x\['a'\] has 64"):
        fg.fit(step, state,
               fg.Batches(x | {"b": x["b"][:32]}, np.zeros(64), batch_size=64), epochs=1,
               progress=False)


def test_an_accumulation_group_larger_than_the_data_is_said():
    # 100 rows in micro-batches of 10 make 10 per epoch; accumulate=1000 asks for 1000 of them
    # (10,000 examples) per update, so every update is the whole data set, one per epoch.
    tx = optax.sgd(0.1)
    per_example = lambda p, b: (b["x"][:, 0] * p["w"] - b["y"][:, 0]) ** 2
    step = fg.make_train_step(fg.accumulate(per_example, 1000), tx)
    state = step.init({"w": jnp.float32(0.0)})
    with pytest.warns(UserWarning, match=r"accumulate=1000 micro-batches of 10 \(10000 examples\) "
                                         r"exceed the 100 examples of x.*one update per epoch"):
        result = fg.fit(step, state,
                        fg.Batches(np.ones((100, 1)), np.ones((100, 1)), batch_size=10), epochs=2,
                        progress=False)
    assert int(result.state.step) == 2


def test_fit_records_the_learning_rate_each_update_applied():
    # A schedule counts optimizer updates. 64 examples in batches of 16 with accumulate=2 make
    # 2 updates per epoch, so 2 epochs apply updates 0..3 at rates 0.1 * 0.5**k (the schedule
    # halves every update): 0.1, 0.05, 0.025, 0.0125. Each epoch's row shows its last update's
    # rate: 0.05 after epoch 1, 0.0125 after epoch 2.
    def per_example(params, batch):
        return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2

    x = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(64, 1)
    schedule = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
    tx = fg.make_optimizer("sgd", schedule)
    params = {"w": jnp.ones((1,), jnp.float32)}
    step = fg.make_train_step(fg.accumulate(per_example, 2), tx)
    result = fg.fit(step, step.init(params),
                    fg.Batches(x, 2.0 * x[:, 0], batch_size=16), epochs=2, progress=False)
    np.testing.assert_allclose(result.history.step_learning_rate, [0.1, 0.05, 0.025, 0.0125],
                               rtol=1e-6)
    np.testing.assert_allclose([row["learning_rate"] for row in result.history.epochs],
                               [0.05, 0.0125], rtol=1e-6)
    assert result.history.to_dict()["steps"]["learning_rate"] == result.history.step_learning_rate
    # A constant rate given as a number keeps nothing to report.
    tx = fg.make_optimizer("sgd", 0.1)
    step = fg.make_train_step(fg.accumulate(per_example, 2), tx)
    result = fg.fit(step, step.init(params), fg.Batches(x, 2.0 * x[:, 0], batch_size=16),
                    epochs=1, progress=False)
    assert result.history.step_learning_rate == []
    assert "learning_rate" not in result.history.epochs[0]
