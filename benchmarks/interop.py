"""The train step on flax (linen, nnx) and equinox models through `funcgrad.interop`, against
hand-written ``jax.jit`` steps on the same split state, in one run (issue 13, point 5).

For each library the same small CNN (conv 3x3, 16 channels -> BatchNorm -> relu -> dropout 0.2 ->
2x2 mean pool -> dense 10) on digits as 8x8 images, batch 32, Adam:
  * "hand": a ``jax.jit`` step written by hand on the split state (params, model state): the
    library's own forward pass (linen ``module.apply(..., mutable=["batch_stats"],
    rngs={"dropout": fold_in(key, step)})``, nnx ``nnx.merge`` + call + ``nnx.split``, equinox
    ``eqx.combine`` + call under ``vmap`` with ``eqx.nn.State``), ``value_and_grad(has_aux=True)``,
    optax update; returns the loss and the new model state. The issue's baseline.
  * "hand, same": the same plus what funcgrad's step also does: the step counter, the global
    norm, the non-finite guard on the loss, the norm, the new params and the new model state
    (a ``jnp.where`` per leaf) and the "skipped" flag.
  * "funcgrad": ``fg.make_train_step(m.loss(...), tx)`` on ``m = fg.interop.from_*(...)``.
funcgrad / "hand" is what a user pays for the adapter and the step's guarantees;
funcgrad / "hand, same" isolates the adapter and funcgrad's code from the guard's work
(measured in benchmarks/train_step.py). ``nnx.jit`` is not timed: flax documents it as
several times slower than ``jax.jit`` at depth, and the adapter splits once, outside the step.
Shuffled rounds, medians (`_timing`). Prints a table and writes JSON.

    $ python benchmarks/interop.py [--steps 50] [--repeats 41] \
          [--out benchmarks/results/interop.json]
"""
import jax
import jax.numpy as jnp
import optax
from _timing import (
    medians,
    paired_ratio,
    ratio_quartiles,
    rounds,
    step_args,
    step_runner,
    write_results,
)

import funcgrad as fg

LIMIT = 1.05
BATCH = 32


def _batch():
    data = fg.load_digits(seed=0)
    return {"x": jnp.asarray(data.x_train[:BATCH].reshape(BATCH, 8, 8, 1)),
            "y": jnp.asarray(data.y_train[:BATCH])}


def _xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _guarded(params, opt_state, model_state, new_params, new_opt, new_state, loss, grads):
    norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(norm)
    for leaf in jax.tree.leaves((new_params, new_state)):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(leaf))
    kept = jax.tree.map(lambda n, o: jnp.where(ok, n, o), (new_params, new_opt, new_state),
                        (params, opt_state, model_state))
    return kept, norm, (~ok).astype(jnp.int32)


def _hand_steps(tx, loss_of):
    """"hand" and "hand, same" around ``loss_of(params, model_state, batch, key) -> (loss,
    new_model_state)``."""
    def grads(carry, batch, key):
        params, _, model_state, step = carry
        return jax.value_and_grad(loss_of, has_aux=True)(params, model_state, batch,
                                                         jax.random.fold_in(key, step))

    @jax.jit
    def hand(carry, batch, key):
        params, opt_state, _, step = carry
        (loss, new_state), g = grads(carry, batch, key)
        updates, opt_state = tx.update(g, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, new_state, step + 1), loss

    @jax.jit
    def same(carry, batch, key):
        params, opt_state, model_state, step = carry
        (loss, new_state), g = grads(carry, batch, key)
        updates, new_opt = tx.update(g, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        (params, opt_state, model_state), norm, skipped = _guarded(
            params, opt_state, model_state, new_params, new_opt, new_state, loss, g)
        return (params, opt_state, model_state, step + 1), (loss, norm, skipped)
    return hand, same


def _linen_case(tx):
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(16, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    module, batch = CNN(), _batch()
    variables = module.init(jax.random.key(0), batch["x"], train=False)
    m = fg.interop.from_linen(module, variables)

    def loss_of(params, model_state, batch, key):
        logits, updates = module.apply({"params": params, **model_state}, batch["x"], train=True,
                                       rngs={"dropout": key}, mutable=["batch_stats"])
        return _xent(logits, batch), updates

    return m, m.loss(_xent, train=True), loss_of


def _nnx_case(tx):
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.head = nnx.Linear(16 * 16, 10, rngs=rngs)

        def __call__(self, x):
            x = self.drop(nnx.relu(self.bn(self.conv(x))))
            x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
            return self.head(x.reshape(x.shape[0], -1))

    model = CNN(nnx.Rngs(0, dropout=1))
    model.train()
    m = fg.interop.from_nnx(model)
    graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    params_state = nnx.state(model, nnx.Param)
    rest_state = nnx.state(model, nnx.Not(nnx.Param))

    def loss_of(params, model_state, batch, key):  # the split state as nnx keeps it
        del key  # nnx draws dropout keys from its own Rngs in the model state
        # fresh Variables at this trace level (nnx refuses to mutate ones made by jit's)
        model_state = jax.tree.map(lambda x: x, model_state)
        model = nnx.merge(graphdef, params, model_state)
        logits = model(batch["x"])
        return _xent(logits, batch), nnx.state(model, nnx.Not(nnx.Param))

    return m, m.loss(_xent, train=True), loss_of, (params_state, rest_state)


def _equinox_case(tx):
    import equinox as eqx

    class CNN(eqx.Module):
        conv: eqx.nn.Conv2d
        bn: eqx.nn.BatchNorm
        drop: eqx.nn.Dropout
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(1, 16, 3, padding=1, use_bias=False, key=k1)
            self.bn = eqx.nn.BatchNorm(16, axis_name="batch", momentum=0.9, mode="ema")
            self.drop = eqx.nn.Dropout(0.2)
            self.head = eqx.nn.Linear(16 * 16, 10, key=k2)

        def __call__(self, x, state, *, key):
            x = self.conv(jnp.transpose(x, (2, 0, 1)))
            x, state = self.bn(x, state)
            x = self.drop(jax.nn.relu(x), key=key)
            x = x.reshape(16, 4, 2, 4, 2).mean((2, 4))
            return self.head(x.reshape(-1)), state

    model, state = eqx.nn.make_with_state(CNN)(jax.random.key(0))
    m = fg.interop.from_equinox(model, state)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_of(params, model_state, batch, key):
        model = eqx.combine(params, static)
        keys = jax.random.split(key, batch["x"].shape[0])
        logits, new_state = jax.vmap(lambda x, s, k: model(x, s, key=k), axis_name="batch",
                                     in_axes=(0, None, 0), out_axes=(0, None))(
            batch["x"], model_state, keys)
        return _xent(logits, batch), new_state

    return m, m.loss(_xent, train=True), loss_of, (params, state)


def main():
    args = step_args(__doc__, steps=50, repeats=41, out="benchmarks/results/interop.json")
    tx = optax.adam(1e-3)
    batch, key = _batch(), jax.random.key(0)
    cases = {"flax.linen": _linen_case, "flax.nnx": _nnx_case, "equinox": _equinox_case}
    rows = []
    for name, make in cases.items():
        made = make(tx)
        m, loss, loss_of = made[:3]
        hand_params, hand_state = made[3] if len(made) > 3 else (m.params, m.model_state)
        hand, same = _hand_steps(tx, loss_of)
        carry = (hand_params, tx.init(hand_params), hand_state, jnp.zeros((), jnp.int32))
        step = fg.make_train_step(loss, tx)
        state = m.init_state(step, seed=0)
        runs = {"hand": step_runner(hand, carry, batch, key),
                "hand, same": step_runner(same, carry, batch, key),
                "funcgrad": step_runner(step, state, batch)}
        times = rounds(runs, args.steps, args.repeats)
        med = medians(times)
        row = {"library": name, "batch": BATCH,
               **{f"us_{k.replace(', ', '_')}": 1e6 * v for k, v in med.items()},
               "funcgrad_over_hand": paired_ratio(times, "funcgrad", "hand"),
               "funcgrad_over_hand_q": ratio_quartiles(times, "funcgrad", "hand"),
               "funcgrad_over_hand_same": paired_ratio(times, "funcgrad", "hand, same"),
               "funcgrad_over_hand_same_q": ratio_quartiles(times, "funcgrad", "hand, same")}
        rows.append(row)
    print(f"\n{'library':<11} {'hand us':>8} {'same us':>8} {'fg us':>8} {'fg/hand':>16} "
          f"{'fg/same':>16}")
    for r in rows:
        q, qs = r["funcgrad_over_hand_q"], r["funcgrad_over_hand_same_q"]
        print(f"{r['library']:<11} {r['us_hand']:8.0f} {r['us_hand_same']:8.0f} "
              f"{r['us_funcgrad']:8.0f} {r['funcgrad_over_hand']:5.2f} ({q[0]:.2f}-{q[1]:.2f}) "
              f"{r['funcgrad_over_hand_same']:5.2f} ({qs[0]:.2f}-{qs[1]:.2f})")
    print(f"target: funcgrad / hand <= {LIMIT}")
    write_results(args.out, rows, steps=args.steps, repeats=args.repeats, limit=LIMIT)


if __name__ == "__main__":
    main()
