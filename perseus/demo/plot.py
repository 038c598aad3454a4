"""Plot the measured timeline: a per-rank Gantt chart of instruction start and end."""

from __future__ import annotations

import importlib.util
import os

from perseus.atomic import write_json_atomic
from perseus.demo.results import Iteration
from perseus.exceptions import ConfigError

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "backward_input": "#c44e52", "backward_weight": "#55a868"}


def require_matplotlib() -> None:
    """ConfigError unless matplotlib can be imported."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'perseus[plot]'")


def plot_timelines(panels: list[tuple[str, Iteration]], out_dir: str) -> list[str]:
    """Write `timeline.png` (one Gantt panel per (title, iteration)) and `timeline.json` (the
    spans plotted) to `out_dir`; returns the paths written."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    horizon = max(s["end"] for _, it in panels for rank in it.spans for s in rank)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.0 + 0.55 * len(panels[0][1].spans) * len(panels)), squeeze=False)
    for ax, (title, it) in zip(axes[:, 0], panels):
        for rank, spans in enumerate(it.spans):
            for s in spans:
                ax.barh(rank, s["end"] - s["start"], left=s["start"], height=0.8,
                        color=COLORS.get(s["kind"], "gray"), edgecolor="black", linewidth=0.4)
                ax.text((s["start"] + s["end"]) / 2, rank, f"{s['kind'][0].upper()}{s['microbatch']}\n{s['frequency']}",
                        ha="center", va="center", fontsize=5)
        ax.set_title(f"{title}: iteration {it.index}, {it.time_s:.3f} s, {it.energy_j:.0f} J (all GPUs)", fontsize=9)
        ax.set_yticks(range(len(it.spans)), [f"rank {r}" for r in range(len(it.spans))])
        ax.set_ylim(len(it.spans) - 0.5, -0.5)
        ax.set_xlim(0, horizon * 1.01)
        ax.set_xlabel("seconds since the iteration started (labels: instruction, SM clock in MHz)", fontsize=8)
    fig.tight_layout()
    png = os.path.join(out_dir, "timeline.png")
    fig.savefig(png, dpi=150)
    plt.close(fig)
    data = os.path.join(out_dir, "timeline.json")
    write_json_atomic(
        data,
        [{"panel": title, "iteration": it.index, "time_s": it.time_s, "energy_j": it.energy_j, "ranks": [list(r) for r in it.spans]}
         for title, it in panels],
    )
    return [png, data]
