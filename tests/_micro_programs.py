"""Random programs over every `funcgrad.micro` operation, run by micro and by jax.grad.

Shared by tests/test_micro.py (a few hundred programs per run) and benchmarks/micro.py (1,000).
A program is a list of steps ``(op, i, j, k)``: `i` and `j` pick earlier values (inputs or
results, modulo their count), `k` is the op's integer parameter (axis, keepdims, exponent,
index, labels). The same interpreter runs on micro Tensors and on jax arrays, so the two
differ only in the engine. Ops with a restricted domain get inputs mapped into it the same way
in both (log(a*a + 0.5), a / (b*b + 0.5), ...). The loss sums the last value and the means of
all the others, so every intermediate is used at least twice (fan-out everywhere).
"""
import numpy as np
from hypothesis import strategies as st

# Every pair broadcasts (to (2, 3, 4)); reductions, reshapes and indexing make other shapes,
# and a pair that does not broadcast is reconciled by summing the second operand to a scalar.
SHAPES = [(), (4,), (1, 4), (3, 1), (3, 4), (2, 3, 4), (2, 1, 4), (1, 3, 1)]
BINARY = ["add", "sub", "mul", "div", "pow_tensor", "matmul"]
UNARY = ["pow_scalar", "rpow", "neg", "sum", "mean", "max", "reshape", "transpose", "getitem",
         "exp", "log", "tanh", "relu", "sigmoid", "log_softmax", "xent"]
OPS = BINARY + UNARY
EXPONENTS = [2.0, 3.0, 0.5, -1.5, 2.5]
MATRIX_SHAPE = (24, 3)  # a's last axis (at most 24, a flattened (2, 3, 4)) picks M[:n]


@st.composite
def programs(draw, max_steps: int = 6):
    """(input shapes, steps, seed) with 1-3 inputs besides the matrix M."""
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=3))
    steps = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 50),
                                    st.integers(0, 50), st.integers(0, 50)),
                          min_size=1, max_size=max_steps))
    return shapes, steps, draw(st.integers(0, 2**31 - 1))


def inputs(shapes, seed: int) -> list[np.ndarray]:
    """float64 primals in [-1.5, 1.5] for the inputs, then M."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1.5, 1.5, s) for s in list(shapes) + [MATRIX_SHAPE]]


def _broadcasts(a, b) -> bool:
    try:
        np.broadcast_shapes(a.shape, b.shape)
        return True
    except ValueError:
        return False


def run(steps, xs, lib):
    """The program's scalar loss; `lib` gives exp, log, tanh, relu, sigmoid, log_softmax and
    xent(logits, labels) for the engine; everything else is operators and methods."""
    *values, m = xs
    for op, i, j, k in steps:
        a, b = values[i % len(values)], values[j % len(values)]
        if op in ("add", "sub", "mul", "div", "pow_tensor") and not _broadcasts(a, b):
            b = b.sum()
        if op == "add":
            out = a + b
        elif op == "sub":
            out = a - b
        elif op == "mul":
            out = a * b
        elif op == "div":
            out = a / (b * b + 0.5)
        elif op == "pow_tensor":
            out = (a * a + 0.5) ** lib.tanh(b)
        elif op == "matmul":
            v = a if a.ndim else a.reshape((1,))
            out = v @ m[:v.shape[-1]]  # (..., n) @ (n, 3); n <= 24 for these shapes
        elif op == "pow_scalar":
            p = EXPONENTS[k % len(EXPONENTS)]
            out = a ** p if float(p).is_integer() else (a * a + 0.5) ** p
        elif op == "rpow":
            out = 1.5 ** a
        elif op == "neg":
            out = -a
        elif op in ("sum", "mean", "max"):
            axis = None if a.ndim == 0 or k % 3 == 0 else k % a.ndim
            out = getattr(a, op)(axis=axis, keepdims=bool(k & 4))
        elif op == "reshape":
            out = a.reshape((-1,)) if a.ndim >= 3 else a.reshape((1,) + a.shape)
        elif op == "transpose":
            out = a.transpose()
        elif op == "getitem":
            if a.ndim == 0:
                out = a
            else:
                n = a.shape[0]
                out = [a[k % n], a[k % n:], a[np.array([0, k % n, 0])]][k % 3]
        elif op in ("exp", "tanh", "relu", "sigmoid", "log_softmax"):
            out = getattr(lib, op)(a) if op != "log_softmax" or a.ndim else lib.tanh(a)
        elif op == "log":
            out = lib.log(a * a + 0.5)
        else:  # xent
            logits = a.reshape((-1, a.shape[-1])) if a.ndim else a.reshape((1, 1))
            labels = (np.arange(logits.shape[0]) * 7 + k) % logits.shape[1]
            out = lib.xent(logits, labels)
        values.append(out)
    loss = values[-1].sum()
    for v in values[:-1]:
        loss = loss + 0.5 * v.mean()
    return loss


class MicroLib:
    """micro's functions under the names `run` uses."""

    def __init__(self):
        from funcgrad import micro
        self.exp, self.log, self.tanh = micro.exp, micro.log, micro.tanh
        self.relu, self.sigmoid, self.log_softmax = micro.relu, micro.sigmoid, micro.log_softmax
        self.xent = micro.softmax_cross_entropy


class JaxLib:
    """jax.numpy / jax.nn under the names `run` uses."""

    def __init__(self):
        import jax
        import jax.numpy as jnp
        self.exp, self.log, self.tanh = jnp.exp, jnp.log, jnp.tanh
        self.relu, self.sigmoid = jax.nn.relu, jax.nn.sigmoid
        self.log_softmax = jax.nn.log_softmax
        self.xent = lambda logits, labels: -jnp.mean(jnp.take_along_axis(
            jax.nn.log_softmax(logits), jnp.asarray(labels)[:, None], axis=1))


def micro_grads(steps, xs):
    """(loss, grads of every input including M) by micro; None for an unused input -> 0."""
    from funcgrad import micro
    ts = [micro.Tensor(x, requires_grad=True) for x in xs]
    loss = run(steps, ts, MicroLib())
    loss.backward()
    return loss.item(), [np.zeros_like(t.data) if t.grad is None else t.grad for t in ts]


def jax_grads(steps, xs):
    """(loss, grads) by jax.value_and_grad in float64 (x64 scoped here), eagerly."""
    import jax
    import jax.numpy as jnp
    lib = JaxLib()
    with jax.enable_x64(True), jax.numpy_rank_promotion("allow"):
        args = [jnp.asarray(x, jnp.float64) for x in xs]
        loss, grads = jax.value_and_grad(lambda *a: run(steps, list(a), lib),
                                         argnums=tuple(range(len(xs))))(*args)
        return float(loss), [np.asarray(g) for g in grads]


def relative_errors(grads, references) -> list[float]:
    """max |ours - reference| of each input's gradient, divided by the larger of: the
    reference's own max |.|, 1% of the largest |gradient| over all inputs, and 1e-3.

    The floors are there because a gradient that cancels to zero (x - x, a sum of softmax
    cotangents) has no relative accuracy: JAX returns 2e-16 where micro returns 0 or the
    reverse. With inputs of order 1, the 1e-3 floor still demands 1e-15 absolute there.
    """
    top = max((np.max(np.abs(r), initial=0.0) for r in references), default=0.0)
    floor = max(0.01 * top, 1e-3)
    return [float(np.max(np.abs(g - r), initial=0.0) / max(np.max(np.abs(r), initial=0.0), floor))
            for g, r in zip(grads, references)]
