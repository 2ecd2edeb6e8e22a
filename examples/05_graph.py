"""Record, don't derive: the graph JAX records, its fan-out points and its residuals (concept 1).

1. y = x*w + b traced: two equations, three leaves, the residuals mul keeps.
2. The two-layer MLP with softmax cross-entropy: its graph as text, as DOT text in
   runs/graphs/mlp.dot and, when Graphviz's `dot` is installed, as runs/graphs/mlp.svg.
3. Fan-out: in f(x) = x*x the value x is used twice, so the backward pass adds two
   cotangents: dL/dx = 3 + 3 = 6 at x = 3.
4. The MLP's residuals: the bytes its layers save for the backward pass, counted by hand.

    $ python examples/05_graph.py
"""
import pathlib
import shutil

import jax
import jax.numpy as jnp
from _check import Check

import funcgrad as fg
from funcgrad.debug.graph import trace

OUT = pathlib.Path("runs/graphs")


def affine(x, w, b):
    return x * w + b


def mlp_loss(params, x, y):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, x), y)


def main() -> None:
    # 1. y = x*w + b with float32 scalars x=2, w=3, b=1.
    g = trace(affine, jnp.float32(2.0), jnp.float32(3.0), jnp.float32(1.0))
    print(g, "\n")
    c = Check("y = x*w + b, traced")
    c.row("equations (mul, add)", len(g.nodes), 2)
    c.row("leaves (x, w, b)", len(g.leaves), 3)
    # mul's vjp: ct_x = ct*w and ct_w = ct*x, so it keeps w and x: 2 x 4 B; add keeps nothing.
    c.row("residual bytes", g.residual_bytes, 2 * 4)

    # 2. The two-layer MLP, 64 -> 32 -> 10, batch 8: graph as text and as DOT.
    params = fg.mlp_init(jax.random.key(0), (64, 32, 10))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    y = jnp.arange(8, dtype=jnp.int32) % 10
    mlp = trace(mlp_loss, params, x, y)
    print("\n" + mlp.to_text(), "\n")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mlp.dot").write_text(mlp.to_dot())
    print(f"DOT written to {OUT / 'mlp.dot'}")
    if shutil.which("dot"):
        print(f"SVG written to {mlp.render(OUT / 'mlp.svg')}")
    else:
        print("note: Graphviz's `dot` program is not installed, so no SVG was drawn "
              "(apt install graphviz / brew install graphviz); the .dot file opens in any DOT "
              "viewer.")

    # 3. Fan-out. f(x) = x*x records one mul whose two operands are both x: two uses.
    def square(x):
        return x * x

    sq = trace(square, jnp.float32(3.0))
    (fan,) = sq.fanouts
    dx = jax.grad(square)(jnp.float32(3.0))
    # With the two uses as separate inputs, f(a, b) = a*b: df/da = b = 3 and df/db = a = 3.
    da, db = jax.grad(lambda a, b: a * b, argnums=(0, 1))(jnp.float32(3.0), jnp.float32(3.0))
    print()
    c3 = Check("fan-out: f(x) = x*x at x = 3")
    c3.row("uses of x", fan.uses, 2)
    c3.row("cotangent from use 1 (= b)", da, 3.0)
    c3.row("cotangent from use 2 (= a)", db, 3.0)
    c3.row("dL/dx = sum over uses", dx, 3.0 + 3.0)

    # 4. The MLP's residuals (float32, 4 B; every float leaf differentiated):
    #   x @ W0: keeps W0 (for ct_x) and x (for ct_W0)     64*32*4 + 8*64*4 = 8192 + 2048
    #   relu:   its jvp select(z > 0, t, zeros) keeps the mask and the zeros: 8*32*1 + 8*32*4
    #   h @ W1: keeps W1 and h = relu(z)                   32*10*4 + 8*32*4 = 1280 + 1024
    layers = 8192 + 2048 + 256 + 1024 + 1280 + 1024
    from_layers = sum(r.nbytes for r in mlp.residuals
                      if r.leaf or r.source.startswith("mlp.py"))
    # The loss keeps what it keeps of its own input whether or not the logits came from an MLP:
    # measured on the loss alone, as a function of the logits.
    loss_only = trace(lambda z: fg.softmax_cross_entropy(z, y), fg.mlp_apply(params, x))
    print()
    c4 = Check("residuals of the MLP, bytes")
    c4.row("saved by the layers (by hand)", from_layers, layers)
    c4.row("total = layers + loss alone", mlp.residual_bytes,
           layers + loss_only.residual_bytes)
    for other in (c3, c4):
        c.failed += other.failed
    c.done()


if __name__ == "__main__":
    main()
