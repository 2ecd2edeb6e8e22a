"""funcgrad.micro's tools: a finite-difference check of its gradients, and its graph as DOT.

Kept apart so the engine (`funcgrad/micro/_engine.py`) stays readable in one sitting; both are
re-exported by the package (``micro.check_grad``, ``micro.to_dot``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np

from funcgrad.micro._engine import Tensor, _topological_order, no_grad


def check_grad(fn: Callable[..., Tensor], *tensors: Tensor, eps: float = 1e-6,
               rtol: float = 1e-6, atol: float = 1e-8) -> float:
    """Compares `backward`'s gradients of the scalar ``fn(*tensors)`` with central differences.

    (f(x + eps e_i) - f(x - eps e_i)) / (2 eps) has error O(eps^2) from truncation and
    O(1e-16 |f| / eps) from rounding in float64; eps = 1e-6 balances them near 1e-10 |f|.

    Args:
      fn: maps the tensors to a scalar Tensor.
      tensors: float64 leaves with ``requires_grad=True``; their ``.grad`` is reset.
    Returns:
      the largest |analytic - numeric| / (atol + rtol |numeric|) over all elements (<= 1).
    Raises:
      ValueError: on the first element beyond tolerance, naming input, index and both values.
    """
    for t in tensors:
        t.zero_grad()
    fn(*tensors).backward()
    worst = 0.0
    for k, t in enumerate(tensors):
        analytic = np.zeros_like(t.data) if t.grad is None else t.grad
        for i in np.ndindex(t.shape):
            keep = t.data[i]
            t.data[i] = keep + eps
            with no_grad():
                up = fn(*tensors).item()
            t.data[i] = keep - eps
            with no_grad():
                down = fn(*tensors).item()
            t.data[i] = keep
            numeric = (up - down) / (2 * eps)
            # analytic[i] is a NumPy float64 scalar, a float (NumPy's stubs type it an array).
            ratio = cast(float, abs(analytic[i] - numeric) / (atol + rtol * abs(numeric)))
            if ratio > 1:
                raise ValueError(f"check_grad: input {k} ({t.name or 'unnamed'}) at index {i}: "
                                 f"backward gives {analytic[i]!r}, central differences "
                                 f"{numeric!r} (atol={atol}, rtol={rtol}).")
            worst = max(worst, ratio)
    return worst


def to_dot(root: Tensor, *, rankdir: str = "BT") -> str:
    """The graph behind `root` as Graphviz DOT text, drawn as `funcgrad.trace` draws JAX's:
    leaves blue, operations ellipses, the output green, fan-out values and edges orange.

    Returns:
      the DOT source (a str starting with ``digraph``); needs the `graphviz` Python package.
    """
    import graphviz

    from funcgrad._drawing import BLUE as _BLUE
    from funcgrad._drawing import GREEN as _GREEN
    from funcgrad._drawing import ORANGE as _ORANGE
    from funcgrad._drawing import type_text as _type
    order = _topological_order(root) if root.requires_grad else [root]
    ids = {id(node): f"n{i}" for i, node in enumerate(order)}  # stable names, inputs first
    uses: dict[int, int] = {}
    for node in order:
        for p in node.parents:
            uses[id(p)] = uses.get(id(p), 0) + 1
    dot = graphviz.Digraph(name="micro")
    dot.attr(rankdir=rankdir, fontname="Helvetica", fontsize="11", labelloc="t",
             label=f"micro graph: {len(order)} tensors; blue: leaves, green: output, "
                   "orange: fan-out (cotangents summed)")
    dot.attr("node", fontname="Helvetica", fontsize="10")
    for node in order:
        label = f"{node.name or node.op}\n{_type(node.shape, str(node.data.dtype))}"
        fan = uses.get(id(node), 0) > 1
        attrs = dict(color=_ORANGE if fan else "black")
        if node is root:
            attrs.update(shape="box", style="filled,bold", fillcolor=_GREEN)
        elif node.is_leaf:
            attrs.update(shape="box", style="filled,rounded", fillcolor=_BLUE)
        else:
            attrs.update(shape="ellipse")
        if node.grad is not None:
            label += "\n.grad kept"
        dot.node(ids[id(node)], label + (f"\nfan-out ×{uses[id(node)]}" if fan else ""),
                 **attrs)
        for p in node.parents:
            if p.requires_grad:
                dot.edge(ids[id(p)], ids[id(node)],
                         color=_ORANGE if uses.get(id(p), 0) > 1 else "black")
    return dot.source
