"""Where the memory of a training step goes, and what keeps memory alive in JAX (concept 17,
issue 14 points 1 and 5).

1. The digits MLP's train step (`fg.make_train_step`): XLA's compiled bytes.
2. Its loss gradient: the residuals the backward pass keeps, counted by hand from the shapes.
3. Inference keeps no residuals: the forward pass alone against a vjp that keeps them (JAX's
   answer to PyTorch's ``torch.no_grad()`` / ``inference_mode()``: there is no graph to turn
   off; a forward pass that is not differentiated never saves anything).
4. PyTorch's worry "a logged loss tensor keeps the graph alive" does not apply: a JAX loss is
   a plain array of 4 bytes. What keeps memory alive is a stored vjp closure (its leaves are the
   residuals) or jitted outputs you hold on to (a list of every step's gradients).

    $ python examples/21_memory_report.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _check import Check

import funcgrad as fg

B, HIDDEN = 128, 128  # batch and hidden width of the digits MLP 64 -> 128 -> 10 (ReLU)


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


def nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def main():
    data = fg.load_digits()
    params = fg.mlp_init(jax.random.key(0), (64, HIDDEN, 10))
    batch = {"x": jnp.asarray(data.x_train[:B]), "y": jnp.asarray(data.y_train[:B])}
    param_bytes = (64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10) * 4  # float32 weights and biases

    # 1. The train step, compiled as make_train_step jitted it.
    tx = optax.adam(1e-3)
    step = fg.make_train_step(loss, tx)
    state = step.init(params)
    report = fg.memory_report(step, state, batch)
    print(report, "\n")
    c = Check("1. the train step (bytes)", "memory_report", "by hand")
    c.row("params", nbytes(params), param_bytes)
    # The step's arguments: the state (params, Adam's two moments, counters) and the batch,
    # counted from the arrays themselves.
    c.row("arguments = state + batch", report.argument_bytes, nbytes((state, batch)))
    c.row("estimated peak = arg+out+temp-alias", report.peak_bytes,
          report.argument_bytes + report.output_bytes + report.temp_bytes
          - report.alias_bytes)

    # 2. What the gradient keeps. jax.vjp of the loss w.r.t. the params saves (float32 4 B,
    # bool 1 B), from the shapes:
    #   x @ W0:  x, the batch (not differentiated: an input held anyway)   B*64*4
    #   relu:    its jvp select(z > 0, t, zeros) keeps the mask and zeros  B*H*1 + B*H*4
    #            and its output h = relu(z) for h @ W1's weight gradient   B*H*4
    #   h @ W1:  W1, for the cotangent of h (a parameter)                   H*10*4
    # and the loss keeps what it keeps of its own input, measured on the loss alone as a
    # function of the logits (a second method: fg.trace of a different function).
    grad_report = fg.memory_report(loss, params, batch, grad=True)
    print(grad_report, "\n")
    layers_saved = B * HIDDEN * 1 + B * HIDDEN * 4 + B * HIDDEN * 4
    layers_inputs = B * 64 * 4 + HIDDEN * 10 * 4
    logits = fg.mlp_apply(params, batch["x"])
    loss_alone = fg.trace(lambda z: fg.softmax_cross_entropy(z, batch["y"]), logits)
    from_layers = sum(r.nbytes for r in grad_report.residuals
                      if r.origin == "argument" or r.source.startswith("mlp.py"))
    c2 = Check("2. residuals of the loss gradient (bytes)", "memory_report", "by hand")
    c2.row("kept by the layers", from_layers, layers_saved + layers_inputs)
    c2.row("residual total = layers + loss", grad_report.residual_bytes,
           layers_saved + layers_inputs + loss_alone.residual_bytes)
    c2.row("residual total = sum of the rows", grad_report.residual_bytes,
           sum(r.nbytes for r in grad_report.residuals))
    # The gradient has the params' shapes (4 leaves; at most 8 B more each for XLA:CPU's
    # output tuple table, as in 3.).
    c2.below("grad outputs - the params' bytes", grad_report.output_bytes - param_bytes, 8 * 4)
    c2.row("grad outputs >= the params' bytes", grad_report.output_bytes >= param_bytes, True)

    # 3. Inference vs training. The forward pass alone returns one float32 and keeps no
    # residuals; a function that returns the vjp closure (what a "retain the graph" would be)
    # must hand back every residual as an output.
    forward = fg.memory_report(loss, params, batch)

    def keep_vjp(params, batch):
        return jax.vjp(lambda p: loss(p, batch), params)

    kept = fg.memory_report(keep_vjp, params, batch)
    value, vjp_fn = keep_vjp(params, batch)
    n_out = len(jax.tree.leaves((value, vjp_fn)))
    print(forward, "\n")
    print(kept, "\n")
    c3 = Check("3. inference vs a vjp that keeps residuals (bytes)", "memory_report", "by hand")
    c3.row("forward alone: outputs (one f32)", forward.output_bytes, 4)
    c3.same("forward alone: residuals listed", forward.residuals, None)
    c3.row("vjp closure's leaves = residual total", nbytes(vjp_fn), grad_report.residual_bytes)
    # The outputs are the loss and the residuals; XLA:CPU adds a table of one 8-byte pointer
    # per output leaf for the output tuple, so allow at most 8 B per leaf beyond them.
    c3.below("vjp kept: outputs - (loss + residuals)",
             kept.output_bytes - 4 - grad_report.residual_bytes, 8 * n_out)
    c3.row("vjp kept: outputs >= loss + residuals",
           kept.output_bytes >= 4 + grad_report.residual_bytes, True)

    # 4. What keeps memory alive in JAX. The logged loss is a 0-d float32: 4 bytes, no graph.
    # A stored vjp closure holds all its residuals; a list of every step's gradients holds
    # one params-sized pytree per step (jitted outputs stay alive while referenced).
    grads_fn = jax.jit(jax.grad(loss))
    kept_grads = [grads_fn(params, batch) for _ in range(5)]
    c4 = Check("4. what a Python reference keeps alive (bytes)", "measured", "by hand")
    c4.row("a logged loss value", np.asarray(value).nbytes, 4)
    c4.row("a stored vjp closure", nbytes(vjp_fn), layers_saved + layers_inputs
           + loss_alone.residual_bytes)
    c4.row("5 steps' gradients kept in a list", nbytes(kept_grads), 5 * param_bytes)
    for other in (c2, c3, c4):
        c.failed += other.failed
    c.done()


if __name__ == "__main__":
    main()
