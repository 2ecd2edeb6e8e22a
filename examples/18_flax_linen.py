"""A flax linen CNN with BatchNorm and dropout, trained by funcgrad and by flax's own loop.

`funcgrad.interop.from_linen` splits the module's variables into params (``params['Conv_0']
['kernel']``, ...) and model state (``batch_stats``), and `m.loss` gives the train step a loss
that takes the step's key (dropout: ``rngs={"dropout": fold_in(key, step)}``) and returns the
new running statistics. The same steps through flax's documented loop (``TrainState`` +
``mutable=["batch_stats"]``) give the same params, statistics and test accuracy to float32
rounding. Then `explain_grads`, `check_grads` and the gradient monitor name every leaf and
layer by flax's own paths.

    $ python examples/18_flax_linen.py
"""
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check
from flax.training import train_state

import funcgrad as fg
from funcgrad.interop import from_linen

STEPS, BATCH = 40, 32


class CNN(nn.Module):
    """Conv 3x3 (8 channels, no bias: BatchNorm's shift replaces it) -> BatchNorm -> relu ->
    dropout 0.2 -> 2x2 mean pool -> Dense 10, on 8x8x1 digits (NHWC)."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def cross_entropy(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


def flax_loop(module, variables, batches, tx, base_key):
    """flax's documented loop: TrainState with batch_stats, mutable=["batch_stats"], and
    rngs={"dropout": jax.random.fold_in(key, state.step)}."""

    class TrainState(train_state.TrainState):
        batch_stats: typing.Any

    @jax.jit
    def train_step(state, batch, dropout_key):
        dropout_key = jax.random.fold_in(dropout_key, state.step)

        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, batch["x"], train=True,
                rngs={"dropout": dropout_key}, mutable=["batch_stats"])
            return cross_entropy(logits, batch), updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        return state.replace(batch_stats=updates["batch_stats"]), loss

    state = TrainState.create(apply_fn=module.apply, params=variables["params"], tx=tx,
                              batch_stats=variables["batch_stats"])
    losses = []
    for batch in batches:
        state, loss = train_step(state, batch, base_key)
        losses.append(float(loss))
    return state, losses


def max_rel_diff(a, b) -> float:
    """max |a - b| / (|b| + 1e-3) over all elements (the 1e-3 for values near 0)."""
    pairs = [(np.asarray(x, np.float64), np.asarray(y, np.float64))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(float(np.max(np.abs(x - y) / (np.abs(y) + 1e-3))) for x, y in pairs)


def main() -> None:
    data = fg.load_digits(seed=0)
    x_train = data.x_train.reshape(-1, 8, 8, 1)
    order = np.random.default_rng(0).permutation(len(x_train))[:STEPS * BATCH]
    batches = [{"x": jnp.asarray(x_train[i]), "y": jnp.asarray(data.y_train[i])}
               for i in order.reshape(STEPS, BATCH)]
    x_test = jnp.asarray(data.x_test.reshape(-1, 8, 8, 1))

    module = CNN()
    variables = module.init(jax.random.key(0), batches[0]["x"], train=False)
    m = from_linen(module, variables)
    print(m)
    tx = optax.adam(1e-2)
    # The monitor first in the chain: it measures the gradient and passes it to Adam unchanged.
    step = fg.make_train_step(m.loss(cross_entropy, train=True),
                              optax.chain(fg.grad_monitor(), tx))
    state = step.init(m.params, model_state=m.model_state, seed=0)
    losses, alerts = [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        alerts += fg.monitor_alerts(metrics["monitor"])
    ref, ref_losses = flax_loop(module, variables, batches, tx, state.key)

    # Evaluation with the running statistics: BatchNorm in inference mode, no dropout.
    logits, _ = m.apply(state.params, state.model_state, x_test, train=False)
    ref_logits = module.apply({"params": ref.params, "batch_stats": ref.batch_stats}, x_test,
                              train=False)
    acc = float(fg.accuracy(logits, jnp.asarray(data.y_test)))
    ref_acc = float(fg.accuracy(ref_logits, jnp.asarray(data.y_test)))

    c = Check(f"linen CNN, {STEPS} Adam steps of {BATCH}", right="flax loop")
    # Two jitted float32 programs of the same operations (XLA may order sums differently):
    # agreement to float32 rounding, grown over 40 Adam steps; 1e-4 relative.
    c.row("loss, step 0", losses[0], ref_losses[0], tol=1e-5 * ref_losses[0])
    c.row(f"loss, step {STEPS - 1}", losses[-1], ref_losses[-1], tol=1e-4 * ref_losses[-1])
    c.below("params: max rel. difference", max_rel_diff(state.params, ref.params), 1e-4)
    c.below("batch_stats: max rel. difference",
            max_rel_diff(state.model_state["batch_stats"], ref.batch_stats), 1e-4)
    c.row("test accuracy (running statistics)", acc, ref_acc, tol=1 / len(data.y_test))
    c.below("1 - test accuracy (limit: 0.15)", 1 - acc, 0.15)

    # The analysis tools on the trained model, with its state and a key fixed (Loss.bind).
    loss = m.loss(cross_entropy, train=True).bind(state.model_state, jax.random.key(1))
    print()
    explanation = fg.explain_grads(loss, state.params, batches[0])
    print(explanation)
    report = fg.check_grads(loss, state.params, batches[0])
    print(report)
    print(f"\nmonitor layers: {', '.join(metrics['monitor'].layer_names)}; "
          f"alerts in {STEPS} steps: {len(alerts)}")
    names = ["params['BatchNorm_0']['bias']", "params['BatchNorm_0']['scale']",
             "params['Conv_0']['kernel']", "params['Dense_0']['bias']",
             "params['Dense_0']['kernel']"]
    c2 = Check("reports name flax's paths", left="reported", right="expected")
    c2.same("explain_grads leaves", [r.path for r in explanation.rows] == names, True)
    c2.same("explain_grads: all connected",
            {r.status for r in explanation.rows}, {"connected"})
    c2.same("check_grads leaves", [r.path for r in report.rows] == names, True)
    c2.same("check_grads passes", report.ok, True)
    c2.same("monitor layers", metrics["monitor"].layer_names,
            ("params['BatchNorm_0']", "params['Conv_0']", "params['Dense_0']"))
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
