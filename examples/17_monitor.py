"""A gradient monitor in the jitted step: a deep tanh net that explodes, a deep sigmoid net that
vanishes, and ReLU nets whose units die (article A §4.2, B §4.3; concept 16).

Every step computes, inside ``jit``, the global and per-layer gradient norms, per-leaf norm /
mean / std, the dead-ReLU fraction of each ReLU, and three flags against a baseline taken from
the first steps. The alerts are checked against a second method: the gradients recomputed
with ``jax.grad`` from the saved parameters, their norms taken in float64 NumPy, the dead units
counted from NumPy pre-activations, and the alert rules applied again in plain Python.

    $ python examples/17_monitor.py
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg
from funcgrad.train.alerts import monitor_alerts
from funcgrad.train.monitor import GradMonitor, with_dead_relu

STEPS = 30


def _init(seed, sizes, *, scale, hidden_bias=0.0):
    """Weights N(0, scale^2 / fan_in); hidden biases `hidden_bias`, output bias 0 (float32).
    Drawn with NumPy: each eager JAX call of a new shape would compile a kernel first."""
    rng = np.random.default_rng(seed)
    last = len(sizes) - 2
    return [{"w": jnp.asarray(scale * rng.standard_normal((a, b)) / math.sqrt(a), jnp.float32),
             "b": jnp.asarray(np.full((b,), 0.0 if i == last else hidden_bias), jnp.float32)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]


def _train(loss_fn, params, batch, tx, monitor):
    """STEPS full-batch steps; returns the params before each step and each step's metrics."""
    value_and_grad = jax.value_and_grad(with_dead_relu(loss_fn), has_aux=True)

    @jax.jit
    def step(params, opt_state, mstate):
        (loss, dead), grads = value_and_grad(params, batch)
        mstate, metrics = monitor.measure(mstate, grads, loss=loss, dead_relu=dead)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mstate, metrics

    opt_state, mstate, history, metrics = tx.init(params), monitor.init(params), [], []
    for _ in range(STEPS):
        history.append(params)
        params, opt_state, mstate, m = step(params, opt_state, mstate)
        metrics.append(jax.device_get(m))
    return history, metrics


_GRADS = {}  # one compiled jax.grad per loss function

#: Float32 norms inside the step against float64 NumPy differ by ~1e-7 relative; a value within
#: this much of its threshold is a tie, decided either way by rounding (the CPU's code path,
#: the XLA release), so the second method takes the monitor's own verdict there.
TIE = 1e-5


def _above(value, limit, theirs):
    """value > limit, or the monitor's verdict `theirs` when the two are within `TIE`."""
    return theirs if abs(value - limit) <= TIE * abs(limit) else value > limit


def _reference(loss_fn, history, batch, monitor, got):
    """Second method: float64 norms of jax.grad's gradients at the same parameters as each
    step, and the monitor's documented rules applied again in plain Python: the baseline is
    the mean of the first `warmup` finite norms that did not explode against the mean so far
    (an explosion during warmup is reported and left out); an alert fires above
    explode_factor x that mean. Returns the norms, layer norms, alerts and the baseline."""
    grad = _GRADS.setdefault(loss_fn, jax.jit(jax.value_and_grad(loss_fn)))
    norms, layer_norms, alerts, kept, streak, clear = [], [], [], [], None, None
    got = set(got)
    for i, params in enumerate(history):
        loss, grads = grad(params, batch)
        layers = [np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                              for g in jax.tree.leaves(layer))) for layer in grads]
        total = float(np.sqrt(np.sum(np.square(layers))))
        norms.append(total)
        layer_norms.append(layers)
        if not (math.isfinite(total) and math.isfinite(float(loss))):
            alerts.append((i, "nonfinite", "global"))
        exploding = bool(kept) and math.isfinite(total) and _above(
            total, monitor.explode_factor * np.mean(kept), (i, "explosion", "global") in got)
        if exploding:
            alerts.append((i, "explosion", "global"))
        elif len(kept) < monitor.warmup and math.isfinite(total):
            kept.append(total)
        # Vanishing: below the floor and below vanish_ratio of the global norm; a streak that
        # reached vanish_steps lasts until vanish_steps clear steps in a row.
        small = [n < monitor.vanish_floor and n < monitor.vanish_ratio * total for n in layers]
        clear = [0 if v else c + 1 for v, c in zip(small, clear or [0] * len(layers))]
        streak = [s + 1 if v or (s >= monitor.vanish_steps and c < monitor.vanish_steps) else 0
                  for v, s, c in zip(small, streak or [0] * len(layers), clear)]
        alerts += [(i, "vanishing", f"params[{j}]") for j, s in enumerate(streak)
                   if s == monitor.vanish_steps]
    return np.array(norms), np.array(layer_norms), alerts, float(np.mean(kept))


def _alerts(metrics):
    out, previous = [], None
    for m in metrics:
        out += monitor_alerts(m, previous=previous)
        previous = m
    return out


def _compare(c, loss_fn, batch, history, metrics, monitor):
    alerts = _alerts(metrics)
    got = [(a.step, a.kind, a.where) for a in alerts if a.kind != "dead_relu"]
    norms, layer_norms, ref_alerts, baseline = _reference(loss_fn, history, batch, monitor, got)
    got_norms = np.array([float(m.grad_norm) for m in metrics])
    got_layers = np.array([m.layer_norm for m in metrics])
    # float32 sums inside the step against float64 NumPy: relative error ~1e-6.
    c.below("max rel. error, global norm", np.max(np.abs(got_norms / norms - 1)), 1e-5)
    c.below("max rel. error, layer norms",
            np.max(np.abs(got_layers - layer_norms) / np.maximum(layer_norms, 1e-30)), 1e-5)
    c.same("norm alerts (kind: count)", _summary(got), _summary(ref_alerts))
    c.same("norm alerts, all identical", got == ref_alerts, True)
    return alerts, norms, layer_norms, baseline


def _summary(alerts):
    kinds = {}
    for _, kind, _ in alerts:
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) or "none"


def _show(alerts, limit=4):
    for a in alerts[:limit]:
        print(f"    {a}")
    if len(alerts) > limit:
        print(f"    ... {len(alerts) - limit} more")


def main() -> None:
    data = fg.load_digits(seed=0)
    batch = {"x": jnp.asarray(data.x_train[:256]), "y": jnp.asarray(data.y_train[:256])}

    def loss_for(activation):
        def loss_fn(params, batch):
            logits = fg.mlp_apply(params, batch["x"], activation=activation)
            return fg.softmax_cross_entropy(logits, batch["y"])
        return loss_fn

    # 1. Exploding: 8 tanh layers, weights 3x the usual 1/sqrt(fan_in) scale, SGD with
    #    learning rate 10 (20x one that trains, below; at 5 the largest norm, ~9x the
    #    baseline, sat too close to the threshold to hold on every machine). The baseline is
    #    the mean global norm of the first 5 steps; an alert fires on a step above 10x that.
    tanh = loss_for("tanh")
    monitor = GradMonitor(warmup=5, explode_factor=10.0)
    params = _init(0, (64,) + (64,) * 8 + (10,), scale=3.0)
    history, metrics = _train(tanh, params, batch, optax.sgd(10.0), monitor)
    c = Check("1. deep tanh net (8 x 64, init 3x), SGD lr 10: explosion", right="2nd method")
    alerts, norms, _, baseline = _compare(c, tanh, batch, history, metrics, monitor)
    # The trajectory of SGD at lr 10 is chaotic: which steps explode, and so which 5 norms make
    # the baseline, varies with the last bit of float32 rounding (the CPU's code path, the XLA
    # release). Both methods see the same parameters at each step, so they agree whatever the
    # trajectory; float32 sums against float64: tolerance 1e-5 relative.
    c.row("baseline (mean of the kept norms)", metrics[-1].baseline, baseline,
          tol=1e-5 * baseline)
    c.same("explosion alerts raised", any(a.kind == "explosion" for a in alerts), True)
    # Per-leaf mean and std of step 0's gradient against NumPy; errors in units of the leaf's
    # root-mean-square (a mean near 0 has no useful relative error). One-pass float32 var:
    # error ~eps * E[g^2], i.e. ~1e-7 rms.
    leaves = [np.asarray(g, np.float64).ravel()
              for g in jax.tree.leaves(jax.grad(tanh)(history[0], batch))]
    rms = np.array([np.sqrt(np.mean(g ** 2)) for g in leaves])
    c.below("max |leaf mean - NumPy| / rms",
            np.max(np.abs(metrics[0].leaf_mean - [g.mean() for g in leaves]) / rms), 1e-5)
    c.below("max |leaf std - NumPy| / rms",
            np.max(np.abs(metrics[0].leaf_std - [g.std() for g in leaves]) / rms), 1e-5)
    _show(alerts)

    # The same net with learning rate 0.5 trains, and the monitor stays quiet.
    history, metrics = _train(tanh, params, batch, optax.sgd(0.5), monitor)
    print()
    c2 = Check("   the same net, SGD lr 0.5: no alert", right="2nd method")
    _compare(c2, tanh, batch, history, metrics, monitor)
    c2.below(f"loss after {STEPS} steps (limit: step 0's)", metrics[-1].loss, metrics[0].loss)

    # 2. Vanishing: 12 sigmoid layers of 32. sigmoid' <= 1/4, so each layer scales the cotangent
    #    down; the first layers' norms sit far below the floor 1e-6, and below 1% of the global
    #    norm (the loss is still high: not a converged model), for 5 steps in a row.
    sigmoid = loss_for("sigmoid")
    monitor = GradMonitor(vanish_floor=1e-6, vanish_steps=5)
    params = _init(1, (64,) + (32,) * 12 + (10,), scale=1.0)
    history, metrics = _train(sigmoid, params, batch, optax.sgd(0.1), monitor)
    print()
    c3 = Check("2. deep sigmoid net (12 x 32), SGD lr 0.1: vanishing", right="2nd method")
    alerts, _, layer_norms, _ = _compare(c3, sigmoid, batch, history, metrics, monitor)
    ratio = layer_norms[0][0] / layer_norms[0][-1]
    c3.row("norm of layer 0 / last layer, step 0", metrics[0].layer_norm[0]
           / metrics[0].layer_norm[-1], ratio, tol=1e-5 * ratio)
    c3.same("params[0] reported vanishing", any(a.where == "params[0]" for a in alerts), True)
    _show(alerts)

    # 3. Dying ReLU: hidden biases start at -6 (a bad init). Most units are dead for the whole
    #    batch from step 0 and more die as Adam trains; the alert fires when 85% are dead.
    #    With biases at -20 every unit is dead: layer 0 gets exactly zero gradient, so it is
    #    also reported as vanishing, and the units can never come back.
    relu = loss_for("relu")
    for bias, lr in [(-6.0, 1e-2), (-20.0, 1e-2)]:
        monitor = GradMonitor(vanish_steps=5, dead_threshold=0.85)
        params = _init(2, (64, 128, 10), scale=math.sqrt(2.0), hidden_bias=bias)
        history, metrics = _train(relu, params, batch, optax.adam(lr), monitor)
        print()
        c4 = Check(f"3. ReLU net 64-128-10, hidden bias {bias:g}, Adam lr {lr:g}: dying units",
                   right="2nd method")
        alerts, _, _, _ = _compare(c4, relu, batch, history, metrics, monitor)
        # Dead units from NumPy: pre-activation x W0 + b0 <= 0 for all 256 examples. A unit
        # whose largest pre-activation is within float32 rounding of 0 could count differently
        # in the two methods: at most one unit, 1/128.
        x = np.asarray(batch["x"], np.float64)
        ref = [np.mean(np.all(x @ np.asarray(p[0]["w"], np.float64)
                              + np.asarray(p[0]["b"], np.float64) <= 0, axis=0))
               for p in history]
        got = [float(m.dead_fraction[0]) for m in metrics]
        c4.below("max |dead fraction - NumPy|", np.max(np.abs(np.subtract(got, ref))), 1 / 128)
        c4.row("dead fraction, step 0", got[0], ref[0], tol=1 / 128)
        c4.row("dead fraction, last step", got[-1], ref[-1], tol=1 / 128)
        c4.same("dead_relu alerts (crossings)", sum(a.kind == "dead_relu" for a in alerts),
                sum(1 for a, b in zip([0.0, *ref], ref) if b >= 0.85 > a))
        if bias == -20.0:
            c4.row("params[0] grad norm, every step (max)",
                   max(float(m.layer_norm[0]) for m in metrics), 0.0)
        _show(alerts)
        c.failed += c4.failed
    c.failed += c2.failed + c3.failed
    c.done()


if __name__ == "__main__":
    main()
