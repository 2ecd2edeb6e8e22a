"""What the drawings and tables of the graph, memory and micro tools share: the colours of
their nodes and the short forms of types and byte counts."""
from __future__ import annotations

#: Node colours: params (blue), outputs (green), a value used more than once (orange), and
#: what does not carry a gradient (grey).
BLUE, GREEN, ORANGE, GREY = "#dbeafe", "#dcfce7", "#ea580c", "#9ca3af"


def type_text(shape: tuple[int, ...], dtype: str) -> str:
    """``f32[64,10]`` for shape (64, 10) and dtype "float32" (JAX's short dtype names)."""
    short = dtype
    for long, abbr in (("bfloat", "bf"), ("float", "f"), ("complex", "c"), ("uint", "u"),
                       ("int", "i")):
        short = short.replace(long, abbr)
    return f"{short}[{','.join(map(str, shape))}]"


def byte_text(n: int) -> str:
    """`n` bytes (>= 0) in B, KiB or MiB, one decimal: ``byte_text(1536) == "1.5 KiB"``."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
