"""How a `funcgrad.debug.graph.Graph` is drawn: a text table, Graphviz DOT text, an image (private).

Used by `Graph.to_text`, `Graph.to_dot` and `Graph.render`, which document the output; this
module reads a graph's fields only, so it imports `funcgrad.debug.graph` for type checking alone.
"""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from funcgrad._drawing import BLUE as _BLUE
from funcgrad._drawing import GREEN as _GREEN
from funcgrad._drawing import GREY as _GREY
from funcgrad._drawing import ORANGE as _ORANGE
from funcgrad._drawing import byte_text as _bytes
from funcgrad._drawing import type_text as _type
from funcgrad._jaxpr import is_float

if TYPE_CHECKING:
    from funcgrad.debug.graph import Graph

_JAXPR_VIEW = (
    "(what jax.vjp saves before XLA compiles it: XLA fuses, reuses and re-schedules buffers, "
    "and under jax.checkpoint these bytes can fall while the compiled memory does not; "
    "fg.memory_report(fn, *args, grad=True) gives the bytes the machine pays)")

_NO_DOT = (
    "render: the Graphviz `dot` program is not on PATH, so the graph cannot be drawn as {fmt}. "
    "Install Graphviz itself (the `graphviz` Python package only writes DOT text): "
    "`apt install graphviz` (Debian/Ubuntu), `brew install graphviz` (macOS) or "
    "`conda install -c conda-forge graphviz`. Without it, graph.to_dot() still works: save its "
    "text as a .dot file and open it in any DOT viewer.")


def to_text(graph: Graph, depth: int | None) -> str:
    """`Graph.to_text`: the table, one line per row."""
    lines = [f"graph of {graph.name}: {_count(graph.nodes, 'node')}, "
             f"{_count(graph.leaves, 'leaf', 'leaves')}, {_count(graph.outputs, 'output')}"]
    if graph.nodes:
        lines.append("nodes (id, primitive, inputs -> outputs, source); + holds a nested jaxpr")
        lines += _node_rows(graph, depth, "  ")
    lines.append("leaves (pytree path, type)")
    for leaf in graph.leaves:
        note = "" if leaf.reaches_output else "   does NOT reach any output (unused)"
        lines.append(f"  {leaf.path:<24} {_type(leaf.shape, leaf.dtype)}{note}")
    if not graph.leaves:
        lines.append("  none")
    lines.append("outputs")
    for out in graph.outputs:
        made_by = graph.values[out.value].producer or graph.values[out.value].name
        lines.append(f"  {out.name:<24} {_type(out.shape, out.dtype):<14} from {made_by}")
    lines.append("fan-out points (the backward pass sums one cotangent per use)")
    lines += [f"  {f.name:<24} {_type(f.shape, f.dtype):<14} {f.uses} uses: "
              f"{', '.join(f.consumers)}" for f in graph.fanouts] or ["  none"]
    if graph.residuals is not None:
        lines.append(f"residuals saved for the backward pass (vjp), the jaxpr's view: "
                     f"{_count(graph.residuals, 'value')}, {graph.residual_bytes} bytes "
                     f"({_bytes(graph.residual_bytes)})")
        lines.append(f"  {_JAXPR_VIEW}")
        for r in graph.residuals:
            what = (f"argument {r.leaf}" if r.leaf else
                    f"{r.origin} of {r.primitive}" if r.primitive else r.origin)
            where = f"  {r.source}" if r.source else ""
            node = f"  [{r.node}]" if r.node else ""
            lines.append(f"  {_type(r.shape, r.dtype):<14} {r.nbytes:>9} B  "
                         f"{what}{where}{node}")
    return "\n".join(lines)


def to_dot(graph: Graph, depth: int | None, rankdir: str) -> str:
    """`Graph.to_dot`: the DOT source; raises ImportError without `graphviz`."""
    try:
        import graphviz
    except ImportError as e:
        raise ImportError("to_dot needs the `graphviz` Python package: "
                          "pip install 'graphviz>=0.20'. (Drawing images with render() "
                          "also needs the Graphviz `dot` program.)") from e
    dot = graphviz.Digraph(name=graph.name)
    saved_text = (f"; the jaxpr saves {_bytes(graph.residual_bytes)} of residuals "
                  "(compiled memory: fg.memory_report)" if graph.residuals is not None else "")
    dot.attr(rankdir=rankdir, fontname="Helvetica", fontsize="11", nodesep="0.25",
             ranksep="0.3", labelloc="t", label=(
                 f"{graph.name}: {_count(graph.nodes, 'equation')}{saved_text}\n"
                 "blue: leaves    ellipse: equation    3-D box: nested jaxpr    "
                 "green: outputs\norange: fan-out (one cotangent per use, summed)    "
                 "saves: the jaxpr's residual bytes    grey dashed: reaches no output"))
    dot.attr("node", fontname="Helvetica", fontsize="10", height="0.3", margin="0.06,0.03")
    dot.attr("edge", fontname="Helvetica", fontsize="8", arrowsize="0.6")
    saved: dict[str, int] = {}
    for r in graph.residuals or ():
        target = r.node or next((lf.value for lf in graph.leaves if lf.path == r.leaf), None)
        if target:
            saved[target] = saved.get(target, 0) + r.nbytes
    _draw(dot, graph, depth, saved)
    return dot.source


def render(graph: Graph, path: str | os.PathLike, format: str | None,
           depth: int | None, rankdir: str) -> str:
    """`Graph.render`: writes the image and returns its path."""
    suffix = os.path.splitext(os.fspath(path))[1].lstrip(".").lower()
    fmt = format or (suffix if suffix in ("svg", "png", "pdf") else "svg")
    if fmt not in ("svg", "png", "pdf"):
        raise ValueError(f"render: format must be 'svg', 'png' or 'pdf', got {fmt!r}.")
    if format is None and suffix and suffix != fmt:
        raise ValueError(f"render: cannot write a .{suffix} file; use a .svg, .png or .pdf "
                         f"path, or pass format= (the suffix {suffix!r} would not match the "
                         "content).")
    if shutil.which("dot") is None:
        raise RuntimeError(_NO_DOT.format(fmt=fmt))
    import graphviz
    image = graphviz.Source(graph.to_dot(depth=depth, rankdir=rankdir)).pipe(format=fmt)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(image)
    return os.fspath(path)


def _node_rows(graph: Graph, depth: int | None, indent: str) -> list[str]:
    def name_type(vid):
        v = graph.values[vid]
        return v.name if v.kind == "literal" else f"{v.name}:{_type(v.shape, v.dtype)}"

    rows = []
    width = max([len(n.id) for n in graph.nodes] + [4])
    for node in graph.nodes:
        mark = "+" if node.subgraphs else " "
        flow = (f"{', '.join(name_type(i) for i in node.inputs)} -> "
                f"{', '.join(name_type(o) for o in node.outputs)}")
        rows.append(f"{indent}{node.id:<{width}} {mark} {node.label:<22} {flow:<52} "
                    f"{node.source}".rstrip())
        if node.subgraphs and (depth is None or depth > 0):
            for part, sub in node.subgraphs.items():
                ins = ", ".join(f"{lf.path}:{_type(lf.shape, lf.dtype)}" for lf in sub.leaves)
                rows.append(f"{indent}    {part}: inputs {ins or 'none'}")
                rows += _node_rows(sub, None if depth is None else depth - 1, indent + "    ")
    return rows




def _draw(dot, graph: Graph, depth: int | None, saved: dict[str, int]) -> None:
    fan = {f.value: f.uses for f in graph.fanouts}

    def extra(vid_or_node, values):
        notes = [f"fan-out ×{fan[v]}" for v in values if v in fan]
        if vid_or_node in saved:
            notes.append(f"saves {_bytes(saved[vid_or_node])}")
        return "".join("\n" + n for n in notes)

    for leaf in graph.leaves:
        label = f"{leaf.path}\n{_type(leaf.shape, leaf.dtype)}{extra(leaf.value, [leaf.value])}"
        if leaf.reaches_output:  # a nested jaxpr's inputs are white: they are not leaves of fn
            dot.node(leaf.value, label, shape="box", style="filled,rounded",
                     fillcolor="white" if "/" in leaf.value else _BLUE,
                     color=_ORANGE if leaf.value in fan else "black")
        else:
            dot.node(leaf.value, "unused\n" + label, shape="box", style="dashed,rounded",
                     color=_GREY, fontcolor=_GREY)
    for v in graph.values.values():
        if v.kind == "constant":
            dot.node(v.id, f"{v.name}\n{_type(v.shape, v.dtype)}", shape="box", style="filled",
                     fillcolor="#f3f4f6", color=_GREY)
    for node in graph.nodes:
        consts = [graph.values[i].name for i in node.inputs if graph.values[i].kind == "literal"]
        label = node.label
        if consts:
            label += "(" + ", ".join(graph.values[i].name if graph.values[i].kind == "literal"
                                     else "·" for i in node.inputs) + ")"
        where = node.source.split(" ")[0].rsplit(":", 1)[0] if node.source else ""
        label += (f"\n{where}" if where else "") + extra(node.id, node.outputs)
        style = dict(tooltip=node.source or node.label)
        if not node.reaches_output:
            style.update(style="dashed", color=_GREY, fontcolor=_GREY)
        elif any(o in fan for o in node.outputs):
            style.update(color=_ORANGE, penwidth="2")
        if node.subgraphs and (depth is None or depth > 0):
            with dot.subgraph(name=f"cluster_{node.id}") as c:
                c.attr(label=f"{node.label}  {node.source}", style="rounded,dashed",
                       color=_GREY, fontsize="9")
                c.node(node.id, label, shape="box3d", margin="0.12,0.08", **style)
                for part, sub in node.subgraphs.items():
                    with c.subgraph(name=f"cluster_{node.id}/{part}") as p:
                        p.attr(label=part, style="rounded", color="#d1d5db")
                        _draw(p, sub, None if depth is None else depth - 1, saved)
        elif node.subgraphs:
            inside = [n for s in node.subgraphs.values() for n in s.nodes]
            dot.node(node.id, label + f"\n[{_count(inside, 'equation')} inside]",
                     shape="box3d", margin="0.12,0.08", **style)
        else:
            dot.node(node.id, label, shape="ellipse", **style)
    for out in graph.outputs:
        dot.node(out.id, f"{out.name}\n{_type(out.shape, out.dtype)}", shape="box",
                 style="filled,bold", fillcolor="white" if "/" in out.id else _GREEN)
    out_ids = {o.name: o.id for o in graph.outputs}
    for v in graph.values.values():
        tail = v.producer or (v.id if v.kind in ("leaf", "constant") else None)
        if tail is None:
            continue
        attrs = dict(label=_type(v.shape, v.dtype))
        if v.id in fan:
            attrs.update(color=_ORANGE, fontcolor=_ORANGE, penwidth="1.8")
        elif not is_float(v.dtype):
            attrs.update(color=_GREY, fontcolor=_GREY)
        for c in v.consumers:
            dot.edge(tail, out_ids.get(c, c), **attrs)


def _count(items, one: str, many: str | None = None) -> str:
    return f"{len(items)} {one if len(items) == 1 else many or one + 's'}"
