"""The engine of `funcgrad.micro`: `Tensor`, its backward pass, and the operations it records
(the package's docstring describes the design).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import numpy as np

_GRAD_ENABLED = contextvars.ContextVar("funcgrad_micro_grad_enabled", default=True)

_FREED = (
    "backward: node {op!r} was already differentiated and its residuals (the values its "
    "backward rule needs) were freed. PyTorch raises too: a second backward through a graph "
    "needs retain_graph=True on the first, which keeps the residuals. micro does the same: "
    "call loss.backward(retain_graph=True) the first time (.grad then accumulates: zero it "
    "between calls for fresh gradients), or run the forward pass again for a new graph.")

_IN_PLACE = (
    "backward: a value of shape {shape} that node {op!r} saved for its backward rule was "
    "changed in place (version {now}, saved at version {then}), so the rule would give a wrong "
    "gradient. PyTorch raises the same (\"modified by an inplace operation\"). Fix: change it "
    "after backward(), or out of place (t = t + 1 rather than t.add_(1)).")


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Within this block operations record no graph (as ``torch.no_grad``): results have
    ``requires_grad=False``. Use it for parameter updates and evaluation."""
    token = _GRAD_ENABLED.set(False)
    try:
        yield
    finally:
        _GRAD_ENABLED.reset(token)


class Tensor:
    """A NumPy array (`data`, float64 unless `dtype` says) with its autodiff record:
    `parents`, `op` (the operation's name, "leaf" for inputs) and a backward rule; `grad`
    (None or an array of ``data``'s shape) accumulates over ``backward()`` calls; `name`
    labels it in `to_dot` and errors."""
    __array_priority__ = 100  # ndarray (op) Tensor defers to Tensor's reflected operators

    def __init__(self, data, requires_grad: bool = False, *, dtype=np.float64, name: str = ""):
        self.data: np.ndarray = np.asarray(data.data if isinstance(data, Tensor) else data,
                                           dtype=dtype)
        self.requires_grad = bool(requires_grad)
        self.grad: np.ndarray | None = None
        self.parents: tuple[Tensor, ...] = ()
        self.op = "leaf"
        self.name = name
        self._rule: Callable | None = None  # cotangent -> one cotangent per parent
        self._saved: tuple[tuple[Tensor, int], ...] = ()  # (tensor, version when saved)
        self._version = [0]  # one cell shared by views of the same array (reshape, detach)
        self._retain = False

    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    T = property(lambda self: self.transpose())
    is_leaf = property(lambda self: not self.parents)

    def __repr__(self) -> str:
        return f"Tensor({self.data!r}, requires_grad={self.requires_grad}, op={self.op!r})"

    item = lambda self: float(self.data)  # noqa: E731

    def retain_grad(self) -> Tensor:
        """Keeps ``.grad`` on this non-leaf (PyTorch's ``retain_grad``); returns self."""
        self._retain = True
        return self

    def zero_grad(self) -> None:
        """Forgets the accumulated ``.grad`` (sets it to None, as PyTorch does by default)."""
        self.grad = None

    def detach(self) -> Tensor:
        """A new leaf sharing this tensor's array, with no graph and ``requires_grad=False``."""
        out = Tensor(self.data, dtype=self.data.dtype, name=self.name)
        out._version = self._version  # the same array: an in-place change shows in both
        return out

    def add_(self, other, alpha: float = 1.0) -> Tensor:
        """In place ``data += alpha * other``; bumps the version that `backward` checks.
        Raises RuntimeError outside `no_grad` on a tensor that requires grad (as PyTorch)."""
        if self.requires_grad and _GRAD_ENABLED.get():
            raise RuntimeError(
                f"add_: {self.name or 'this tensor'} requires grad, and an in-place change is "
                "not recorded in the graph. Update parameters inside `with micro.no_grad():` "
                "(w.add_(-lr * w.grad)), or write w = w + x to record the addition.")
        self.data += alpha * (other.data if isinstance(other, Tensor) else np.asarray(other))
        self._version[0] += 1
        return self

    def backward(self, gradient=None, *, retain_graph: bool = False) -> None:
        """Adds d(self)/d(leaf) to ``leaf.grad`` for each leaf that requires grad.

        `gradient` is the cotangent (an array of ``self.shape``; 1.0 for a scalar if omitted).
        Without `retain_graph` each node's rule and residuals are dropped after use (PyTorch's
        default). Raises ValueError for a missing or misshapen cotangent, RuntimeError if
        there is no graph, a node was freed or a residual was changed in place (`add_`)."""
        if not self.requires_grad:
            raise RuntimeError("backward: this tensor does not require grad, so there is no "
                               "graph: create leaves with requires_grad=True, outside no_grad.")
        if gradient is None:
            if self.data.size != 1:
                raise ValueError(
                    f"backward: the output has shape {self.shape}, not a scalar, so it needs a "
                    "cotangent of that shape (the vector of the vector-Jacobian product): "
                    "t.backward(np.ones(t.shape)), or differentiate t.sum() or t.mean().")
            gradient = np.ones_like(self.data)
        gradient = np.asarray(gradient.data if isinstance(gradient, Tensor) else gradient,
                              dtype=self.data.dtype)
        if gradient.shape != self.shape:
            raise ValueError(f"backward: the cotangent has shape {gradient.shape}, the output "
                             f"{self.shape}; they must be equal.")
        order = _topological_order(self)
        cotangents = {id(self): gradient}
        for node in reversed(order):
            g = cotangents.pop(id(node), None)
            if g is None:
                continue
            if not node.parents or node._retain:  # a leaf, or a non-leaf that asked
                node.grad = g.copy() if node.grad is None else node.grad + g
            if not node.parents:
                continue
            if node._rule is None:
                raise RuntimeError(_FREED.format(op=node.op))
            for t, version in node._saved:
                if t._version[0] != version:
                    raise RuntimeError(_IN_PLACE.format(op=node.op, shape=t.shape,
                                                        now=t._version[0], then=version))
            for parent, pg in zip(node.parents, node._rule(g)):
                if parent.requires_grad and pg is not None:
                    total = cotangents.get(id(parent))  # fan-out: cotangents of uses sum
                    cotangents[id(parent)] = pg if total is None else total + pg
            if not retain_graph:
                node._rule, node._saved = None, ()

    # Operators: Python's syntax maps onto the functions below.
    __add__ = __radd__ = lambda a, b: add(a, b)
    __sub__ = lambda a, b: sub(a, b)
    __rsub__ = lambda a, b: sub(b, a)
    __mul__ = __rmul__ = lambda a, b: mul(a, b)
    __truediv__ = lambda a, b: div(a, b)
    __rtruediv__ = lambda a, b: div(b, a)
    __pow__ = lambda a, b: pow(a, b)
    __rpow__ = lambda a, b: pow(b, a)
    __matmul__ = lambda a, b: matmul(a, b)
    __rmatmul__ = lambda a, b: matmul(b, a)
    __neg__ = lambda a: neg(a)
    __getitem__ = lambda a, index: getitem(a, index)
    sum = lambda self, axis=None, keepdims=False: sum(self, axis, keepdims)
    mean = lambda self, axis=None, keepdims=False: mean(self, axis, keepdims)
    max = lambda self, axis=None, keepdims=False: max(self, axis, keepdims)
    reshape = lambda self, *shape: reshape(self, shape[0] if len(shape) == 1 else shape)
    transpose = lambda self, *axes: transpose(self, axes or None)
    exp = lambda self: exp(self)
    log = lambda self: log(self)
    tanh = lambda self: tanh(self)
    relu = lambda self: relu(self)
    sigmoid = lambda self: sigmoid(self)


def _topological_order(root: Tensor) -> list[Tensor]:
    """Nodes reachable from `root` with every node after its parents; iterative depth-first
    search (micrograd's recursive one hits Python's recursion limit near 1,000 nodes)."""
    order, visited, stack = [], set(), [(root, False)]
    while stack:
        node, parents_done = stack.pop()
        if parents_done:
            order.append(node)
        elif id(node) not in visited:  # marked when expanded, so a node comes after all
            visited.add(id(node))      # its parents even if it was pushed before one of them
            stack.append((node, True))
            stack += [(p, False) for p in node.parents
                      if p.requires_grad and id(p) not in visited]
    return order


def tensor(x) -> Tensor:
    """`x` as a Tensor (constants become leaves with ``requires_grad=False``)."""
    return x if isinstance(x, Tensor) else Tensor(x)


def _node(data, parents: tuple, op: str, rule: Callable, saved: tuple = (),
          saves_out: bool = False) -> Tensor:
    """The result of an operation: recorded in the graph when a parent requires grad."""
    data = np.asarray(data)
    out = Tensor(data, dtype=data.dtype if data.dtype.kind == "f" else np.float64)
    for p in parents:  # a view (reshape, transpose, a slice) shares its base's version
        if np.may_share_memory(out.data, p.data):
            out._version = p._version
    if _GRAD_ENABLED.get() and any(p.requires_grad for p in parents):
        out.requires_grad, out.parents, out.op, out._rule = True, parents, op, rule
        out._saved = tuple((t, t._version[0]) for t in saved + ((out,) if saves_out else ()))
    return out


def _unbroadcast(g: np.ndarray, shape: tuple) -> np.ndarray:
    """The reduce-back rule: a broadcast operand's cotangent is summed over the axes it was
    broadcast along (added leading axes, and axes of size 1), so it gets its own shape."""
    if g.shape == shape:
        return g
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    return g.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


def _binary(a, b, op: str, fn: Callable, rule: Callable, saves: bool = True) -> Tensor:
    a, b = tensor(a), tensor(b)
    try:
        np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(
            f"{op}: shapes {a.shape} and {b.shape} do not broadcast. NumPy broadcasting aligns "
            "shapes from the right; each pair of sizes must be equal or one of them 1 (e.g. "
            "(3, 4) with (4,) or (3, 1)). Reshape one operand, e.g. b.reshape(-1, 1).") from None
    return _node(fn(a.data, b.data), (a, b), op,
                 lambda g: [None if d is None else _unbroadcast(d, t.shape)
                            for d, t in zip(rule(g, a, b), (a, b))], saved=(a, b)[:2 * saves])


def _unary(a, op: str, fn: Callable, derivative: Callable, uses: str) -> Tensor:
    """An elementwise op: cotangent g * derivative(x, out); `uses` names its residual."""
    a = tensor(a)
    out = fn(a.data)
    return _node(out, (a,), op, lambda g: (g * derivative(a.data, out),),
                 saved=(a,) if uses == "x" else (), saves_out=uses == "out")


def add(a, b) -> Tensor:
    return _binary(a, b, "add", np.add, lambda g, a, b: (g, g), saves=False)


def sub(a, b) -> Tensor:
    return _binary(a, b, "sub", np.subtract, lambda g, a, b: (g, -g), saves=False)


def mul(a, b) -> Tensor:
    return _binary(a, b, "mul", np.multiply, lambda g, a, b: (g * b.data, g * a.data))


def div(a, b) -> Tensor:
    return _binary(a, b, "div", np.true_divide,
                   lambda g, a, b: (g / b.data, -g * a.data / b.data ** 2))


def pow(a, b) -> Tensor:
    """``a ** b``; d/da = b a^(b-1); d/db = a^b log(a), computed only when b requires grad
    (defined for a > 0, NaN elsewhere as in PyTorch and JAX)."""
    def rule(g, a, b):
        db = g * a.data ** b.data * np.log(a.data) if b.requires_grad else None
        return g * b.data * a.data ** (b.data - 1), db
    return _binary(a, b, "pow", np.power, rule)


def neg(a) -> Tensor:
    return _unary(a, "neg", np.negative, lambda x, out: -1.0, "none")


def matmul(a, b) -> Tensor:
    """``a @ b`` with NumPy's rules: 1-D operands get a size-1 axis for the product, batch
    axes broadcast. d/da = g b^T, d/db = a^T g (then reduced back and reshaped)."""
    a, b = tensor(a), tensor(b)
    if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not multiply: a's last "
                         "axis must equal b's second-to-last (or only) axis, and neither may "
                         "be a scalar (use * for that).")
    a2 = a.data[None] if a.ndim == 1 else a.data
    b2 = b.data[:, None] if b.ndim == 1 else b.data
    out2 = a2 @ b2

    def rule(g):
        g2 = g.reshape(out2.shape)
        da = _unbroadcast(g2 @ np.swapaxes(b2, -1, -2), a2.shape).reshape(a.shape)
        db = _unbroadcast(np.swapaxes(a2, -1, -2) @ g2, b2.shape).reshape(b.shape)
        return da, db
    return _node(a.data @ b.data, (a, b), "matmul", rule, saved=(a, b))


def _expand(g, axis, keepdims: bool, shape: tuple) -> np.ndarray:
    """A reduction's cotangent broadcast back to the input's shape."""
    if axis is not None and not keepdims:
        g = np.expand_dims(g, axis)
    return np.broadcast_to(g, shape)


def sum(a, axis=None, keepdims: bool = False) -> Tensor:
    a = tensor(a)
    return _node(a.data.sum(axis=axis, keepdims=keepdims), (a,), "sum",
                 lambda g: (_expand(g, axis, keepdims, a.shape),))


def mean(a, axis=None, keepdims: bool = False) -> Tensor:
    a = tensor(a)
    out = a.data.mean(axis=axis, keepdims=keepdims)
    return _node(out, (a,), "mean", lambda g: (_expand(g * out.size / a.data.size, axis,
                                                       keepdims, a.shape),))


def max(a, axis=None, keepdims: bool = False) -> Tensor:
    """The maximum; its cotangent is shared equally among tied maxima (as ``jax.grad``)."""
    a = tensor(a)
    out = a.data.max(axis=axis, keepdims=keepdims)

    def rule(g):
        mask = a.data == _expand(out, axis, keepdims, a.shape)
        return (mask * _expand(g, axis, keepdims, a.shape)
                / mask.sum(axis=axis, keepdims=True),)
    return _node(out, (a,), "max", rule, saved=(a,))


def reshape(a, shape) -> Tensor:
    a = tensor(a)
    return _node(a.data.reshape(shape), (a,), "reshape", lambda g: (g.reshape(a.shape),))


def transpose(a, axes=None) -> Tensor:
    a = tensor(a)
    axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(axes)
    return _node(a.data.transpose(axes), (a,), "transpose",
                 lambda g: (g.transpose(np.argsort(axes)),))


def getitem(a, index) -> Tensor:
    """``a[index]`` for ints, slices and integer arrays; the backward pass scatter-adds
    (``np.add.at``), so an element picked twice gets both cotangents."""
    a = tensor(a)
    index = index.data.astype(int) if isinstance(index, Tensor) else index

    def rule(g):
        da = np.zeros_like(a.data)
        np.add.at(da, index, g)
        return (da,)
    return _node(a.data[index], (a,), "getitem", rule)


def exp(a) -> Tensor:
    return _unary(a, "exp", np.exp, lambda x, out: out, "out")


def log(a) -> Tensor:
    return _unary(a, "log", np.log, lambda x, out: 1 / x, "x")


def tanh(a) -> Tensor:
    return _unary(a, "tanh", np.tanh, lambda x, out: 1 - out ** 2, "out")


def relu(a) -> Tensor:
    """max(a, 0); its derivative at 0 is taken as 0 (as ``jax.nn.relu`` and PyTorch)."""
    return _unary(a, "relu", lambda x: np.maximum(x, 0), lambda x, out: x > 0, "x")


def sigmoid(a) -> Tensor:
    """1 / (1 + exp(-a)), computed as exp(-log(1 + exp(-a))) to stay finite for any a."""
    return _unary(a, "sigmoid", lambda x: np.exp(-np.logaddexp(0.0, -x)),
                  lambda x, out: out * (1 - out), "out")


def log_softmax(a, axis: int = -1) -> Tensor:
    """a - logsumexp(a) along `axis`; cotangent g - softmax * sum(g) (article B §2.2)."""
    a = tensor(a)
    shifted = a.data - a.data.max(axis=axis, keepdims=True)
    out = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
    return _node(out, (a,), "log_softmax",
                 lambda g: (g - np.exp(out) * g.sum(axis=axis, keepdims=True),), saves_out=True)


def softmax_cross_entropy(logits, labels) -> Tensor:
    """Mean over the batch of -log softmax(logits)[label]; logits (batch, classes), labels
    ints (batch,). d/dlogits = (softmax - one_hot(labels)) / batch (article B §2.2)."""
    logits = tensor(logits)
    labels = np.asarray(labels.data if isinstance(labels, Tensor) else labels)
    if logits.ndim != 2 or labels.shape != logits.shape[:1] or labels.dtype.kind not in "iu":
        raise ValueError(f"softmax_cross_entropy: expected logits (batch, classes) and integer "
                         f"labels (batch,), got {logits.shape} and {labels.shape} "
                         f"{labels.dtype}.")
    logp = log_softmax(logits.detach()).data
    rows = np.arange(labels.shape[0])

    def rule(g):
        d = np.exp(logp)
        d[rows, labels] -= 1.0
        return (g * d / labels.shape[0],)
    return _node(-logp[rows, labels].mean(), (logits,), "softmax_cross_entropy", rule)

