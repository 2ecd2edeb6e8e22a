"""The plot of ``funcgrad train`` (training.png): loss and gradient norms per step, with the
monitor's alerts as shaded bands."""
from __future__ import annotations


def _plot(history, path: str) -> str:
    # A Figure on the Agg canvas, not pyplot: no GUI backend is looked for or imported.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, NullLocator
    except ImportError as e:
        raise ImportError(f"the training plot needs matplotlib, one of funcgrad's "
                          f"dependencies, and importing it failed ({e}): this environment's "
                          "installation is incomplete or broken. Install it with: pip install "
                          "'matplotlib>=3.8'") from e
    import numpy as np

    layers = bool(getattr(history, "layer_names", ()))
    height = 8 if layers else 5.5
    fig = Figure(figsize=(7, height))
    FigureCanvasAgg(fig)
    # Fixed margins (inches, for the labels and ticks drawn here) instead of tight_layout,
    # which draws the whole figure once more to measure them.
    fig.subplots_adjust(left=0.9 / 7, right=1 - 0.15 / 7, bottom=0.55 / height,
                        top=1 - 0.45 / height, hspace=0.08 * 8 / height)
    axes = fig.subplots(3 if layers else 2, 1, sharex=True)
    ax_loss, ax_norm = axes[0], axes[1]
    steps = range(len(history.step_loss))
    ax_loss.plot(steps, history.step_loss, lw=0.8)
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.set_yscale("log")
    ax_norm.plot(steps, history.step_grad_norm, lw=0.8, color="tab:orange")
    ax_norm.set_ylabel("global grad norm (pre-clip)")
    ax_norm.set_yscale("log")
    if layers:  # one curve per layer; zeros (a dead layer) are left out of the log scale
        norms = np.asarray(history.step_layer_norm, float).reshape(len(steps), -1)
        ax_layers = axes[2]
        for j, name in enumerate(history.layer_names):
            ax_layers.plot(steps, np.where(norms[:, j] > 0, norms[:, j], np.nan), lw=0.8,
                           label=name)
        ax_layers.set_ylabel("layer grad norm")
        ax_layers.set_yscale("log")
        # Where the monitor raised alerts: merged bands on this panel only, at most
        # _MAX_SPANS of them, so that thousands of alerts leave the curves readable.
        labelled = set()
        for kind, start, end, _ in _alert_spans(history.alerts, len(steps)):
            ax_layers.axvspan(start, end, color=_ALERT_COLORS.get(kind, "tab:red"), alpha=0.15,
                              lw=0, label=None if kind in labelled else f"{kind} alerts")
            labelled.add(kind)
        ax_layers.legend(fontsize=7, ncol=min(4, len(history.layer_names) + 2), loc="best")
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        # Decades labelled 0.01, 0.1, 1 (not mathtext's 10^-2...) and no minor ticks: half
        # the plot's drawing time (each tick is a few artists, each label a text layout).
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
    fig.suptitle("funcgrad train: loss and gradient norms per step"
                 + (f" ({len(history.alerts)} monitor alerts, shaded)"
                    if layers and history.alerts else ""))
    fig.savefig(path, dpi=110)
    return path

#: Most alert bands `_plot` draws; `_ALERT_COLORS` gives each kind of alert its colour.
_MAX_SPANS = 30

_ALERT_COLORS = {"nonfinite": "black", "explosion": "tab:red", "vanishing": "tab:purple",
                 "dead_relu": "tab:brown"}

def _alert_spans(alerts, n_steps: int, *, max_spans: int = _MAX_SPANS):
    """Merged bands ``(kind, start, end, count)`` (steps) covering every alert, at most
    `max_spans`.

    Alerts of one kind closer than a gap merge into one band; the gap starts at 1% of the run
    and doubles until the bands fit. Each band is at least 0.5% of the run wide, so a
    one-step alert stays visible on 200,000 steps.
    """
    by_kind: dict[str, list[int]] = {}
    for alert in alerts:
        by_kind.setdefault(alert.kind, []).append(alert.step)
    gap = max(1, n_steps // 100)
    while True:
        spans = []
        for kind, found in by_kind.items():
            found = sorted(found)
            start = end = found[0]
            count = 0
            for step in found:
                if step - end > gap:
                    spans.append((kind, start, end, count))
                    start, count = step, 0
                end, count = step, count + 1
            spans.append((kind, start, end, count))
        if len(spans) <= max_spans:
            break
        gap *= 2
    width = max(1.0, n_steps / 200)
    return [(kind, start - width / 2, end + width / 2, count)
            for kind, start, end, count in spans]
