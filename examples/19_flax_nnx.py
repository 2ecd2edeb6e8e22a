"""A flax nnx CNN with BatchNorm and dropout, trained by funcgrad and by nnx's own loop.

`funcgrad.interop.from_nnx` splits the module (``nnx.split``) into params, every
``nnx.Param`` as a plain dict (``params['bn1']['scale']``, no ``.value`` level), and model
state: BatchNorm's running statistics and the dropout stream's key and integer count, which
advance at every step as in nnx's own loop, so dropout draws the same masks. The same steps
through nnx's documented loop (``nnx.Optimizer`` + ``nnx.value_and_grad``) give the same
params, statistics and test accuracy to float32 rounding. Then `explain_grads`, `check_grads`
and the gradient monitor name every leaf by nnx's paths and group them by module.

    $ python examples/19_flax_nnx.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check
from flax import nnx

import funcgrad as fg
from funcgrad.interop import from_nnx

STEPS, BATCH = 40, 32


class CNN(nnx.Module):
    """Conv 3x3 (8 channels, no bias: BatchNorm's shift replaces it) -> BatchNorm -> relu ->
    dropout 0.2 -> 2x2 mean pool -> Linear 10, on 8x8x1 digits (NHWC)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.bn1(self.conv1(x))))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        return self.out(x.reshape(x.shape[0], -1))


def cross_entropy(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


def nnx_loop(model, batches, tx):
    """nnx's documented loop: nnx.Optimizer and nnx.value_and_grad under nnx.jit; the model's
    BatchNorm statistics and dropout stream are updated in place."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda model: cross_entropy(model(batch["x"]), batch))(
            model)
        optimizer.update(model, grads)
        return loss

    return [float(train_step(model, optimizer, batch)) for batch in batches]


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

    model = CNN(nnx.Rngs(0, dropout=1))
    m = from_nnx(model)  # a copy: nnx's loop below trains `model` itself, in place
    print(m)
    tx = optax.adam(1e-2)
    # The monitor first in the chain: it measures the gradient and passes it to Adam unchanged.
    step = fg.make_train_step(m.loss(cross_entropy, train=True),
                              optax.chain(fg.grad_monitor(), tx))
    state = step.init(m.params, model_state=m.model_state)  # no key: nnx has its own Rngs
    losses, alerts = [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        alerts += fg.monitor_alerts(metrics["monitor"])
    ref_losses = nnx_loop(model, batches, tx)

    # Evaluation with the running statistics: model.eval() (BatchNorm on them, no dropout).
    logits, _ = m.apply(state.params, state.model_state, x_test, train=False)
    model.eval()
    ref_logits = model(x_test)
    acc = float(fg.accuracy(logits, jnp.asarray(data.y_test)))
    ref_acc = float(fg.accuracy(ref_logits, jnp.asarray(data.y_test)))

    c = Check(f"nnx CNN, {STEPS} Adam steps of {BATCH}", right="nnx loop")
    # Two jitted float32 programs of the same operations (XLA may order sums differently):
    # agreement to float32 rounding, grown over 40 Adam steps; 1e-4 relative.
    c.row("loss, step 0", losses[0], ref_losses[0], tol=1e-5 * ref_losses[0])
    c.row(f"loss, step {STEPS - 1}", losses[-1], ref_losses[-1], tol=1e-4 * ref_losses[-1])
    c.below("params: max rel. difference",
            max_rel_diff(state.params, nnx.to_pure_dict(nnx.state(model, nnx.Param))), 1e-4)
    c.below("BatchNorm statistics: max rel. diff.",
            max_rel_diff(state.model_state["bn1"],
                         nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))["bn1"]), 1e-4)
    c.same("dropout stream draws (rng count)",
           int(state.model_state["dropout"]["rngs"]["count"]),
           int(model.dropout.rngs.count.get_value()))
    c.row("test accuracy (running statistics)", acc, ref_acc, tol=1 / len(data.y_test))
    c.below("1 - test accuracy (limit: 0.15)", 1 - acc, 0.15)

    # The analysis tools on the trained model, with its state fixed (Loss.bind).
    loss = m.loss(cross_entropy, train=True).bind(state.model_state)
    print()
    explanation = fg.explain_grads(loss, state.params, batches[0])
    print(explanation)
    report = fg.check_grads(loss, state.params, batches[0])
    print(report)
    print(f"\nmonitor layers: {', '.join(metrics['monitor'].layer_names)}; "
          f"alerts in {STEPS} steps: {len(alerts)}")
    names = ["params['bn1']['bias']", "params['bn1']['scale']", "params['conv1']['kernel']",
             "params['out']['bias']", "params['out']['kernel']"]
    c2 = Check("reports name nnx's paths", left="reported", right="expected")
    c2.same("explain_grads leaves", [r.path for r in explanation.rows] == names, True)
    c2.same("explain_grads: all connected",
            {r.status for r in explanation.rows}, {"connected"})
    c2.same("check_grads leaves", [r.path for r in report.rows] == names, True)
    c2.same("check_grads passes", report.ok, True)
    c2.same("monitor layers (by module)", metrics["monitor"].layer_names,
            ("params['bn1']", "params['conv1']", "params['out']"))
    c.failed += c2.failed
    c.done()


if __name__ == "__main__":
    main()
