"""What each demo stage would cost on a real GPU: per-stage nominal times and alpha.

Derived once (not read at run time, so the demo runs on a fresh machine) from the measured
GPT-3 175B stage profiles on A100-SXM, bf16, 8 pipeline stages (Perseus SOSP'24 artifact,
`perseus-sosp24/stage_profiles/gpt3-175b+a100_sxm_bf16.csv`): the time of one microbatch at
1410 MHz, the compute-bound fraction `alpha` fitted by least squares to t(f)/t(1410) over the
38 measured clocks (855-1410 MHz), and the power `intensity` fitted to the energy curve's
shape under the simulator's power model. Stages 0-6 measured identical; stage 7 (final
layers and the language-model head) is 7.7% (forward) and 6.4% (backward) heavier.

A demo with N stages merges the 8 measured stages into N contiguous groups, as a smaller
pipeline would hold more layers per stage, then scales time so the default demo (4 stages,
8 microbatches, 1F1B) takes about 1.5 s per iteration: long enough that the host work between
instructions and the pipeline hops (about a millisecond each, which the service calibrates on
the job's own timeline) are a small part of it, as in a real job.
"""

from __future__ import annotations

from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.schedules.instruction import Kind

# (forward_s, forward_alpha, backward_s, backward_alpha) per GPT-3 stage, at 1410 MHz.
GPT3_A100_STAGES: tuple[tuple[float, float, float, float], ...] = (
    *((0.05016, 0.809, 0.09295, 0.749),) * 7,
    (0.05403, 0.811, 0.09886, 0.752),
)
FORWARD_INTENSITY = 0.92
BACKWARD_INTENSITY = 0.91

#: Time scale that makes 4 stages x 8 microbatches of 1F1B take about 1.5 s.
DEFAULT_TIME_SCALE = 0.45


def default_time_scale(num_stages: int, num_microbatches: int) -> float:
    """The time scale that gives `num_stages` x `num_microbatches` of 1F1B the nominal iteration
    time of the default demo (DEFAULT_TIME_SCALE at 4 x 8): about 1.5 s at maximum clocks."""
    return DEFAULT_TIME_SCALE * _nominal_1f1b_s(4, 8) / _nominal_1f1b_s(num_stages, num_microbatches)


def _nominal_1f1b_s(num_stages: int, num_microbatches: int) -> float:
    """1F1B's iteration time at scale 1 when the heaviest stage sets the pace: its forward and
    backward for every microbatch, plus one per extra stage to fill and drain the pipeline."""
    slowest = max(w[Kind.FORWARD].time_s + w[Kind.BACKWARD].time_s for w in stage_works(num_stages, 1.0))
    return (num_microbatches + num_stages - 1) * slowest


def stage_works(num_stages: int, time_scale: float = DEFAULT_TIME_SCALE) -> list[dict[Kind, Work]]:
    """Per stage, the Work of one forward and one backward microbatch."""
    measured = len(GPT3_A100_STAGES)
    if not 1 <= num_stages <= measured:
        raise ConfigError(f"the demo supports 1 to {measured} pipeline stages, got {num_stages}")
    if not time_scale > 0:
        raise ConfigError(f"time scale must be positive, got {time_scale!r}")
    bounds = [round(i * measured / num_stages) for i in range(num_stages + 1)]
    works = []
    for lo, hi in zip(bounds, bounds[1:]):
        group = GPT3_A100_STAGES[lo:hi]
        fwd = sum(g[0] for g in group)
        bwd = sum(g[2] for g in group)
        works.append(
            {
                Kind.FORWARD: Work(fwd * time_scale, sum(g[0] * g[1] for g in group) / fwd, FORWARD_INTENSITY),
                Kind.BACKWARD: Work(bwd * time_scale, sum(g[2] * g[3] for g in group) / bwd, BACKWARD_INTENSITY),
            }
        )
    return works
