"""The train step's stages: differentiate, transform the gradient, guard, apply.

`funcgrad.make_train_step` is composed from these, the way optax chains gradient
transformations: each stage is a small function of one `Update` record (what one optimizer
update has computed so far), traced once into the same jitted program, so an option adds one
stage rather than branches through one function. In order:

1. `differentiate` (not a stage of the chain: it produces the `Update`): the loss under the
   contract of `funcgrad.train.loss`, its gradient w.r.t. the trained leaves (all, or those of a
   ``trainable`` mask), in a compute dtype and at a loss scale when asked, plus the new model
   state, the aux and the dead ReLUs of a monitored step;
2. `optimizer_stage`: the optax update (the user's chain, where clipping, zeroing of
   non-finite leaves and the gradient monitor are transformations: `funcgrad.train.transforms`)
   and the new params; the chain's records become metrics;
3. `norm_stage`: the global norm of the gradient (the pre-clip norm the chain recorded, else
   that of the trained leaves);
4. `guard_stage`: the update is applied only if the loss, the norm, every trained leaf's new
   value and the new model state are finite (a `jnp.where` per leaf, no host round trip);
5. `loss_scale_stage`: the dynamic loss scale's update.
`finish` turns the record into ``(TrainState, metrics)``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from funcgrad.train.clipping import all_finite, global_norm
from funcgrad.train.loss import Loss
from funcgrad.train.precision import scaled_value_and_grad
from funcgrad.train.transforms import ZeroNonfiniteState, keep_records, recorded, records

PyTree = Any


@dataclasses.dataclass
class Update:
    """One optimizer update as the stages build it (a trace-time record, never a jit output).

    `state` is the TrainState the update starts from; `loss`, `grads`, `model_state` (the new
    one, or None) and `aux` come from `differentiate`; `flags` says per params leaf whether it
    is trained. The stages fill in the rest and `metrics`.
    """
    state: Any
    loss: jax.Array
    grads: PyTree
    model_state: PyTree
    aux: PyTree
    dead: Any
    flags: Sequence[bool]
    metrics: dict = dataclasses.field(default_factory=dict)
    grad_norm: jax.Array | None = None
    monitor: Any = None
    grads_ok: jax.Array | None = None
    updates: PyTree = None
    new_params: PyTree = None
    opt_state: Any = None
    ok: jax.Array | None = None
    scale_state: Any = None

    def trained(self) -> list[jax.Array]:
        """The gradient leaves of the trained params (frozen leaves' exact zeros left out)."""
        return [g for g, f in zip(jax.tree.leaves(self.grads), self.flags) if f]

    def with_trained(self, trained: Sequence[jax.Array]) -> None:
        """Puts new gradient leaves for the trained params back into `grads`."""
        leaves, treedef = jax.tree.flatten(self.grads)
        it = iter(trained)
        self.grads = jax.tree.unflatten(treedef, [next(it) if f else g
                                                  for g, f in zip(leaves, self.flags)])


Stage = Callable[[Update], None]


def chain(*stages: Stage | None) -> Callable[[Update], Update]:
    """The stages (None entries skipped) applied in order to one `Update`."""
    active = [s for s in stages if s is not None]

    def run(update: Update) -> Update:
        for stage in active:
            stage(update)
        return update
    return run


def differentiate(loss: Loss, *, value_and_grad: Callable, compute_dtype: Any = None,
                  scaled: bool = False) -> Callable:
    """Returns ``f(params, batch, model_state, key, scale, dead_relu=False) -> (loss, grads,
    model_state, aux, dead)``: the loss under its contract and its gradient w.r.t. `params`.

    `value_and_grad` is ``jax.value_and_grad`` or one with its signature (a trainable mask's).
    With `compute_dtype` or `scaled`, the pass runs in `compute_dtype` (float32 if None) at
    loss `scale` and the gradient comes back float32 and unscaled
    (`funcgrad.train.precision.scaled_value_and_grad`); the model state is not cast (running
    statistics stay in their dtype, as PyTorch's autocast keeps BatchNorm in float32) and its
    new value is cast back to the old dtypes. With `dead_relu` the ReLUs of the loss are
    instrumented (`funcgrad.debug.dead_relu.with_dead_relu`).
    """
    from funcgrad.debug.dead_relu import with_dead_relu

    mixed = compute_dtype is not None or scaled

    def grads_of(params, batch, model_state, key, scale, dead_relu=False):
        def objective(p, b):
            out = loss(p, b, model_state=model_state, key=key)
            _check_scalar(out.loss)
            new_state = out.model_state
            if mixed and new_state is not None:
                new_state = jax.tree.map(lambda n, o: jnp.asarray(n).astype(jnp.result_type(o)),
                                         new_state, model_state)
            return out.loss, (new_state, out.aux)

        fn = objective
        if dead_relu:
            def fn(p, b):
                (value, rest), dead = with_dead_relu(objective)(p, b)
                return value, (rest, dead)
        if not mixed:
            (value, rest), grads = value_and_grad(fn, has_aux=True)(params, batch)
        else:
            (value, rest), grads = scaled_value_and_grad(
                fn, has_aux=True, value_and_grad=value_and_grad,
                compute_dtype=jnp.float32 if compute_dtype is None else compute_dtype,
            )(params, batch, scale)
        dead = None
        if dead_relu:
            rest, dead = rest
        new_state, aux = rest
        return value, grads, new_state, aux, dead

    return grads_of


def _check_scalar(loss: Any) -> None:
    if jnp.shape(loss) != ():
        raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}. Reduce it, "
                         "e.g. return per_example_loss.mean() (with make_train_step(..., "
                         "accumulate=K) return the per-example losses instead).")


def norm_stage(u: Update) -> None:
    """The global norm of the gradient (after `optimizer_stage`): the pre-clip norm a
    `funcgrad.clip_by_global_norm` in the chain recorded, else that of the trained leaves."""
    if u.grad_norm is None:
        u.grad_norm = global_norm(u.trained())
    u.metrics["grad_norm"] = u.grad_norm


def optimizer_stage(optimizer: optax.GradientTransformationExtraArgs,
                    learning_rate_of: Callable, gather: Callable | None = None,
                    monitor_note: str = "") -> Stage:
    """The optax update (given the loss as optax's ``value`` extra argument) and the new
    params; the records of funcgrad's transformations in the chain (`funcgrad.train.transforms`)
    become metrics. `gather`: applied to the updates first (the optimizer state sharded
    ZeRO-1 style gives sharded updates; `gather` replicates them, one all-gather, before
    anything reads them: `funcgrad.parallel.zero`)."""
    def stage(u: Update) -> None:
        u.updates, u.opt_state = optimizer.update(u.grads, u.state.opt_state, u.state.params,
                                                  value=u.loss)
        if gather is not None:
            u.updates = gather(u.updates)
        if (rate := learning_rate_of(u.opt_state)) is not None:
            u.metrics["learning_rate"] = rate
        u.new_params = optax.apply_updates(u.state.params, u.updates)
        got = recorded(u.opt_state)
        if "grad_norm" in got:
            u.grad_norm = got["grad_norm"]
            u.metrics["clip_coef"] = got["clip_coef"]
        if "nonfinite_leaves" in got:
            u.metrics["nonfinite_leaves"] = got["nonfinite_leaves"]
        if "monitor_state" in got:
            mstate = got["monitor_state"]
            wanted = mstate.monitor.dead_relu and u.dead is None
            u.monitor = mstate.metrics(u.dead, dead_relu_note=monitor_note if wanted else "")
    return stage


def guard_stage(*, locate: bool, optimistic: bool = False) -> Stage:
    """Applies the update only when it is finite: loss, global norm (unless the chain has a
    `funcgrad.zero_nonfinite`, which zeroes the non-finite gradient leaves first), every
    trained leaf's new value and every floating leaf of the new model state. A skipped update
    leaves params, optimizer state and model state as they were.

    One fused reduction over the new values (`all_finite`), read by a ``jnp.where`` per leaf.
    Cost (benchmarks/train_step.py, "guard cost", quiet 2-core CPU, 2026-12-01): XLA
    materialises Adam's new moments and params once for the test and selects them after it
    (38 -> 56 kernels for the 64-128-10 MLP); 1.06-1.12x at batch 256, 0.95-1.10x on a
    1.1M-parameter MLP, 1.55-1.78x at batch 32. A ``lax.cond`` measured 1.8x.
    """
    def stage(u: Update) -> None:
        zero = any(isinstance(r, ZeroNonfiniteState) for r in records(u.state.opt_state))
        u.grads_ok = jnp.isfinite(u.loss) & (
            jnp.bool_(True) if zero
            else jnp.isfinite(cast(jax.Array, u.grad_norm)))  # set by norm_stage, run before
        checked = [p for p, f in zip(jax.tree.leaves(u.new_params), u.flags) if f]
        if u.model_state is not None:
            checked += [x for x in jax.tree.leaves(u.model_state)
                        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
        u.ok = ok = u.grads_ok & all_finite(checked)
        if locate:  # per leaf, as the guard sees it (frozen leaves are not guarded)
            def finite(x, f):
                return (jnp.all(jnp.isfinite(x)) if f and jnp.issubdtype(
                    jnp.result_type(x), jnp.inexact) else jnp.bool_(True))
            u.metrics["update_finite"] = [finite(x, f) for x, f in
                                          zip(jax.tree.leaves(u.updates), u.flags)]
            u.metrics["params_finite"] = [finite(x, f) for x, f in
                                          zip(jax.tree.leaves(u.new_params), u.flags)]
            if u.model_state is not None:
                u.metrics["model_state_finite"] = [finite(x, True)
                                                   for x in jax.tree.leaves(u.model_state)]
        old = (u.state.params, u.state.opt_state, u.state.model_state)
        new = (u.new_params, u.opt_state, u.model_state)
        if u.model_state is None:
            old, new = old[:2] + (None,), new[:2] + (None,)
        if not optimistic:  # the records of the chain keep their new values (keep_records)
            u.new_params, u.model_state = jax.tree.map(
                lambda n, o: jnp.where(ok, n, o), (new[0], new[2]), (old[0], old[2]))
            u.opt_state = keep_records(new[1], old[1], ok)
        # "skipped" depends on the whole guard: the one output that tells a skip (a step
        # skipped for its update has a finite loss and norm).
        u.metrics["skipped"] = (~u.ok).astype(jnp.int32)
    return stage


def loss_scale_stage(loss_scale: Any) -> Stage:
    """The dynamic loss scale backs off only for an overflow of the (scaled) gradient; a
    non-finite update from a finite gradient is skipped without touching it."""
    def stage(u: Update) -> None:
        u.scale_state = loss_scale.update(u.state.loss_scale, u.grads_ok)
        u.metrics.update(loss_scale=u.state.loss_scale.scale,
                         skipped_total=u.scale_state.skipped_total)
    return stage


def finish(u: Update, *, has_aux: bool) -> tuple[Any, dict]:
    """The new TrainState and the metrics of the update."""
    state = u.state._replace(
        params=u.new_params, opt_state=u.opt_state, step=u.state.step + 1,
        loss_scale=u.state.loss_scale if u.scale_state is None else u.scale_state,
        model_state=u.model_state)
    metrics = {"loss": u.loss, **u.metrics}
    if u.monitor is not None:
        metrics["monitor"] = u.monitor
    if has_aux:
        metrics["aux"] = u.aux
    return state, metrics
