"""The profiling sweep the service designs for a job's ranks (`Table.sweep_steps`).

Ranks only run the steps and measure (perseus.profiler.sweep walks them, perseus.profiler.online
measures). The design: for each sweep frequency f (highest first), `steps_per_frequency`
steps of one iteration each. The first runs every instruction kind at f. Each further step
runs one group of kinds at f and the others at g, the frequency profiled just before f (the
next one for the first): in every window of the energy counter the kinds at f mix with kinds at
g in other proportions than in the uniform step, which is what lets least squares tell the
kinds' powers apart when a counter step spans several instructions (see
perseus.profiler.online). With the default three steps, forward runs alone at f in one step
and the backward kinds in the other; with two, forward alone in the second.
"""

from __future__ import annotations

from collections.abc import Sequence

from perseus.exceptions import ConfigError
from perseus.profiler.profile import KINDS

#: Which kinds share a mixed step: forward apart from backward (and backward_input), weight
#: gradients apart from both when there are steps enough.
KIND_GROUP = {"forward": 0, "backward": 1, "backward_input": 1, "backward_weight": 2}


def design_steps(frequencies: Sequence[int], steps_per_frequency: int) -> tuple[tuple[int, ...], ...]:
    """Every step of the sweep: per step, one clock (MHz) per kind in KINDS order."""
    freqs = [int(f) for f in frequencies]
    if not freqs:
        raise ConfigError("the profiling sweep needs at least one frequency")
    if steps_per_frequency < 1:
        raise ConfigError(f"iterations_per_frequency must be >= 1, got {steps_per_frequency}")
    steps = []
    mixes = steps_per_frequency - 1
    for k, f in enumerate(freqs):
        g = freqs[k - 1] if k > 0 else freqs[min(1, len(freqs) - 1)]
        steps.append(tuple(f for _ in KINDS))
        for s in range(mixes):
            steps.append(tuple(f if KIND_GROUP[kind] % max(mixes, 2) == s else g for kind in KINDS))
    return tuple(steps)
