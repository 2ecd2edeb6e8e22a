"""Rematerialisation (checkpointing) that lowers the memory XLA really allocates.

PyTorch's ``torch.utils.checkpoint``; JAX's ``jax.checkpoint`` (``jax.remat``). Source article
A5.1: keep fewer activations in the forward pass and recompute them in the backward pass,
trading about one extra forward pass for memory; Chen et al. 2016, "Training deep nets with
sublinear memory cost": sqrt(n) segments of n layers keep O(sqrt n) activations.

**Why ``jax.checkpoint`` often saves nothing on XLA:CPU (jax 0.10.2; with jax 0.12.0.1's
XLA the barrier survives and ``jax.checkpoint`` alone saves, see the table in
docs/guide/memory.md).**
``jax.checkpoint`` puts an
``optimization_barrier`` on the recomputation's inputs so that XLA's common-subexpression
elimination (CSE) does not merge the recomputed forward with the original one. XLA:CPU's
pipeline removes every barrier early (its ``cse_barrier_expander`` pass, before layout
assignment) and then runs CSE (``simplification_after_layout_assignment``): the recomputed
matmuls are merged into the forward ones and the activations are kept after all, while the
remaining structure still changes buffer assignment. Measured (``benchmarks/remat.py``; the
16-layer tanh MLP of width 512 at batch 2048, ``temp + output`` of ``memory_analysis()``):
no remat 84 MiB; ``jax.checkpoint`` per layer 144 MiB, per 4-layer segment 96 MiB; the same
with the last segment left plain 96 MiB. XLA dumps (``--xla_dump_hlo_pass_re=.*``) show the
dot count fall from 13 to 11 at that CSE on a 4-layer example. The barrier matters twice:
with ``XLA_FLAGS=--xla_disable_hlo_passes=cse`` the recomputed dots survive (63 instead of 47)
but the memory stays at 96 MiB, because without the barrier the recomputation is scheduled
early, inside the forward pass; with ``--xla_disable_hlo_passes=cse_barrier_expander`` (the
barrier kept) ``jax.checkpoint`` per 4 layers gives 48 MiB, as `remat` does. That flag is
process-wide and changes every program; `remat` gets the same per function, without it.

**What keeps the recomputation.** `remat` makes the backward pass run the recomputation inside
a ``lax.cond`` whose predicate XLA cannot evaluate at compile time (one element of an input
compared with itself; both branches are the same computation, so the value is the same
whichever runs). CSE does not merge across a conditional's branches, and the
branch cannot start before the cotangent exists, so the recomputed activations live only
while their segment is differentiated: 48 MiB (0.57x) for 4 segments of 4 with the last one
kept, gradients bit-identical to no remat. On GPU and TPU, where XLA keeps the barriers and a
conditional costs a predicate read by the host, `remat` is ``jax.checkpoint`` itself
(``mechanism="auto"``); that choice is documented, not measured here (no GPU on this machine).

How low one recomputation per layer goes: while segment j is differentiated, the inputs of
the segments before it, the activations of segment j and a cotangent or two are alive. For the
MLP above (4 MiB activations, a 16 MiB gradient output) every segmentation we compiled, uniform
(4 x 4) or decreasing (6, 5, 4, 1 and 6, 4, 3, 2, 1), bottoms out at 48 MiB = 16 + 8 x 4 MiB
(0.57x). Going lower needs layers recomputed more than once (nested segments), i.e. more than
the one extra forward pass that keeps the step within about 1.3x of its time.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcgrad import _jax_internals as ji
from funcgrad.memory.segments import _bisection, _layers_in
from funcgrad.memory.segments import recompute_fraction as recompute_fraction
from funcgrad.memory.segments import segment_plan as segment_plan
from funcgrad.memory.segments import segment_sizes as segment_sizes

#: Policies JAX provides ready to use (pass these names as strings); the others in
#: ``jax.checkpoint_policies`` are factories: call them (``save_only_these_names("h1")``).
POLICY_NAMES = ("nothing_saveable", "everything_saveable", "dots_saveable",
                "dots_with_no_batch_dims_saveable", "checkpoint_dots",
                "checkpoint_dots_with_no_batch_dims")
_FACTORIES = ("save_only_these_names", "save_any_names_but_these",
              "save_anything_except_these_names", "save_and_offload_only_these_names",
              "save_from_both_policies", "offload_dot_with_no_batch_dims")
MECHANISMS = ("auto", "cond", "barrier")


def _policy(policy: Any) -> Callable | None:
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str):
        if policy in POLICY_NAMES:
            return getattr(jax.checkpoint_policies, policy)
        if policy in _FACTORIES:
            raise ValueError(
                f"remat: the policy {policy!r} needs arguments: pass "
                f"jax.checkpoint_policies.{policy}(...) (e.g. with the names given to "
                "jax.ad_checkpoint.checkpoint_name), not its name.")
        raise ValueError(f"remat: unknown policy {policy!r}; expected None, a callable from "
                         f"jax.checkpoint_policies, or one of {', '.join(POLICY_NAMES)}.")
    raise TypeError(f"remat: policy must be None, a name or a callable, got "
                    f"{type(policy).__name__}.")


def _mechanism(mechanism: str) -> str:
    if mechanism not in MECHANISMS:
        raise ValueError(f"remat: mechanism must be one of {MECHANISMS}, got {mechanism!r}.")
    if mechanism == "auto":
        return "cond" if jax.default_backend() == "cpu" else "barrier"
    return mechanism


def _runtime_true(*trees: Any) -> jax.Array:
    """A predicate that is true unless an element is NaN, which XLA cannot fold: the first
    element of the first floating leaf of `trees` compared with itself."""
    for leaf in jax.tree.leaves(trees):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not hasattr(leaf, "size"):  # a Python float (JAX's TypedFloat)
            leaf = jnp.asarray(leaf)
            dtype = leaf.dtype
        if jnp.issubdtype(dtype, jnp.inexact) and jnp.size(leaf):
            x = jnp.ravel(leaf)[0]
            return x == x
    return jnp.bool_(True)


def remat(fn: Callable | None = None, *, policy: Any = None, mechanism: str = "auto",
          static_argnums: int | Sequence[int] = ()) -> Callable:
    """``fn`` whose backward pass recomputes its intermediates instead of keeping them.

    Like ``jax.checkpoint(fn, policy=policy)``, but on XLA:CPU the recomputation really
    happens in the backward pass (see the module docstring for why ``jax.checkpoint`` alone is
    undone there): the returned function keeps only `fn`'s inputs (and what `policy` saves)
    from its forward pass.

    Args:
      fn: a pure function of pytrees of arrays (PRNG keys included: dropout inside `fn` draws
        the same mask in the recomputation, since the key is an input). Values it closes over
        and keyword arguments are allowed (traced ones are differentiated); positional
        arguments that are not arrays (strings, None, functions) are passed through as static.
      policy: what the forward pass may keep besides the inputs: None (nothing), a name from
        `POLICY_NAMES`, or a policy callable from ``jax.checkpoint_policies`` (e.g.
        ``save_only_these_names("h")`` with ``jax.ad_checkpoint.checkpoint_name``; the offload
        policies move saved values to host memory on GPU/TPU).
      mechanism: "cond" (the recomputation inside a lax.cond: effective on XLA:CPU), "barrier"
        (``jax.checkpoint``'s optimization barrier: what GPU and TPU honour), or "auto" (cond on
        CPU, barrier elsewhere).
      static_argnums: positional arguments that are Python values fn branches on (``if
        train:``), as in ``jax.checkpoint``; they are not traced.
    Returns:
      A function with `fn`'s signature and values. Called under ``jax.vmap`` (equinox's
      per-example models) or ``jax.jvp``, it is ``jax.checkpoint`` itself: a custom backward
      pass would build per-example gradients of unbatched weights under vmap, and cannot be
      forward-differentiated. Put the vmap inside instead: ``remat(jax.vmap(f))``.
      ``jax.linearize`` of it (not jax.grad) fails when its linear function is evaluated.
    Raises:
      ValueError / TypeError: for an unknown policy or mechanism, or a non-callable `fn`.
    """
    if fn is None:  # @remat(policy=...) as a decorator
        return functools.partial(remat, policy=policy, mechanism=mechanism,
                                 static_argnums=static_argnums)
    if not callable(fn):
        raise TypeError(f"remat needs a callable, got {type(fn).__name__}.")
    chosen_policy = _policy(policy)
    _mechanism(mechanism)  # validates it now, at the user's line

    static = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums)

    @functools.wraps(fn)
    def rematted(*args, **kwargs):
        # Static arguments (named in static_argnums, or not arrays at all: strings, None,
        # functions) and keyword arguments are bound to fn; keyword values that are traced
        # arrays are still differentiated (closure conversion below).
        fixed = {i for i, a in enumerate(args)
                 if i in static or not all(_is_array(leaf) for leaf in jax.tree.leaves(a))}
        traced = [a for i, a in enumerate(args) if i not in fixed]

        def bound(*traced_args):
            it = iter(traced_args)
            return fn(*(a if i in fixed else next(it) for i, a in enumerate(args)), **kwargs)

        if _mechanism(mechanism) == "barrier" or _batched_or_forward(traced, kwargs):
            return jax.checkpoint(bound, policy=chosen_policy)(*traced)
        return _cond_remat(bound, chosen_policy, traced)

    return rematted


def _batched_or_forward(*trees) -> bool:
    """Whether an input is being vmapped or forward-differentiated (jax.jvp).

    Under jax.vmap a custom backward pass runs once per example and builds the gradient of
    every unbatched input (a layer's weights) per example before summing it: 128 MiB instead
    of 1 MiB for one 256 x 256 layer at batch 256. jax.jvp cannot go through a custom_vjp at
    all. Both get jax.checkpoint itself, which handles them (remat(jax.vmap(f)) keeps the
    saving under vmap)."""
    tracers = ji.tracer_types()  # JVP and batching tracers: no public API names them
    for leaf in jax.tree.leaves(trees):
        while isinstance(leaf, jax.core.Tracer):
            if isinstance(leaf, tracers):
                return True
            leaf = getattr(leaf, "primal", getattr(leaf, "val", None))
    return False


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def _cond_remat(fn, policy, args):
    checkpointed = jax.checkpoint(fn, policy=policy, prevent_cse=False)
    # Values fn closes over that are being traced become explicit inputs, so that the
    # custom_vjp differentiates them too.
    converted, consts = jax.closure_convert(checkpointed, *args)
    if _batched_or_forward(consts):  # a closed-over value is vmapped or jvp-traced
        return jax.checkpoint(fn, policy=policy)(*args)
    n = len(args)

    @jax.custom_vjp
    def call(consts, *args):
        return converted(*args, *consts)

    def fwd(consts, *args):
        out, vjp_fn = jax.vjp(converted, *args, *consts)  # residuals: the vjp's saved values
        # The predicate comes from the inputs (first argument first: a layer's params), one
        # element read in the forward pass.
        return out, (vjp_fn, _runtime_true(args, consts))

    def bwd(res, cotangent):
        vjp_fn, pred = res

        def back(vjp_fn, cotangent):
            return vjp_fn(cotangent)
        cts = lax.cond(pred, back, back, vjp_fn, cotangent)
        return (list(cts[n:]), *cts[:n])

    call.defvjp(fwd, bwd)
    return call(list(consts), *args)


# --- a stack of layers in segments (their sizes: funcgrad/memory/segments.py) -------------

def remat_sequential(layer: Callable | Sequence[Callable], params: Sequence[Any], x: Any, *,
                     segments: Any = "sqrt", policy: Any = None, keep_last: bool = True,
                     mechanism: str = "auto") -> Any:
    """Applies ``h = layer_i(params[i], h)`` for i = 0..n-1, rematerialised in segments.

    The backward pass keeps each segment's input and recomputes the segment's activations
    when its turn comes (one extra forward pass of every layer outside the last segment). A
    nested segment is cut again inside its recomputation, so fewer activations are live at
    once for more recomputation ("log": O(log n) activations, Chen et al. 2016).

    Args:
      layer: ``layer(p, h) -> h``, one function for every layer or a sequence of n.
      params: a sequence of n per-layer param pytrees.
      x: the stack's input (any pytree of arrays the layers take).
      segments: see `segment_plan` ("sqrt", "log", an int k, sizes, or nested sizes).
      policy: as in `remat`.
      mechanism: as in `remat`.
      keep_last: the last segment (at every level) is not rematerialised: its activations are
        needed first in the backward pass, so recomputing them would cost time and save
        nothing (PyTorch's ``checkpoint_sequential`` does the same).
    Returns:
      the last layer's output.
    Raises:
      ValueError: for a bad `segments`, a policy JAX does not know, or a `layer` sequence of
        another length than `params`.
    """
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise TypeError(f"remat_sequential: params must be a list or tuple of per-layer params "
                        f"(one entry per layer), got {type(params).__name__}; for a dict of "
                        "layers pass list(params.values()) in layer order.")
    params = list(params)
    n = len(params)
    layers = list(layer) if isinstance(layer, Sequence) else [layer] * n
    if len(layers) != n:
        raise ValueError(f"remat_sequential: {len(layers)} layer functions for {n} param "
                         "entries; pass one function, or one per entry of params.")
    plan = segment_plan(n, segments)
    return _run_plan(plan, layers, params, x, policy, keep_last, mechanism)


def _run_plan(plan, layers, params, h, policy, keep_last, mechanism):
    start = 0
    for j, entry in enumerate(plan):
        size = _layers_in(entry)
        fns = layers[start:start + size]

        def segment(ps, h, fns=fns, entry=entry):
            if isinstance(entry, int):
                for f, p in zip(fns, ps):
                    h = f(p, h)
                return h
            return _run_plan(entry, fns, list(ps), h, policy, keep_last, mechanism)

        ps = params[start:start + size]
        start += size
        if keep_last and j == len(plan) - 1:  # one segment kept: no remat at this level
            h = segment(ps, h)
        else:
            h = remat(segment, policy=policy, mechanism=mechanism)(ps, h)
    return h


# --- a budget ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RematPlan:
    """The segmentation `plan_remat` chose.

    Attributes:
      segments: the (possibly nested) segments to pass to `remat_sequential` (``()``: no
        remat needed).
      keep_last: whether the last segment is left plain.
      bytes: compiled ``temp + output`` bytes of the gradient with this plan.
      baseline_bytes: the same without remat.
      budget: the fraction asked for.
      recompute: layers recomputed in the backward pass, as a fraction of the forward pass
        (0.75: three quarters of the layers run twice; above 1 with nested segments).
      candidates: every plan compiled, as (segments, bytes, recompute); ``()`` is no remat.
    """
    segments: tuple[int, ...]
    keep_last: bool
    bytes: int
    baseline_bytes: int
    budget: float
    recompute: float
    candidates: tuple[tuple[tuple[int, ...], int, float], ...]

    @property
    def fraction(self) -> float:
        return self.bytes / self.baseline_bytes

    def __str__(self) -> str:
        what = (f"segments {list(self.segments)}" if self.segments else "no remat")
        return (f"remat plan for a budget of {self.budget:g} x {self.baseline_bytes / 2**20:.1f} "
                f"MiB: {what}, {self.bytes / 2**20:.1f} MiB ({self.fraction:.2f}x), "
                f"recomputing {self.recompute:.0%} of the forward pass")


def _compiled_bytes(fn, *args) -> int:
    from funcgrad.memory.report import _compiled  # the report's compile-and-analyse step
    m = _compiled(jax.jit(fn), args)
    return m.temp_bytes + m.output_bytes


def _candidate_plans(n: int):
    # One level: uniform segments of k = n-1..1 layers (one segment of n kept plain would be
    # no remat). Two levels: each of those segments cut again into sqrt-sized ones. Then the
    # recursive halving ("log"). plan_remat compiles them in order of recomputation.
    for k in range(n - 1, 0, -1):
        outer = segment_sizes(n, k)
        yield outer
        inner = tuple(segment_sizes(m, "sqrt") if m >= 3 else m for m in outer)
        if inner != outer:
            yield inner
    if n >= 2:
        yield _bisection(n)


def plan_remat(layer: Callable | Sequence[Callable], params: Sequence[Any], x: Any,
               budget: float, *, head: Callable | None = None, policy: Any = None) -> RematPlan:
    """Chooses segments for `remat_sequential` so that the compiled gradient fits a budget.

    Compiles ``jax.grad`` of ``head(remat_sequential(layer, params, x, segments=s))`` with
    respect to `params` for no remat and for candidate plans s: every uniform segment size
    k = n-1..1 (last segment kept), the same segments each cut again into sqrt-sized ones
    (two levels), and the recursive halving ("log"); reads ``temp + output`` from XLA's
    ``memory_analysis()``, and returns the plan with the least recomputation
    (`recompute_fraction`) whose bytes are at most ``budget x`` the no-remat bytes (ties: the
    fewer bytes). Plans are compiled in order of recomputation, stopping at the first level
    that fits. What cannot be cut: the gradient output itself (the size of the params) and,
    at the last layer's backward step, its input activation and the output's cotangent.

    Args:
      layer: as in `remat_sequential`.
      params: as in `remat_sequential`.
      x: as in `remat_sequential`.
      budget: the fraction b in (0, 1] of the no-remat ``temp + output`` bytes.
      head: ``head(h) -> scalar`` after the stack (default ``0.5 * mean(h**2)``, any loss of
        the output gives the same activation memory up to its own temporaries).
    Returns:
      a `RematPlan` (``str()`` says what it chose and the recompute cost).
    Raises:
      ValueError: a budget outside (0, 1], or one no plan meets (the message gives the
        smallest fraction reached and what to do).
    """
    if not (isinstance(budget, (int, float)) and 0.0 < budget <= 1.0):
        raise ValueError(f"plan_remat: budget must be a fraction in (0, 1] of the no-remat "
                         f"memory, got {budget!r}.")
    head = head or (lambda h: 0.5 * jnp.mean(jnp.square(h)))
    params = list(params)
    n = len(params)
    if n < 2:
        raise ValueError(f"plan_remat: a stack of {n} layer(s) cannot be cut into segments; "
                         "remat needs at least two layers.")

    def grad_of(segments):
        def loss(params, x):
            if segments is None:
                h = x
                layers = list(layer) if isinstance(layer, Sequence) else [layer] * n
                for f, p in zip(layers, params):
                    h = f(p, h)
            else:
                h = remat_sequential(layer, params, x, segments=segments, policy=policy)
            return head(h)
        return jax.grad(loss)

    out = jax.eval_shape(lambda p, x: head(remat_sequential(layer, p, x, segments=n)),
                         params, x)
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
            and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(f"plan_remat: head must return a real scalar loss, got "
                         f"{jax.tree.map(lambda o: f'{o.dtype}{list(o.shape)}', out)}; for "
                         "(loss, aux) pass head=lambda h: my_head(h)[0].")
    baseline = _compiled_bytes(grad_of(None), params, x)
    candidates = [((), baseline, 0.0)]
    plans: dict[tuple, float] = {}
    for plan in _candidate_plans(n):
        plans.setdefault(plan, recompute_fraction(plan))
    # Least recomputation first; stop at the first recompute level where a plan fits.
    fitting = [c for c in candidates if c[1] <= budget * baseline]
    for level in sorted(set(plans.values())):
        if fitting:
            break
        for plan in (s for s, r in plans.items() if r == level):
            candidates.append((plan, _compiled_bytes(grad_of(plan), params, x), level))
        fitting = [c for c in candidates if c[1] <= budget * baseline]
    if not fitting:
        best = min(candidates, key=lambda c: c[1])
        raise ValueError(
            f"plan_remat: no segmentation fits {budget:g} x the no-remat {baseline / 2**20:.1f} "
            f"MiB; the smallest is {best[1] / baseline:.2f}x (segments {list(best[0])}, "
            f"recomputing {recompute_fraction(best[0]) if best[0] else 0:.0%} of the forward "
            "pass). Raise the budget, or cut memory elsewhere (smaller batch, accumulation).")
    segments, nbytes, recompute = min(fitting, key=lambda c: (c[2], c[1]))
    return RematPlan(segments, True, nbytes, baseline, float(budget), recompute,
                     tuple(candidates))
