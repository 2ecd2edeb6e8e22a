"""The computation graph JAX records for a pure function, with its fan-out points and residuals.

Concept 1 (record, don't derive): ``jax.make_jaxpr`` records one equation per primitive; the
backward pass walks that record in reverse, summing one cotangent per use wherever a value fans
out, and reads the residuals the forward pass saved for it (``jax.vjp``). `trace` turns the
record into a `Graph` you can print (`Graph.to_text`), draw (`Graph.to_dot`, `Graph.render`) or
read in code (`Graph.to_dict`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from funcgrad import _jax_internals as ji
from funcgrad._jaxpr import arg_names, is_float, leaf_paths, source_line, sub_jaxprs
from funcgrad._library_objects import split_equinox_args
from funcgrad._traced import TracedValueError, traced_values
from funcgrad.debug import _graph_draw

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Value:
    """An edge of the graph: one array value, its producer and each of its uses."""
    id: str                     # unique in the whole graph: "v3", nested "n2/jaxpr/v0"
    name: str                   # leaf path, "out[0]", "v3", or a literal's value
    shape: tuple[int, ...]
    dtype: str                  # numpy name, e.g. "float32"
    kind: str                   # "leaf" | "intermediate" | "literal" | "constant"
    producer: str | None        # node id; None for leaves, literals and constants
    consumers: tuple[str, ...]  # one entry per use: a node id or an output name


@dataclasses.dataclass(frozen=True)
class Node:
    """One equation: a primitive, or a nested jaxpr (jit, scan, cond, ...) shown as one node."""
    id: str
    primitive: str
    label: str                  # primitive, with the function name for jit/custom_jvp: "jit(f)"
    source: str                 # "file.py:12:8 (f)", "" if unknown
    inputs: tuple[str, ...]     # value ids, in operand order
    outputs: tuple[str, ...]
    reaches_output: bool
    subgraphs: dict[str, Graph]  # nested jaxprs by parameter name ("jaxpr", "branches[0]")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An input array, named by its pytree path."""
    path: str
    value: str
    shape: tuple[int, ...]
    dtype: str
    reaches_output: bool


@dataclasses.dataclass(frozen=True)
class Output:
    """An output array, named ``out`` + its pytree path in the function's return value."""
    id: str
    name: str
    value: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class FanOut:
    """A floating value with more than one use; its cotangent is the sum of one per use."""
    value: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    uses: int
    consumers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Residual:
    """A value the forward pass saves for the backward pass (vjp)."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    origin: str           # "argument" | "output" | "literal" | "constant" | "named"
    primitive: str        # the primitive that made it ("" for arguments, literals, constants)
    source: str           # "file.py:12:8 (f)" of the equation that made it, "" if none
    leaf: str | None      # the leaf's path when origin == "argument"
    node: str | None      # the graph node that made it, when one matches
    description: str      # JAX's own words


@dataclasses.dataclass(frozen=True)
class Graph:
    """The recorded computation of ``fn(*args)``; built by `trace`.

    Attributes:
      name: the function's name.
      nodes: the equations in execution order.
      values: value id -> `Value` for this level (nested levels live in ``node.subgraphs``).
      leaves, outputs: the inputs by pytree path and the outputs (``out``, ``out[0]``, ...).
      fanouts: floating values used more than once at this level, most uses first.
      residuals: what ``jax.vjp`` saves, differentiating every floating leaf; None inside
        nested graphs or when ``trace(..., residuals=False)``. This is the jaxpr's view,
        before XLA compiles the program: the compiled memory can differ (under
        ``jax.checkpoint`` these bytes fall while compiled memory may not move);
        `funcgrad.memory_report` gives the compiled bytes and reconciles the two.
    """
    name: str
    nodes: tuple[Node, ...]
    values: dict[str, Value]
    leaves: tuple[Leaf, ...]
    outputs: tuple[Output, ...]
    fanouts: tuple[FanOut, ...]
    residuals: tuple[Residual, ...] | None = None

    @property
    def residual_bytes(self) -> int:
        """Total bytes of the residuals (0 when none were computed): the jaxpr's view, not
        the compiled program's memory (see `funcgrad.memory_report`)."""
        return sum(r.nbytes for r in self.residuals or ())

    def node(self, node_id: str) -> Node:
        """The node with id `node_id`, at any depth. Raises KeyError naming the valid ids."""
        for node in self.nodes:
            if node.id == node_id:
                return node
            for sub in node.subgraphs.values():
                if node_id.startswith(node.id + "/"):
                    try:
                        return sub.node(node_id)
                    except KeyError:
                        pass
        raise KeyError(f"no node {node_id!r}; top-level ids are {[n.id for n in self.nodes]}.")

    def expand(self, node: Node | str, part: str | None = None) -> Graph:
        """The graph nested in `node` (a jit, scan, cond, while, remat or custom_jvp/vjp node).

        Args:
          node: a `Node` of this graph or its id (e.g. ``"n2"``, or ``"n2/jaxpr/n0"``).
          part: which nested jaxpr, when the node has several: ``"branches[0]"`` (cond),
            ``"cond_jaxpr"`` / ``"body_jaxpr"`` (while).
        Returns:
          a `Graph` whose leaves are the nested function's inputs, named by its parameters
          where JAX recorded them (``x``, ``c``) else ``in[i]``, and outputs ``out[i]``.
        Raises:
          ValueError: if the node holds no nested jaxpr, or several and `part` is missing.
        """
        node = self.node(node) if isinstance(node, str) else node
        if not node.subgraphs:
            raise ValueError(f"expand: node {node.id} ({node.label}) is a primitive with no "
                             "nested jaxpr; nested nodes are jit, scan, cond, while, remat, "
                             "custom_jvp_call and custom_vjp_call.")
        if part is None and len(node.subgraphs) > 1:
            raise ValueError(f"expand: node {node.id} ({node.label}) holds several jaxprs; "
                             f"pass part= one of {list(node.subgraphs)}.")
        key = part if part is not None else next(iter(node.subgraphs))
        if key not in node.subgraphs:
            raise ValueError(f"expand: node {node.id} has no part {key!r}; "
                             f"expected one of {list(node.subgraphs)}.")
        return node.subgraphs[key]

    def to_dict(self) -> dict[str, Any]:
        """The graph as plain dicts, lists, strings and ints (JSON-serialisable)."""
        out = dataclasses.asdict(self)
        out["residual_bytes"] = self.residual_bytes
        return out

    def __str__(self) -> str:
        return self.to_text()

    def to_text(self, *, depth: int | None = 0) -> str:
        """A readable table: nodes (inputs -> outputs with shapes, source line), then leaves,
        outputs, fan-out points and residuals with their total bytes.

        Args:
          depth: how many levels of nested jaxprs to expand (None: all); 0 shows each nested
            jaxpr as one node marked ``+``.
        Returns:
          a str, one line per row; types are written as in jaxprs (``f32[8,64]``).
        """
        return _graph_draw.to_text(self, depth)

    def to_dot(self, *, depth: int | None = 0, rankdir: str = "TB") -> str:
        """The graph as Graphviz DOT text (needs the `graphviz` Python package, not `dot`).

        Leaves are blue boxes (grey and dashed, labelled "unused", when they reach no
        output), equations are ellipses, nested jaxprs are 3-D boxes (clusters when expanded),
        outputs are green boxes; fan-out values and their edges are orange; nodes whose output
        the backward pass keeps say how many bytes it saves.

        Args:
          depth: levels of nested jaxprs drawn as expanded clusters (None: all).
          rankdir: "TB" (top to bottom) or "LR" (left to right).
        Returns:
          the DOT source, a str starting with ``digraph``.
        Raises:
          ImportError: if the `graphviz` Python package is not installed.
        """
        return _graph_draw.to_dot(self, depth, rankdir)

    def render(self, path: str | os.PathLike, *, format: str | None = None,
               depth: int | None = 0, rankdir: str = "TB") -> str:
        """Draws the graph to an image file with the Graphviz `dot` program.

        Args:
          path: the file to write, e.g. ``"graph.svg"``; parent folders are created.
          format: "svg", "png" or "pdf"; default: the path's suffix, else "svg".
          depth: as in `to_dot`.
          rankdir: as in `to_dot`.
        Returns:
          the path written, as a str.
        Raises:
          RuntimeError: if the `dot` program is not on PATH (the message says how to install it).
          ValueError: if the format is not one of the above.
        """
        return _graph_draw.render(self, path, format, depth, rankdir)


def trace(fn: Callable, *args: PyTree, residuals: bool = True) -> Graph:
    """Records ``fn(*args)`` with ``jax.make_jaxpr`` and returns its computation graph.

    Args:
      fn: a pure function of positional pytree arguments returning an array or a pytree of
        arrays. Settings that are not arrays belong in a closure (``functools.partial``).
      *args: the primal point: pytrees (dicts, lists, tuples, None, ...) whose leaves are
        arrays of any shape and dtype: ``jax.Array``, NumPy arrays, Python scalars (traced as
        weakly typed arrays) or ``jax.ShapeDtypeStruct`` (shapes only, nothing is computed).
        An equinox module's floating arrays are its leaves; its other leaves are closed over.
      residuals: also list what ``jax.vjp(fn, *args)`` saves for the backward pass, with every
        floating leaf differentiated (integer and boolean leaves have no cotangent).
    A jitted `fn` (``trace(jax.jit(f), ...)``, whose record is one ``jit`` equation) is traced
    through: the nodes and residuals are those of its body, at the user's source lines, as
    for ``trace(f, ...)``. A ``jit`` called inside `fn` stays one expandable node.

    Returns:
      a `Graph`: one `Node` per equation, nested jaxprs as single expandable nodes; leaves named
      by pytree path (``params[0]['w']``) with ``reaches_output``; outputs ``out``, ``out[0]``,
      ...; fan-out points; residuals with their bytes.
    Raises:
      TypeError: if `fn` is not callable, or a leaf of `args` is not an array (the message
        names the leaf's path and type).
      funcgrad.JaxInternalsError: if residuals are asked for and this JAX lacks
        ``jax._src.ad_checkpoint.saved_residuals``; pass ``residuals=False``.
      `funcgrad.TracedValueError` (a TypeError): Python control flow or conversion on a
        traced value (``if x > 0:``); the message names fn's line and the fix. Any other error
        `fn` raises while traced on abstract values propagates, with a note naming `trace`.
    Example:
      >>> g = trace(lambda x, w, b: x * w + b, 2.0, 3.0, 1.0)
      >>> [n.primitive for n in g.nodes], [leaf.path for leaf in g.leaves]
      (['mul', 'add'], ['x', 'w', 'b'])
    """
    if not callable(fn):
        raise TypeError(f"trace: fn must be a callable such as a loss function, got "
                        f"{type(fn).__name__} {fn!r}. Example: trace(loss_fn, params, batch).")
    fn, args = split_equinox_args(fn, args, "trace")  # an equinox model: its floating arrays
    names = arg_names(fn, len(args))
    paths = leaf_paths(args, names)
    for path, leaf in zip(paths, jax.tree.leaves(args)):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex,
                                 jax.ShapeDtypeStruct)):
            raise TypeError(
                f"trace: leaf {path} is a {type(leaf).__name__} ({leaf!r:.60}); expected an "
                "array (jax.Array, NumPy array, Python number or jax.ShapeDtypeStruct) or a "
                "pytree of them. Close over other settings: trace(functools.partial(fn, "
                "mode='x'), params).")
    try:
        floating = [i for i, a in enumerate(args) if residuals and any(
            is_float(x.dtype if hasattr(x, "dtype") else type(x))
            for x in jax.tree.leaves(a))]  # the residuals are those of their vjp
        with traced_values("trace", fn, args, names, floating):
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except TracedValueError:
        raise
    except Exception as e:
        e.add_note(f"funcgrad.debug.graph.trace: raised while tracing {_fn_name(fn)} with "
                   "jax.make_jaxpr on abstract values of the given shapes and dtypes.")
        raise
    out_paths = ["out" + jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    inner = _unwrap_jit(closed)
    graph = _build(inner[0] if inner else closed.jaxpr, paths, out_paths, _fn_name(fn), "")
    if not residuals:
        return graph
    return dataclasses.replace(graph, residuals=_residuals(fn, args, paths, graph, inner))


def _unwrap_jit(closed) -> tuple[Any, tuple] | None:
    """The body of a function that is one jitted call (``trace(jax.jit(f), ...)``), as
    ``(jaxpr, consts)``: a jaxpr whose only equation is a ``jit`` (pjit) taking its inputs in
    order and returning its outputs. None otherwise. Nested levels of such wrapping are all
    removed."""
    found: tuple[Any, tuple] | None = None
    jaxpr, consts = ji.closed_parts(closed)
    while (len(jaxpr.eqns) == 1 and not jaxpr.constvars
           and ji.kind(jaxpr.eqns[0]) == "jit"
           and list(jaxpr.eqns[0].invars) == list(jaxpr.invars)
           and list(jaxpr.eqns[0].outvars) == list(jaxpr.outvars)):
        found = ji.call_body(jaxpr.eqns[0])
        jaxpr, consts = found
    return found


# --- building ------------------------------------------------------------------------------

def _build(jaxpr, in_names: list[str], out_names: list[str], name: str, prefix: str) -> Graph:
    values: dict[str, dict] = {}
    ids: dict[Any, str] = {}   # jaxpr Var -> value id

    def new(var, label, kind, producer=None) -> str:
        vid = f"{prefix}v{len(values)}"
        values[vid] = dict(id=vid, name=label, shape=tuple(var.aval.shape),
                           dtype=str(var.aval.dtype), kind=kind, producer=producer, consumers=[])
        if kind != "literal":
            ids[var] = vid
        return vid

    def use(var, consumer) -> str:
        if ji.is_literal(var):
            vid = new(var, _literal(var), "literal")
        else:
            vid = ids[var]
        values[vid]["consumers"].append(consumer)
        return vid

    leaf_ids = [new(v, n, "leaf") for v, n in zip(jaxpr.invars, in_names)]
    for i, v in enumerate(jaxpr.constvars):
        new(v, f"const{i}", "constant")
    out_ids: dict[int, str] = {}  # an intermediate returned as output k is named out[k]
    for v, n in zip(jaxpr.outvars, out_names):
        if not ji.is_literal(v):
            out_ids.setdefault(id(v), n)
    live = _live_vars(jaxpr)
    nodes = []
    for k, eqn in enumerate(jaxpr.eqns):
        nid = f"{prefix}n{k}"
        inputs = tuple(use(v, nid) for v in eqn.invars)
        outputs = []
        for v in eqn.outvars:
            label = out_ids.get(id(v), f"v{len(values)}")
            outputs.append(new(v, label, "intermediate", nid))
        subgraphs = {}
        for part, sub, _ in sub_jaxprs(eqn):
            subgraphs[part] = _build(sub, _sub_arg_names(sub),
                                     [f"out[{i}]" for i in range(len(sub.outvars))],
                                     part, f"{nid}/{part}/")
        fname = ji.param(eqn, "name", None)
        if not isinstance(fname, str) and len(subgraphs) == 1:
            fname = _sub_fn_name(next(sub_jaxprs(eqn))[1])
        label = f"{ji.name(eqn)}({fname})" if fname else ji.name(eqn)
        nodes.append(Node(nid, ji.name(eqn), label, source_line(eqn), inputs,
                          tuple(outputs), any(v in live for v in eqn.outvars
                                              if not ji.is_dropvar(v)), subgraphs))
    graph_outputs = []
    for k, (v, n) in enumerate(zip(jaxpr.outvars, out_names)):
        vid = use(v, n)
        graph_outputs.append(Output(f"{prefix}o{k}", n, vid, values[vid]["shape"],
                                    values[vid]["dtype"]))
    vals = {k: Value(**{**d, "consumers": tuple(d["consumers"])}) for k, d in values.items()}
    leaves = tuple(Leaf(vals[i].name, i, vals[i].shape, vals[i].dtype, v in live)
                   for i, v in zip(leaf_ids, jaxpr.invars))
    fanouts = sorted((FanOut(v.id, v.name, v.shape, v.dtype, len(v.consumers), v.consumers)
                      for v in vals.values() if len(v.consumers) > 1
                      and v.kind in ("leaf", "intermediate") and is_float(v.dtype)),
                     key=lambda f: -f.uses)
    return Graph(name, tuple(nodes), vals, leaves, tuple(graph_outputs), tuple(fanouts))


def _sub_arg_names(jaxpr) -> list[str]:
    """The nested function's parameter names when JAX recorded them uniquely, else in[i]."""
    names = getattr(getattr(jaxpr, "debug_info", None), "arg_names", None)
    if (names and len(names) == len(jaxpr.invars) and all(names)
            and len(set(names)) == len(names)):
        return list(names)
    return [f"in[{i}]" for i in range(len(jaxpr.invars))]


def _sub_fn_name(jaxpr) -> str | None:
    """The nested function's name (relu, sin, ...) from JAX's debug info; None for lambdas."""
    src = getattr(getattr(jaxpr, "debug_info", None), "func_src_info", None) or ""
    name = src.split(" ")[0]
    return name if name and not name.startswith("<") else None


def _live_vars(jaxpr) -> set:
    """Vars an output depends on structurally: every output of an equation is taken to depend
    on every input, so nested jaxprs count conservatively and stop_gradient passes through."""
    live = {v for v in jaxpr.outvars if not ji.is_literal(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars if not ji.is_dropvar(v)):
            live.update(v for v in eqn.invars if not ji.is_literal(v))
    return live


# --- residuals -----------------------------------------------------------------------------

_OUTPUT = re.compile(r"^(output|named '[^']*')(?: of (?:jitted function '(?P<jit>[^']*)'|"
                     r"(?P<prim>\S+)))? from (?P<src>.*)$")  # a named value: no "of ..."
_ARG = re.compile(r"^from the argument \w+\[(?P<i>\d+)\]$")


def _residuals(fn, args, paths, graph, inner=None) -> tuple[Residual, ...]:
    """What ``jax.vjp`` saves. For a jitted `fn`, its body `inner` is evaluated instead (JAX's
    evaluator replays each equation under the user's source line), so the residuals are the
    body's values at the user's lines, not one output of the jitted call at funcgrad's."""
    saved_residuals = ji.saved_residuals
    leaves, treedef = jax.tree.flatten(args)
    floats = [i for i, x in enumerate(leaves) if is_float(str(_leaf_dtype(x)))]
    if not floats:
        return ()
    if inner is not None:
        body = ji.as_fun(*inner)
        fn = lambda *a: body(*jax.tree.leaves(a))  # noqa: E731 - the body, on the same args

    def on_leaves(*flat):  # every leaf an argument, as under jax.jit(jax.grad(fn))
        return fn(*jax.tree.unflatten(treedef, flat))

    def on_floats(*flat):  # the other leaves closed over: they take no cotangent
        full = [_concrete(x) for x in leaves]
        for i, x in zip(floats, flat):
            full[i] = x
        return fn(*jax.tree.unflatten(treedef, full))

    positions: Sequence[int]
    try:
        found, positions = saved_residuals(on_leaves, *leaves), range(len(leaves))
    except Exception:  # noqa: BLE001 - some JAX versions refuse vjp of non-float inputs
        found, positions = saved_residuals(on_floats, *[leaves[i] for i in floats]), floats
    return tuple(_residual(aval, text, [paths[i] for i in positions], graph)
                 for aval, text in found)


def _residual(aval, text: str, arg_paths: list[str], graph: Graph) -> Residual:
    shape, dtype = tuple(aval.shape), str(aval.dtype)
    try:
        nbytes = math.prod(shape) * np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys) have no NumPy itemsize
        nbytes = 0
    if m := _ARG.match(text):
        return Residual(shape, dtype, nbytes, "argument", "", "", arg_paths[int(m["i"])], None,
                        text)
    if m := _OUTPUT.match(text):
        prim = f"jit({m['jit']})" if m["jit"] is not None else m["prim"] or ""
        head, sep, rest = m["src"].partition(":")
        source = os.path.basename(head) + sep + rest
        origin = "output" if m[1] == "output" else "named"
        return Residual(shape, dtype, nbytes, origin, prim, source, None,
                        _maker(graph, prim, m["jit"], source), text)
    origin = "literal" if "literal" in text else "constant" if "constant" in text else "unknown"
    return Residual(shape, dtype, nbytes, origin, "", "", None, None, text)


def _maker(graph: Graph, prim: str, name: str | None, source: str) -> str | None:
    """The node that made a residual: same primitive (and jit name) and source line, at any
    depth; else the only top-level node at that source line (relu's mask: its jvp rule's)."""
    def walk(g):
        for n in g.nodes:
            yield n
            for sub in n.subgraphs.values():
                yield from walk(sub)

    same = [n for n in walk(graph) if n.source == source and (
        n.primitive == prim if name is None else n.label in (f"jit({name})", f"pjit({name})"))]
    at_line = [n for n in graph.nodes if n.source == source]
    pick = same if len(same) == 1 else at_line if len(at_line) == 1 else []
    return pick[0].id if pick else None


def _leaf_dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.result_type(type(x))


def _concrete(x):
    if isinstance(x, jax.ShapeDtypeStruct):  # a stand-in of the right shape; values unused
        return np.zeros(x.shape, x.dtype)
    return x


def _literal(var) -> str:
    val = np.asarray(var.val)
    return repr(val.item()) if val.ndim == 0 else f"literal{list(val.shape)}"


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__
