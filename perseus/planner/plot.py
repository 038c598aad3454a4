"""Pictures of iterations and plans, one style for `perseus plan --plot` and `perseus demo --plot`.

`plot_gantt` draws one Gantt chart per panel, stacked on a shared time axis: a row per stage
(or rank), a box per instruction coloured by a value on one scale for all panels (its average
power, its SM clock), and optionally the critical path. `plot_timeline` draws planner
evaluations that way; the demo draws its measured spans (perseus.demo.report). `plot_frontier`
draws the time-energy frontier, `plot_measured` measured iterations against predictions.

matplotlib is an optional extra (`pip install 'perseus-energy[plot]'`); it is imported only here.
Each function returns the picture as PNG bytes; the caller decides where it goes.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from perseus.exceptions import ConfigError
from perseus.planner.evaluator import Evaluation
from perseus.profiler.profile import Profile
from perseus.schedules.instruction import KIND_LETTERS, Schedule

#: Above this many boxes in a panel, boxes go unlabelled (the text would be unreadable).
MAX_LABELLED = 400


@dataclass(frozen=True)
class Bar:
    """One instruction's box: on row `row` from `start` to `end` (s), coloured by `value`."""

    row: int
    start: float
    end: float
    label: str
    value: float


@dataclass(frozen=True)
class Panel:
    """One Gantt chart: its title, its boxes, and the boxes a path line runs through (in order)."""

    title: str
    bars: Sequence[Bar]
    path: Sequence[Bar] = ()


def pyplot():
    """matplotlib.pyplot on the Agg backend; ConfigError if matplotlib is not installed."""
    try:
        import matplotlib  # optional dependency (perseus-energy[plot])

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'perseus-energy[plot]'") from None
    return plt


def _png(plt, fig) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=120)
    finally:
        plt.close(fig)
    return buf.getvalue()


def plot_gantt(panels: Sequence[Panel], rows: Sequence[str], value_label: str, time_label: str = "time (s)") -> bytes:
    """The panels stacked with a shared time axis; `rows` names the rows (top to bottom) and
    `value_label` the colour scale's quantity."""
    plt = pyplot()
    from matplotlib import cm, colors  # optional dependency, as in pyplot()

    values = [b.value for p in panels for b in p.bars]
    norm = colors.Normalize(vmin=min(values, default=0.0), vmax=max(values, default=1.0))
    cmap = plt.get_cmap("RdYlBu_r")
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(14, 1.2 + 0.45 * len(rows) * len(panels)),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    horizon = max((b.end for p in panels for b in p.bars), default=1.0)
    for ax, panel in zip(axes[:, 0], panels):
        labelled = len(panel.bars) <= MAX_LABELLED
        for b in panel.bars:
            ax.barh(
                b.row,
                b.end - b.start,
                left=b.start,
                height=0.8,
                color=cmap(norm(b.value)),
                edgecolor="black",
                linewidth=0.3,
            )
            if labelled:
                ax.text((b.start + b.end) / 2, b.row, b.label, ha="center", va="center", fontsize=6)
        if panel.path:
            xs = [t for b in panel.path for t in (b.start, b.end)]
            ys = [b.row for b in panel.path for _ in range(2)]
            ax.plot(xs, ys, color="black", linewidth=1.5, label="critical path")
            ax.legend(loc="upper right", fontsize=7)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_yticks(range(len(rows)), list(rows))
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(panel.title, fontsize=9)
    axes[-1, 0].set_xlabel(time_label)
    fig.colorbar(
        cm.ScalarMappable(norm=norm, cmap=cmap),
        ax=axes[:, 0].tolist(),
        label=value_label,
        fraction=0.02,
        pad=0.01,
        aspect=30,
    )
    return _png(plt, fig)


def plot_timeline(panels: Sequence[tuple[str, Evaluation]], schedule: Schedule, profile: Profile) -> bytes:
    """One Gantt chart per (title, evaluation): a box per instruction on its stage's row,
    coloured by its average power, the critical path drawn."""

    def bar(ins, start: float, end: float, frequency: int) -> Bar:
        point = profile.lookup(profile.stage_for(ins, schedule), ins.kind, frequency)
        return Bar(ins.stage, start, end, f"{KIND_LETTERS[ins.kind]}{ins.microbatch}", point.energy / point.time)

    gantt = []
    for title, ev in panels:
        bars = {ins: bar(ins, start, end, ev.frequencies[ins]) for ins, (start, end) in ev.timeline.items()}
        title = f"{title}: {ev.iteration_time_s:.4g} s, {ev.energy_j:.6g} J"
        gantt.append(Panel(title, list(bars.values()), [bars[ins] for ins in ev.critical_path()]))
    rows = [f"stage {s}" for s in range(len(panels[0][1].stages))]
    return plot_gantt(gantt, rows, "power (W)")


def plot_frontier(frontier: Sequence, baselines: Mapping[str, tuple[float, float]]) -> bytes:
    """Energy against iteration time: the frontier (FrontierPoints), the lower bound at each
    deadline, and each baseline's (time, energy) point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5), tight_layout=True)
    ax.plot([p.time_s for p in frontier], [p.energy_j for p in frontier], "o-", markersize=3, label="Perseus frontier")
    ax.plot(
        [p.plan.deadline_s for p in frontier],
        [p.lower_bound_j for p in frontier],
        "--",
        color="gray",
        label="lower bound",
    )
    markers = iter("s^vDPX*")
    for name, (t, e) in baselines.items():
        ax.plot([t], [e], next(markers, "o"), markersize=8, label=name)
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration (J)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(plt, fig)


def plot_measured(
    groups: Mapping[str, Sequence[tuple[float, float]]], predictions: Mapping[str, tuple[float, float]]
) -> bytes:
    """Energy against iteration time as measured: a point per (time, energy) in each group (one
    colour per group, e.g. a phase of training), and a cross per predicted (time, energy)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5), tight_layout=True)
    for name, points in groups.items():
        ax.plot(
            [t for t, _ in points], [e for _, e in points], "o", markersize=4, alpha=0.7, label=f"{name} (measured)"
        )
    for name, (t, e) in predictions.items():
        ax.plot([t], [e], "X", markersize=11, markeredgecolor="black", label=f"{name} (predicted)")
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration, all GPUs (J)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(plt, fig)
