"""The doctor's HTML report: one self-contained page (no file or network beside it), the plots
embedded as base64 PNG drawn with matplotlib's Agg canvas (no GUI backend)."""
from __future__ import annotations

import base64
import html
import io
import linecache
import os
from typing import Any

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}
table{border-collapse:collapse;width:100%}td,th{padding:4px 8px;border-bottom:1px solid #ddd;
text-align:left;vertical-align:top}th{background:#f4f4f4}
.v{font-weight:600;border-radius:3px;padding:1px 6px;color:#fff}
.fail{background:#c62828}.error{background:#6a1b9a}.warn{background:#ef6c00}
.pass{background:#2e7d32}.skipped{background:#757575}
.finding{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;margin:.8em 0}
pre{background:#f6f8fa;padding:.5em;overflow-x:auto}img{max-width:100%}
.ev{font-size:12px;color:#555}td:nth-child(3){white-space:nowrap}
"""


def render(report: Any) -> str:
    """The page for a `funcgrad.doctor.DoctorReport`, as a string."""
    from funcgrad.doctor._finding import VERDICTS

    esc = html.escape
    order = sorted(report.findings, key=lambda f: VERDICTS.index(f.verdict))
    rows = "".join(
        f"<tr><td>{esc(f.check)}</td><td><span class='v {f.verdict}'>{f.verdict}</span></td>"
        f"<td>{f.seconds:.1f} s</td><td>{esc(f.summary)}</td></tr>" for f in order)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>funcgrad doctor</title><style>{_STYLE}</style></head><body>",
             "<h1>funcgrad doctor</h1>",
             f"<p>{esc(report.subject)}<br>exit status {report.exit_code}, "
             f"{report.seconds:.1f} s in all</p>",
             "<h2>Summary</h2><table><tr><th>check</th><th>verdict</th><th>time</th>"
             f"<th>summary</th></tr>{rows}</table>"]
    plots = _plots(report.curves)
    if plots:
        parts.append("<h2>Plots</h2>")
        parts += [f"<figure><img alt='{esc(title)}' src='data:image/png;base64,{png}'>"
                  f"<figcaption>{esc(title)}</figcaption></figure>" for title, png in plots]
    parts.append("<h2>Findings</h2>")
    for f in order:
        place = ", ".join(f"{k} <code>{esc(str(v))}</code>" for k, v in f.place.items())
        code = _code_line(f.place.get("line", ""), report.source)
        parts.append(
            f"<div class='finding' id='{esc(f.check)}'><h3>{esc(f.check)} "
            f"<span class='v {f.verdict}'>{f.verdict}</span></h3><p>{esc(f.summary)}</p>"
            + (f"<p>at {place}</p>" if place else "")
            + (f"<pre>{esc(code)}</pre>" if code else "")
            + (f"<p><b>fix:</b> {esc(f.fix)}</p>" if f.fix else "")
            + f"<details class='ev'><summary>evidence</summary><pre>"
              f"{esc(_evidence_text(f.evidence))}</pre></details></div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _code_line(line: str, source: str | None) -> str:
    """``model.py:23`` as "23 | <the line's text>" from the model file (or the file named, if
    it is readable next to it), with one line of context either side; "" if unreadable."""
    if not line or ":" not in line:
        return ""
    name, _, number = line.rpartition(":")
    if not number.isdigit():
        return ""
    candidates = [source] if source and os.path.basename(source) == name else []
    if source:
        candidates.append(os.path.join(os.path.dirname(source), name))
    for path in candidates:
        n = int(number)
        lines = [(i, linecache.getline(path, i).rstrip()) for i in range(max(1, n - 1), n + 2)]
        if any(text for _, text in lines):
            return "\n".join(f"{'>' if i == n else ' '} {i:4d} | {text}" for i, text in lines)
    return ""


def _evidence_text(evidence: dict) -> str:
    import json

    from funcgrad.doctor._finding import _strict_json

    text = json.dumps(_strict_json(evidence), indent=1)
    return text if len(text) < 20_000 else text[:20_000] + "\n... (cut; all of it in the JSON)"


def _plots(curves: dict) -> list[tuple[str, str]]:
    """[(title, base64 PNG)] for the curves recorded; [] without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return []
    import numpy as np

    out = []

    def png(fig) -> str:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    def axes(title: str, height: float = 3.2):
        fig = Figure(figsize=(8, height))
        FigureCanvasAgg(fig)
        fig.subplots_adjust(left=0.13, right=0.97, bottom=0.16, top=0.88)
        ax = fig.add_subplot()
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        return fig, ax

    loss, norm = curves.get("loss"), curves.get("grad_norm")
    if loss:
        fig = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(fig)
        fig.subplots_adjust(left=0.13, right=0.97, bottom=0.12, top=0.92, hspace=0.1)
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        ax1.plot(_positive(loss), lw=0.9)
        ax1.set_ylabel("loss")
        ax1.set_yscale("log")
        ax2.plot(_positive(norm or []), lw=0.9, color="tab:orange")
        ax2.set_ylabel("global grad norm")
        ax2.set_yscale("log")
        ax2.set_xlabel("step")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
        fig.suptitle("training check: loss and gradient norm per step", fontsize=10)
        out.append(("Loss and global gradient norm per step (training check)", png(fig)))
    layers = curves.get("layer_norm") or {}
    if layers and any(layers.values()):
        fig, ax = axes("gradient norm per layer and step (training check)", 3.6)
        for name, values in list(layers.items())[:20]:
            ax.plot(_positive(values), lw=0.8, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.legend(fontsize=6, ncol=2)
        out.append(("Per-layer gradient norms during training", png(fig)))
    init = curves.get("init_layer_norm") or {}
    if init:
        fig, ax = axes("gradient norm per layer at init (grad_stats)", 3.4)
        names = list(init)[:40]
        values = np.asarray([init[n] for n in names], float)
        finite = values[values > 0]
        log = bool(finite.size) and finite.max() > 10 * finite.min()
        if log:
            # Norms over decades (vanishing): points on a log axis. Not bars: a bar's length
            # there depends on where the axis starts.
            ax.plot(np.where(values > 0, values, np.nan), range(len(names)), "o", ms=4)
            ax.set_xscale("log")
        else:  # within a decade: bars from zero, lengths proportional to the norms
            ax.barh(range(len(names)), values)
        for i, v in enumerate(values):
            if log and not v > 0:
                continue
            ax.annotate(f"{v:.3g}", (v, i), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=6)
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.margins(x=0.12)  # room for the labels
        fig.subplots_adjust(left=0.35)
        out.append(("Per-layer gradient norms at init", png(fig)))
    dead = curves.get("dead_fraction") or {}
    dead_init = curves.get("init_dead_fraction") or {}
    if dead and any(dead.values()):
        fig, ax = axes("fraction of ReLU units dead for the whole batch, per step", 3.2)
        for name, values in dead.items():
            ax.plot(values, lw=0.8, label=name.split(" at ")[-1][:40])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
        out.append(("Dead ReLU fractions during training", png(fig)))
    elif dead_init:
        fig, ax = axes("fraction of ReLU units dead at init (grad_stats)", 3.0)
        names = list(dead_init)
        ax.barh(range(len(names)), [dead_init[n] for n in names])
        ax.set_yticks(range(len(names)), [n[:40] for n in names], fontsize=6)
        ax.set_xlim(0, 1)
        fig.subplots_adjust(left=0.35)
        out.append(("Dead ReLU fractions at init", png(fig)))
    return out


def _positive(values: list) -> list[float]:
    """Non-positive or non-finite values as NaN: gaps on a log scale, not errors."""
    import math

    return [v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else math.nan
            for v in values]
