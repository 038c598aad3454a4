"""Load benchmark of the planner service: 1,024 simulated ranks against one `perseus serve`.

    python benchmarks/service_load.py [--ranks 1024] [--processes 4] [--pp 8] [--dp 8]
                                      [--microbatches 16] [--poll-interval 0.25] [--timeout 120]

Each rank is one DEALER socket speaking the wire protocol (perseus.wire.messages)
directly; the ranks are spread over --processes worker processes, each with one zmq context and
one poller (not a PlannerClient, which costs a thread per rank). The ranks form ranks/(pp*dp)
jobs of pp stages x dp replicas (Megatron order: rank = stage * dp + dp_index; a job's ranks are
spread over every process), each job with its own tag so that each is profiled and planned
(the state directory starts empty: no cached profiles).

Phases, separated by barriers across the worker processes (a phase ends when its slowest rank is done):
  register  rank 0 of each job registers the job; every rank registers itself (a rank whose job is
            not registered yet gets unknown_job and retries after 50 ms, as PlannerClient does)
  upload    every rank uploads its stage's profile (synthetic: the simulated A100-SXM model's
            time and energy per frequency, down to a few frequencies past minimum energy)
  plan      every rank polls get_table every --poll-interval s (PlannerClient's default) until its
            plan's frequencies arrive; the service plans each job on a worker thread meanwhile
  fetch     every rank fetches its table once more (the full frequency list of its stage)
Every plan is checked: one supported frequency per instruction of the rank's stage.

Printed: wall time and requests of each phase, the service's peak memory (VmHWM) and CPU time,
against the targets (all ranks planned, register + upload + plan, within 20 s; service memory
under 1 GiB). Timings are wall-clock on a small shared machine: other processes inflate them.
Exits 1 if a rank fails or a target is missed. Everything is on loopback, every wait is bounded.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_support import PRESET, ServeProcess, stage_profile

from perseus.exceptions import ServiceError
from perseus.schedules import build_schedule
from perseus.wire.envelope import ErrorCode, decode_reply, encode_request
from perseus.wire.fields import Message
from perseus.wire.messages import GetStatus, GetTable, Ping, RegisterJob, RegisterRank, UploadProfile
from perseus.wire.spec import JobSpec, RankInfo

SCHEDULE = "1f1b"
TARGET_PLANNED_S = 20.0
TARGET_MEMORY_MB = 1024.0
RETRY_UNKNOWN_JOB_S = 0.05
PHASES = ("connect", "register", "upload", "plan", "fetch")


@dataclass(frozen=True)
class Layout:
    endpoint: str
    ranks: int
    processes: int
    pp: int
    dp: int
    microbatches: int
    poll_interval_s: float
    timeout_s: float

    @property
    def ranks_per_job(self) -> int:
        return self.pp * self.dp

    @property
    def jobs(self) -> int:
        return self.ranks // self.ranks_per_job

    def spec(self, job: int) -> JobSpec:
        return JobSpec(
            self.ranks_per_job,
            self.pp,
            dp=self.dp,
            schedule_name=SCHEDULE,
            num_microbatches=self.microbatches,
            gpu_model=PRESET.product,
            tag=f"load-{job}",
        )

    def info(self, local_rank: int) -> RankInfo:
        return RankInfo(
            local_rank,
            local_rank // self.dp,
            dp_index=local_rank % self.dp,
            gpu_model=PRESET.product,
            frequencies=PRESET.frequencies,
        )


# ---- worker processes: many DEALER sockets, one poller ------------------------------------------


class RankFailed(RuntimeError):
    pass


# A reply handler: (rank slot, reply fields or the ServiceError it carries) -> None when that rank
# is done with the phase, or (delay in seconds, next request) to send after the delay.
Handler = Callable[[int, "dict | ServiceError"], "tuple[float, Message] | None"]


class Ranks:
    """The DEALER sockets of one worker process and a loop that drives one request per rank."""

    def __init__(self, layout: Layout, global_ranks: list[int]) -> None:
        self.layout = layout
        self.global_ranks = global_ranks
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, len(global_ranks) + 64)
        self.sockets: list[zmq.Socket] = []
        self.poller = zmq.Poller()
        for _ in global_ranks:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(layout.endpoint)
            self.poller.register(sock, zmq.POLLIN)
            self.sockets.append(sock)
        self.slot_of = {sock: i for i, sock in enumerate(self.sockets)}
        self.next_id = [1] * len(global_ranks)
        self.requests = 0

    def job_and_local(self, slot: int) -> tuple[int, int]:
        return divmod(self.global_ranks[slot], self.layout.ranks_per_job)

    def exchange(self, first: dict[int, Message], handle: Handler, timeout_s: float) -> None:
        """Send each slot's first request; keep answering replies through `handle` until every slot
        is done. RankFailed if a reply is an unexpected error or `timeout_s` passes."""
        due: dict[int, tuple[float, int, bytes]] = {}  # slot -> (when, request id, frame)
        awaiting: dict[int, int] = {}  # slot -> request id in flight
        now = time.monotonic()
        for slot, message in first.items():
            due[slot] = (now, *self._encode(slot, message))
        deadline = now + timeout_s
        while due or awaiting:
            now = time.monotonic()
            if now > deadline:
                raise RankFailed(
                    f"{len(due) + len(awaiting)} ranks unfinished after {timeout_s:.0f} s (no reply or no plan)"
                )
            for slot, (at, request_id, payload) in list(due.items()):
                if at <= now:
                    del due[slot]
                    awaiting[slot] = request_id
                    self.sockets[slot].send(payload)
                    self.requests += 1
            wait_s = min((at for at, _, _ in due.values()), default=now + 0.05) - now
            for sock, _ in self.poller.poll(max(1, min(50, int(wait_s * 1000)))):
                slot = self.slot_of[sock]
                while True:
                    try:
                        request_id, result = decode_reply(sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if awaiting.get(slot) != request_id:
                        continue  # a stale reply
                    del awaiting[slot]
                    nxt = handle(slot, result)
                    if nxt is not None:
                        delay_s, message = nxt
                        due[slot] = (time.monotonic() + delay_s, *self._encode(slot, message))

    def _encode(self, slot: int, message: Message) -> tuple[int, bytes]:
        request_id = self.next_id[slot]
        self.next_id[slot] += 1
        return request_id, encode_request(request_id, message)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


def _check(slot: int, result: dict | ServiceError) -> dict:
    if isinstance(result, ServiceError):
        raise RankFailed(f"rank slot {slot}: {result}")
    return result


def run_phases(ranks: Ranks, barrier: Callable[[], None]) -> dict[str, int]:
    """Every phase in turn, each followed by a barrier; the number of requests each phase sent."""
    layout = ranks.layout
    slots = range(len(ranks.global_ranks))
    jobs = {j: layout.spec(j) for j in range(layout.jobs)}
    job_ids = {j: spec.job_id() for j, spec in jobs.items()}
    instructions = {
        s: len(build_schedule(SCHEDULE, layout.pp, layout.microbatches).stages[s]) for s in range(layout.pp)
    }
    profiles = {s: stage_profile(s, layout.pp) for s in range(layout.pp)}
    supported = set(PRESET.frequencies)
    counts: dict[str, int] = {"verified": 0}  # requests per phase, and plans checked in the fetch phase

    def register_rank(slot: int) -> RegisterRank:
        job, local = ranks.job_and_local(slot)
        return RegisterRank(job_ids[job], layout.info(local))

    def get_table(slot: int) -> GetTable:
        job, local = ranks.job_and_local(slot)
        return GetTable(job_ids[job], local, iteration=-1, plan_version=0)

    def on_reply(slot: int, result: dict | ServiceError):
        _check(slot, result)

    def on_register(slot: int, result: dict | ServiceError):
        if isinstance(result, ServiceError) and result.code == ErrorCode.UNKNOWN_JOB.value:
            return RETRY_UNKNOWN_JOB_S, register_rank(slot)
        return (0.0, register_rank(slot)) if "job_id" in _check(slot, result) else None  # job registered: now the rank

    def on_table(poll_s: float | None):
        def handle(slot: int, result: dict | ServiceError):
            doc = _check(slot, result)
            if doc.get("frequencies") is None:
                if doc.get("phase") == "failed" or poll_s is None:
                    raise RankFailed(
                        f"rank slot {slot}: no plan (job phase {doc.get('phase')}, error {doc.get('error')!r})"
                    )
                return poll_s, get_table(slot)
            _, local = ranks.job_and_local(slot)
            freqs = doc["frequencies"]
            stage = local // layout.dp
            if len(freqs) != instructions[stage] or not set(freqs) <= supported:
                raise RankFailed(
                    f"rank slot {slot}: plan has {len(freqs)} frequencies for {instructions[stage]} instructions, "
                    "or unsupported ones"
                )
            counts["verified"] += poll_s is None
            return None

        return handle

    def upload(slot: int) -> UploadProfile:
        job, local = ranks.job_and_local(slot)
        stage = local // layout.dp
        return UploadProfile(job_ids[job], local, stage, profiles[stage])

    def first_register(slot: int) -> Message:
        job, local = ranks.job_and_local(slot)
        return RegisterJob(jobs[job]) if local == 0 else register_rank(slot)

    phases: list[tuple[str, Callable[[int], Message], Handler]] = [
        ("connect", lambda slot: Ping(), on_reply),
        ("register", first_register, on_register),
        ("upload", upload, on_reply),
        ("plan", get_table, on_table(layout.poll_interval_s)),
        ("fetch", get_table, on_table(None)),
    ]
    for name, first, handle in phases:
        before = ranks.requests
        ranks.exchange({slot: first(slot) for slot in slots}, handle, layout.timeout_s)
        counts[name] = ranks.requests - before
        barrier()
    return counts


def worker(
    layout: Layout, index: int, barrier: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue
) -> None:
    global_ranks = list(range(index, layout.ranks, layout.processes))
    try:
        ranks = Ranks(layout, global_ranks)
        try:
            barrier.wait(layout.timeout_s)  # every socket made: start together
            counts = run_phases(ranks, lambda: barrier.wait(layout.timeout_s))
        finally:
            ranks.close()
        results.put((index, counts, None))
    except threading.BrokenBarrierError:
        results.put((index, None, "another worker failed"))
    except Exception as e:
        barrier.abort()
        results.put((index, None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))


# ---- the main process: the service, the barriers, the figures -----------------------------------


def job_status(endpoint: str) -> list[dict]:
    """Every job's status, through one request on a fresh DEALER."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode_request(1, GetStatus()))
        if not sock.poll(10_000):
            raise RankFailed("the service did not answer a status request within 10 s")
        return _check(-1, decode_reply(sock.recv())[1])["jobs"]
    finally:
        sock.close()


def run(layout_args: argparse.Namespace) -> int:
    a = layout_args
    with tempfile.TemporaryDirectory(prefix="perseus-load-") as tmp:
        service = ServeProcess(Path(tmp) / "state", Path(tmp) / "serve.log")
        layout = Layout(service.endpoint, a.ranks, a.processes, a.pp, a.dp, a.microbatches, a.poll_interval, a.timeout)
        print(
            f"service {service.endpoint} (pid {service.pid}); {layout.ranks} ranks in {layout.processes} processes "
            f"x {layout.ranks // layout.processes} DEALER sockets; {layout.jobs} jobs x {layout.ranks_per_job} ranks "
            f"(pp {layout.pp} x dp {layout.dp}, {SCHEDULE}, {layout.microbatches} microbatches, "
            f"{PRESET.product} profiles); "
            f"ranks poll every {layout.poll_interval_s} s",
            flush=True,
        )
        memory_start = service.memory_mb()[0]
        cpu_start = service.cpu_s()
        context = multiprocessing.get_context("fork")
        barrier = context.Barrier(layout.processes + 1)
        results = context.Queue()
        procs = [
            context.Process(target=worker, args=(layout, i, barrier, results), daemon=True)
            for i in range(layout.processes)
        ]
        for p in procs:
            p.start()
        marks: list[float] = []
        memory: list[float] = []
        failed = ""
        try:
            barrier.wait(layout.timeout_s)
            marks.append(time.monotonic())
            for _ in PHASES:
                barrier.wait(layout.timeout_s)
                marks.append(time.monotonic())
                memory.append(service.memory_mb()[0])
        except threading.BrokenBarrierError:
            failed = "a worker failed or timed out"
        outcomes = {}
        for _ in procs:
            try:
                index, counts, error = results.get(timeout=layout.timeout_s)
            except Exception:
                break
            outcomes[index] = (counts, error)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        errors = [f"worker {i}: {e}" for i, (_, e) in sorted(outcomes.items()) if e]
        if failed or errors or len(outcomes) != len(procs):
            print(f"FAILED: {failed or 'a worker did not report'}", *errors, sep="\n")
            print("service alive:", service.alive(), "\nservice log tail:\n" + service.log_tail())
            service.stop()
            return 1
        statuses = job_status(service.endpoint)
        rss_mb, peak_mb = service.memory_mb()
        cpu_s = service.cpu_s() - cpu_start
        service.stop()

    planned = [s for s in statuses if s["phase"] == "planned" and s["ranks_registered"] == layout.ranks_per_job]
    requests = {name: sum(counts[name] for counts, _ in outcomes.values()) for name in PHASES}
    verified = sum(counts["verified"] for counts, _ in outcomes.values())
    walls = {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)}
    savings = [1 - s["predicted_energy_j"] / s["predicted_baseline_energy_j"] for s in planned]
    print(f"\n{'phase':<10} {'wall s':>8} {'requests':>9} {'req/s':>8} {'service RSS after, MiB':>23}")
    for i, name in enumerate(PHASES):
        print(
            f"{name:<10} {walls[name]:8.2f} {requests[name]:9d} {requests[name] / walls[name]:8.0f} {memory[i]:23.0f}"
        )
    planned_s = walls["register"] + walls["upload"] + walls["plan"]
    ok_time = planned_s <= TARGET_PLANNED_S and len(planned) == layout.jobs and verified == layout.ranks
    ok_memory = peak_mb < TARGET_MEMORY_MB
    print(
        f"\njobs planned: {len(planned)} of {layout.jobs}; "
        f"ranks whose fetched plan was checked: {verified} of {layout.ranks}"
    )
    if savings:
        print(f"predicted energy saving per job (no slowdown): {100 * min(savings):.1f}% to {100 * max(savings):.1f}%")
    print(f"\n{'figure':<42} {'measured':>12} {'target':>12}")
    print(
        f"{'all ranks planned (register+upload+plan)':<42} {planned_s:10.2f} s {'<= 20 s':>12}  "
        f"{'OK' if ok_time else 'MISSED'}"
    )
    print(f"{'  + fetch (every rank once more)':<42} {planned_s + walls['fetch']:10.2f} s")
    print(
        f"{'service peak memory (VmHWM)':<42} {peak_mb:8.0f} MiB {'< 1024 MiB':>12}  {'OK' if ok_memory else 'MISSED'}"
    )
    print(f"{'  service RSS at start / at end':<42} {memory_start:8.0f} MiB / {rss_mb:.0f} MiB")
    print(f"{'service CPU time during the run':<42} {cpu_s:10.2f} s")
    print("(wall-clock on a shared machine: other processes' load inflates these times)")
    return 0 if ok_time and ok_memory else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024, help="simulated ranks in all (default 1024)")
    parser.add_argument(
        "--processes", type=int, default=4, help="worker processes holding the ranks' sockets (default 4)"
    )
    parser.add_argument("--pp", type=int, default=8, help="pipeline stages per job (default 8)")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel pipelines per job (default 8)")
    parser.add_argument("--microbatches", type=int, default=16, help="microbatches per iteration (default 16)")
    parser.add_argument(
        "--poll-interval", type=float, default=0.25, help="seconds between a rank's table polls (default 0.25)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="limit on each phase, in seconds (default 120)")
    a = parser.parse_args(argv)
    if a.ranks < 1 or a.processes < 1 or a.pp < 1 or a.dp < 1 or a.ranks % (a.pp * a.dp):
        parser.error(f"--ranks must be a positive multiple of pp * dp = {a.pp * a.dp}, with --processes >= 1")
    if a.processes > a.ranks:
        parser.error("--processes must not exceed --ranks")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
