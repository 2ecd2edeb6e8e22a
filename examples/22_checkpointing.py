"""Checkpointing (remat): trade a second forward pass for memory (A §5.1, concept 20).

PyTorch: ``torch.utils.checkpoint.checkpoint_sequential(model, segments, x)``. JAX:
``jax.checkpoint`` -- which, depending on the XLA release, may save nothing on XLA:CPU: with
jax 0.10.2 the compiler removes its optimization barrier and merges the recomputation back into
the forward pass (CSE); with jax 0.12.0.1 it keeps it (the table shows which you have).
``funcgrad.memory.remat_sequential`` keeps each segment's input and recomputes the segment in
the backward pass inside a conditional the compiler cannot merge away. The figures are XLA's
own (``temp + output`` of the compiled gradient's ``memory_analysis()``).

Dropout stays identical on the recompute because the PRNG key is an input of the recomputed
function; a hand-written recompute that draws a fresh key (what a stateful RNG does) computes
the gradient of another mask.

    $ python examples/22_checkpointing.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from _check import Check

from funcgrad.memory import plan_remat, remat, remat_sequential

N, WIDTH, BATCH = 9, 128, 512  # one activation: 512 x 128 x 4 bytes = 256 KiB


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"][None, :])


def plain(params, x):
    h = x
    for p in params:
        h = layer(p, h)
    return 0.5 * jnp.mean(h ** 2)


def naive(params, x):  # jax.checkpoint on segments of 3 layers, as its documentation shows
    def seg(ps, h):
        for p in ps:
            h = layer(p, h)
        return h
    h = x
    for i in range(0, N, 3):
        h = jax.checkpoint(seg)(params[i:i + 3], h)
    return 0.5 * jnp.mean(h ** 2)


def ours(params, x):
    return 0.5 * jnp.mean(remat_sequential(layer, params, x, segments="sqrt") ** 2)


def rel_diff(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(a, b))
    return (num / sum(float(jnp.sum(y ** 2)) for y in b)) ** 0.5


def memory_and_time(c: Check, params, x) -> None:
    rows = {}
    for name, fn in (("no remat", plain), ("jax.checkpoint, 3 segments", naive),
                     ("fg.remat_sequential, sqrt", ours)):
        compiled = jax.jit(jax.grad(fn)).lower(params, x).compile()
        m = compiled.memory_analysis()
        grads = jax.block_until_ready(compiled(params, x))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, x))
            times.append(time.perf_counter() - t0)
        rows[name] = (m.temp_size_in_bytes + m.output_size_in_bytes, np.median(times), grads)
    base_bytes, base_time, base_grads = rows["no remat"]
    print(f"  {'':36}{'temp+output MiB':>16} {'x':>6} {'time x':>7}")
    for name, (b, t, _) in rows.items():
        print(f"  {name:<36}{b / 2**20:>16.1f} {b / base_bytes:>6.2f} {t / base_time:>7.2f}")
    # The gradient is the same computation, recompiled: equal to float32 rounding.
    for name in ("jax.checkpoint, 3 segments", "fg.remat_sequential, sqrt"):
        c.row(f"{name}: grad rel. diff", rel_diff(rows[name][2], base_grads), 0.0, tol=1e-5)
    # Counting 256 KiB activations (funcgrad/memory/checkpointing.py): no remat keeps all 9; 3
    # segments of 3 (sqrt 9) with the last kept hold at worst 2 segment inputs, 3 activations and a
    # cotangent or two, about 6 of the 9.
    ratio = rows["fg.remat_sequential, sqrt"][0] / base_bytes
    c.row("fg remat memory <= 0.75x (1 = yes)", float(ratio <= 0.75), 1.0)
    # What jax.checkpoint alone saves is the compiler's choice (module docstring): shown, and
    # funcgrad's remat must never hold more than it (5% for layout differences).
    naive_ratio = rows["jax.checkpoint, 3 segments"][0] / base_bytes
    print(f"  jax {jax.__version__}: jax.checkpoint alone keeps {naive_ratio:.2f}x of no remat"
          + (" (XLA merged its recomputation back)" if naive_ratio >= 0.95 else ""))
    c.row("fg remat <= jax.checkpoint's bytes (1 = yes)",
          float(rows["fg.remat_sequential, sqrt"][0]
                <= 1.05 * rows["jax.checkpoint, 3 segments"][0]),
          1.0)


def budget(c: Check, params, x) -> None:
    plan = plan_remat(layer, params, x, 0.75)
    print(f"  {plan}")
    c.row("plan fits 0.75 x no remat (1 = yes)", float(plan.bytes <= 0.75 * plan.baseline_bytes),
          1.0)


def dropout(c: Check, params, x) -> None:
    key = jax.random.key(7)

    def drop_layer(p, h, key):
        keep = jax.random.bernoulli(key, 0.5, h.shape)
        return jnp.where(keep, 2.0 * layer(p, h), 0.0)

    def loss(p, fn):
        return jnp.sum(fn(p, x, key) ** 2)

    exact = jax.grad(loss)(params[0], drop_layer)
    c.row("remat(dropout) grad rel. diff", rel_diff(jax.grad(loss)(params[0], remat(drop_layer)),
                                                    exact), 0.0, tol=1e-5)

    @jax.custom_vjp
    def buggy(p, h):
        return drop_layer(p, h, key)

    def fwd(p, h):
        return buggy(p, h), (p, h)

    def bwd(res, g):  # recomputes with the "next" key, as a stateful RNG would
        return jax.vjp(lambda p, h: drop_layer(p, h, jax.random.split(key)[0]), *res)[1](g)

    buggy.defvjp(fwd, bwd)
    wrong = jax.grad(lambda p: jnp.sum(buggy(p, x) ** 2))(params[0])
    diff = rel_diff(wrong, exact)
    print(f"  a recompute with an advanced key: grad rel. diff {diff:.2f} (another mask)")
    c.row("advanced key gives another grad (1 = yes)", float(diff > 0.1), 1.0)


def main() -> None:
    keys = jax.random.split(jax.random.key(0), N + 1)
    params = [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
               "b": jnp.zeros((WIDTH,))} for k in keys[:N]]
    x = jax.random.normal(keys[N], (BATCH, WIDTH))
    c = Check(f"{N}-layer tanh MLP, width {WIDTH}, batch {BATCH}: jit(grad)", right="reference")
    memory_and_time(c, params, x)
    budget(c, params, x)
    dropout(c, params, x)
    c.done()


if __name__ == "__main__":
    main()
