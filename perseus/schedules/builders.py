"""Builders of the standard pipeline schedules, by name.

Every builder is pure: (stages, microbatches, chunks) -> Schedule. Orders follow Megatron-LM and
torch.distributed.pipelining, so a plan made here matches what those runtimes execute.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from perseus.exceptions import ConfigError, ScheduleError
from perseus.schedules.instruction import Instruction, Kind, Schedule

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT  # I (Kind.BACKWARD_INPUT) is spelled out


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards, in microbatch order (GPipe; torch's ScheduleGPipe)."""
    rows = tuple(
        tuple(Instruction(s, F, m) for m in range(num_microbatches))
        + tuple(Instruction(s, B, m) for m in range(num_microbatches))
        for s in range(num_stages)
    )
    return Schedule("gpipe", num_microbatches, rows)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Synchronous 1F1B (Megatron/DeepSpeed): min(N-s-1, M) warm-up forwards, F/B pairs, then
    the remaining backwards."""
    rows = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        row = [Instruction(s, F, m) for m in range(warmup)]
        for m in range(warmup, num_microbatches):
            row += [Instruction(s, F, m), Instruction(s, B, m - warmup)]
        row += [Instruction(s, B, m) for m in range(num_microbatches - warmup, num_microbatches)]
        rows.append(tuple(row))
    return Schedule("1f1b", num_microbatches, tuple(rows))


def _rank_ops(
    rank: int,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    warmup: int,
    backward_kind: Kind,
    weight_delay: int | None,
) -> tuple[Instruction, ...]:
    """The warm-up / steady 1F1B / cool-down order shared by interleaved 1F1B and ZB-H1 (the
    structure of Megatron's interleaved schedule and of torch's `_get_1f1b_rank_ops`).

    Forward op k runs chunk (k // N) % v; backward op k runs chunk v-1 - (k // N) % v; each
    chunk takes its microbatches in order. With `weight_delay` d (zero bubble), the W of the
    oldest pending backward follows every backward after the first d of them; the rest come last.
    """
    total = num_chunks * num_microbatches
    next_mb: dict[tuple[Kind, int], int] = defaultdict(int)
    pending_weights: list[tuple[int, int]] = []  # (chunk, microbatch) of I without W yet, oldest first
    row: list[Instruction] = []

    def emit(kind: Kind, chunk: int) -> None:
        m = next_mb[(kind, chunk)]
        next_mb[(kind, chunk)] = m + 1
        row.append(Instruction(rank, kind, m, chunk))
        if kind is Kind.BACKWARD_INPUT:
            pending_weights.append((chunk, m))

    def backward(k: int) -> None:
        emit(backward_kind, num_chunks - 1 - (k // num_stages) % num_chunks)
        if weight_delay is not None and k >= weight_delay:
            chunk, m = pending_weights.pop(0)
            row.append(Instruction(rank, W, m, chunk))

    for k in range(warmup):
        emit(F, (k // num_stages) % num_chunks)
    for k in range(total - warmup):
        emit(F, ((k + warmup) // num_stages) % num_chunks)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    row += [Instruction(rank, W, m, chunk) for chunk, m in pending_weights]
    return tuple(row)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: `num_chunks` model chunks per rank (loop placement: virtual
    stage = chunk * N + rank). Rank r warms up with min((v-1)N + 2(N-1-r), vM) forwards, as
    Megatron and torch's ScheduleInterleaved1F1B do; Megatron's all-warm-up special case for M == N
    is not copied (torch does not have it either)."""
    if num_chunks < 2:
        raise ScheduleError(f"interleaved-1f1b needs at least 2 chunks per rank, got {num_chunks}; use '1f1b' for one")
    if num_microbatches % num_stages:
        raise ScheduleError(
            f"interleaved-1f1b needs the number of microbatches ({num_microbatches}) to be a multiple "
            f"of the number of stages ({num_stages}); pick a multiple such as "
            f"{max(1, num_microbatches // num_stages) * num_stages}"
        )
    rows = tuple(
        _rank_ops(
            r,
            num_stages,
            num_microbatches,
            num_chunks,
            warmup=min((num_chunks - 1) * num_stages + 2 * (num_stages - 1 - r), num_chunks * num_microbatches),
            backward_kind=B,
            weight_delay=None,
        )
        for r in range(num_stages)
    )
    return Schedule("interleaved-1f1b", num_microbatches, rows, num_chunks=num_chunks)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., ICLR'24): 1F1B's warm-up and memory, backward split into
    input gradient (I) and weight gradient (W); rank r delays its first r W's so that they fill
    the cool-down bubble. Same order as torch's ScheduleInterleavedZeroBubble with one stage per rank."""
    rows = tuple(
        _rank_ops(
            r,
            num_stages,
            num_microbatches,
            1,
            warmup=min(num_stages - 1 - r, num_microbatches),
            backward_kind=Kind.BACKWARD_INPUT,
            weight_delay=r,
        )
        for r in range(num_stages)
    )
    return Schedule("zb-h1", num_microbatches, rows)


_BUILDERS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda n, m, v: gpipe(n, m),
    "1f1b": lambda n, m, v: one_f_one_b(n, m),
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": lambda n, m, v: zb_h1(n, m),
}
SCHEDULES: tuple[str, ...] = tuple(_BUILDERS)


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """The schedule called `name` (one of SCHEDULES) for N stages and M microbatches."""
    if name not in _BUILDERS:
        raise ConfigError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for what, value in (("stages", num_stages), ("microbatches", num_microbatches), ("chunks", num_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"number of {what} must be a positive integer, got {value!r}")
    if num_chunks != 1 and name != "interleaved-1f1b":
        raise ConfigError(
            f"schedule {name!r} runs one chunk per rank; num_chunks={num_chunks} needs 'interleaved-1f1b'"
        )
    return _BUILDERS[name](num_stages, num_microbatches, num_chunks)
