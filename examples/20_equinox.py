"""An equinox CNN with stateful BatchNorm and dropout, trained by funcgrad and by equinox's loop.

`funcgrad.interop.from_equinox` splits the module with ``eqx.partition(model,
eqx.is_inexact_array)`` into params (``params.conv.weight``, ...) and the rest, and takes the
``eqx.nn.State`` of ``eqx.nn.make_with_state`` as the model state. Its loss calls the model as
equinox's examples do, per example under ``jax.vmap(..., axis_name="batch")`` with one dropout
key per example split from the step's key (``fold_in(key, step)``). The same steps through
equinox's documented loop (``eqx.filter_value_and_grad`` with state) give the same params,
statistics and test accuracy to float32 rounding. Then `explain_grads`, `check_grads` and the
gradient monitor name every leaf and layer by equinox's attribute paths.

    $ python examples/20_equinox.py
"""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg
from funcgrad.interop import from_equinox

STEPS, BATCH = 40, 32


class CNN(eqx.Module):
    """Conv 3x3 (8 channels, no bias: BatchNorm's shift replaces it) -> BatchNorm -> relu ->
    dropout 0.2 -> 2x2 mean pool -> Linear 10, on one 1x8x8 digit (CHW)."""
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    pool: eqx.nn.AvgPool2d
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 8, 3, padding=1, use_bias=False, key=k1)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="ema")
        self.dropout = eqx.nn.Dropout(0.2)
        self.pool = eqx.nn.AvgPool2d(2, 2)
        self.out = eqx.nn.Linear(128, 10, key=k2)

    def __call__(self, x, state, *, key=None):
        x, state = self.bn(self.conv(x), state)
        x = self.pool(self.dropout(jax.nn.relu(x), key=key))
        return self.out(x.reshape(-1)), state


def cross_entropy(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


def equinox_loop(model, state, batches, tx, base_key):
    """equinox's documented loop: eqx.filter_value_and_grad of a loss that vmaps the model
    over the batch (axis_name="batch") and returns the new state; optax on the model's
    floating arrays; the key of step s is fold_in(key, s), split per example."""

    @eqx.filter_jit
    def train_step(model, state, opt_state, batch, key):
        def loss_fn(model, state):
            keys = jax.random.split(key, batch["x"].shape[0])
            logits, state = jax.vmap(lambda x, state, key: model(x, state, key=key),
                                     axis_name="batch", in_axes=(0, None, 0),
                                     out_axes=(0, None))(batch["x"], state, keys)
            return cross_entropy(logits, batch), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    opt_state, losses = tx.init(eqx.filter(model, eqx.is_inexact_array)), []
    for s, batch in enumerate(batches):
        model, state, opt_state, loss = train_step(model, state, opt_state, batch,
                                                   jax.random.fold_in(base_key, s))
        losses.append(float(loss))
    return model, state, losses


def max_rel_diff(a, b) -> float:
    """max |a - b| / (|b| + 1e-3) over all elements (the 1e-3 for values near 0)."""
    pairs = [(np.asarray(x, np.float64), np.asarray(y, np.float64))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(float(np.max(np.abs(x - y) / (np.abs(y) + 1e-3))) for x, y in pairs)


def main() -> None:
    data = fg.load_digits(seed=0)
    x_train = data.x_train.reshape(-1, 1, 8, 8)
    order = np.random.default_rng(0).permutation(len(x_train))[:STEPS * BATCH]
    batches = [{"x": jnp.asarray(x_train[i]), "y": jnp.asarray(data.y_train[i])}
               for i in order.reshape(STEPS, BATCH)]
    x_test = jnp.asarray(data.x_test.reshape(-1, 1, 8, 8))

    model, model_state = eqx.nn.make_with_state(CNN)(jax.random.key(0))
    m = from_equinox(model, model_state)
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
    ref_model, ref_state, ref_losses = equinox_loop(model, model_state, batches, tx, state.key)

    # Evaluation with the running statistics: eqx.nn.inference_mode (no dropout).
    logits, _ = m.apply(state.params, state.model_state, x_test, train=False)
    ref_logits, _ = jax.vmap(eqx.nn.inference_mode(ref_model), axis_name="batch",
                             in_axes=(0, None), out_axes=(0, None))(x_test, ref_state)
    acc = float(fg.accuracy(logits, jnp.asarray(data.y_test)))
    ref_acc = float(fg.accuracy(ref_logits, jnp.asarray(data.y_test)))

    c = Check(f"equinox CNN, {STEPS} Adam steps of {BATCH}", right="equinox loop")
    # Two jitted float32 programs of the same operations (XLA may order sums differently):
    # agreement to float32 rounding, grown over 40 Adam steps; 1e-4 relative.
    c.row("loss, step 0", losses[0], ref_losses[0], tol=1e-5 * ref_losses[0])
    c.row(f"loss, step {STEPS - 1}", losses[-1], ref_losses[-1], tol=1e-4 * ref_losses[-1])
    c.below("params: max rel. difference",
            max_rel_diff(state.params, eqx.filter(ref_model, eqx.is_inexact_array)), 1e-4)
    c.below("BatchNorm statistics: max rel. diff.",
            max_rel_diff(state.model_state, ref_state), 1e-4)
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
    names = ["params.conv.weight", "params.bn.weight", "params.bn.bias", "params.out.weight",
             "params.out.bias"]
    c2 = Check("reports name equinox's paths", left="reported", right="expected")
    c2.same("explain_grads leaves", [r.path for r in explanation.rows] == names, True)
    c2.same("explain_grads: all connected",
            {r.status for r in explanation.rows}, {"connected"})
    c2.same("check_grads leaves", [r.path for r in report.rows] == names, True)
    c2.same("check_grads passes", report.ok, True)
    c2.same("monitor layers", metrics["monitor"].layer_names,
            ("params.conv", "params.bn", "params.out"))
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
