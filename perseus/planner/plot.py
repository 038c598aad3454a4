"""Pictures of plans: a per-stage Gantt chart of one iteration, and the time-energy frontier.

matplotlib is an optional extra (`pip install 'perseus[plot]'`); it is imported only here.
Each function returns the picture as PNG bytes; the caller decides where it goes.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from perseus.exceptions import ConfigError
from perseus.planner.evaluator import Evaluation
from perseus.profiler.profile import Profile
from perseus.schedules.instruction import KIND_LETTERS, Schedule


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'perseus[plot]'") from None
    return plt


def _png(plt, fig) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=120)
    finally:
        plt.close(fig)
    return buf.getvalue()


def plot_timeline(panels: Sequence[tuple[str, Evaluation]], schedule: Schedule, profile: Profile) -> bytes:
    """One Gantt chart per (title, evaluation), stacked with a shared time axis: a box per
    instruction on its stage's row, coloured by its average power, the critical path drawn."""
    plt = pyplot()
    from matplotlib import cm, colors

    def power(ins, frequency: int) -> float:
        point = profile.lookup(profile.stage_for(ins, schedule), ins.kind, frequency)
        return point.energy / point.time

    powers = [power(ins, f) for _, ev in panels for ins, f in ev.frequencies.items()]
    norm = colors.Normalize(vmin=min(powers), vmax=max(powers))
    cmap = plt.get_cmap("RdYlBu_r")
    num_stages = len(panels[0][1].stages)
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.0 + 0.45 * num_stages * len(panels)), sharex=True, squeeze=False)
    horizon = max(ev.iteration_time_s for _, ev in panels)
    for ax, (title, ev) in zip(axes[:, 0], panels):
        label = len(ev.timeline) <= 400
        for ins, (start, end) in ev.timeline.items():
            color = cmap(norm(power(ins, ev.frequencies[ins])))
            ax.barh(ins.stage, end - start, left=start, height=0.8, color=color, edgecolor="black", linewidth=0.3)
            if label:
                ax.text((start + end) / 2, ins.stage, f"{KIND_LETTERS[ins.kind]}{ins.microbatch}", ha="center", va="center", fontsize=6)
        path_nodes = ev.critical_path()
        xs, ys = [], []
        for ins in path_nodes:
            start, end = ev.timeline[ins]
            xs += [start, end]
            ys += [ins.stage, ins.stage]
        ax.plot(xs, ys, color="black", linewidth=1.5, label="critical path")
        ax.set_ylim(num_stages - 0.5, -0.5)
        ax.set_yticks(range(num_stages))
        ax.set_ylabel("stage")
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(f"{title}: {ev.iteration_time_s:.4g} s, {ev.energy_j:.6g} J")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("time (s)")
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[:, 0].tolist(), label="power (W)", fraction=0.02, pad=0.01)
    return _png(plt, fig)


def plot_frontier(frontier: Sequence, baselines: Mapping[str, tuple[float, float]]) -> bytes:
    """Energy against iteration time: the frontier (FrontierPoints), the lower bound at each
    deadline, and each baseline's (time, energy) point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5), tight_layout=True)
    ax.plot([p.time_s for p in frontier], [p.energy_j for p in frontier], "o-", markersize=3, label="Perseus frontier")
    ax.plot([p.plan.deadline_s for p in frontier], [p.lower_bound_j for p in frontier], "--", color="gray", label="lower bound")
    markers = iter("s^vDPX*")
    for name, (t, e) in baselines.items():
        ax.plot([t], [e], next(markers, "o"), markersize=8, label=name)
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration (J)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(plt, fig)
