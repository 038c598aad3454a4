"""Helpers for the planner-service tests: a real `perseus serve` process on loopback, raw
DEALER requests, and a tiny two-stage profile."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

from perseus.profiler.profile import Profile, ProfilePoint
from perseus.wire.spec import JobSpec, RankInfo

FREQUENCIES = (1410, 1260, 1110, 960, 810)
BLOCKING_W = 83.64


def stage_profile(stage: int) -> Profile:
    """Stage 1 does 1.6x stage 0's work, so stage 0 has slack the planner can slow down into.
    Power falls with frequency faster than time grows, until static power dominates."""
    work = 1.0 if stage == 0 else 1.6
    points = {}
    for kind, base in (("forward", 0.010), ("backward", 0.020)):
        pts = []
        for f in FREQUENCIES:
            time_s = base * work * (1410 / f) ** 0.9
            power_w = 90.0 + 310.0 * (f / 1410) ** 2.5
            pts.append(ProfilePoint(f, time_s, power_w * time_s))
        points[(stage, kind)] = pts
    return Profile(points, BLOCKING_W)


def job_spec(world_size: int = 2, **overrides) -> JobSpec:
    fields = dict(
        schedule_name="1f1b", num_microbatches=4, gpu_model="sim-a100", warmup_iterations=2, iterations_per_frequency=2
    )
    fields.update(overrides)
    return JobSpec(world_size, 2, **fields)


def rank_info(rank: int, stage: int | None = None, **overrides) -> RankInfo:
    fields = dict(gpu_model="sim-a100", frequencies=FREQUENCIES)
    fields.update(overrides)
    return RankInfo(rank, rank if stage is None else stage, **fields)


# `perseus serve` with only the serve command registered: the full CLI also imports the other
# commands (torch, for the demo), which would add seconds to every service start.
SERVE_ONLY = (
    "import argparse, sys; from perseus.cli import serve; p = argparse.ArgumentParser(); "
    "serve.register(p.add_subparsers()); a = p.parse_args(); sys.exit(a.func(a))"
)


class Served:
    """`perseus serve` in a subprocess (`full_cli`: through `python -m perseus.cli.main`); logs
    go to `log_path`."""

    def __init__(
        self, state_dir: Path, bind: str = "tcp://127.0.0.1:0", full_cli: bool = False, extra: tuple[str, ...] = ()
    ) -> None:
        self.log_path = state_dir.parent / f"serve-{os.getpid()}-{id(self)}.log"
        self._log = open(self.log_path, "w")
        entry = ["-m", "perseus.cli.main"] if full_cli else ["-c", SERVE_ONLY]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                *entry,
                "serve",
                "--bind",
                bind,
                "--state-dir",
                str(state_dir),
                "--log-every",
                "1",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 20.0)
        line = self.proc.stdout.readline() if ready else ""
        self.exit_code = self.proc.wait(10) if not line else None
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"perseus serve did not start: {line!r}\n{self.log()}")
        self.endpoint = line.split()[-1]

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(10)
        finally:
            self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_request(endpoint: str, *frames: bytes, timeout_s: float = 5.0) -> dict | None:
    """Send frames on a fresh DEALER; the decoded reply, or None if none came."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(list(frames))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()


def request(endpoint: str, type_: str, request_id: int = 7, **fields) -> dict | None:
    return raw_request(endpoint, msgpack.packb({"v": 1, "id": request_id, "type": type_, **fields}))


def wait_until(predicate, timeout_s: float = 10.0):
    """Poll `predicate` until it returns something truthy (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def first_planned(endpoint: str, job_id: str, version: int, iteration: int) -> int:
    """The first iteration from `iteration` on that runs plan `version` (its start, or
    `iteration`), once the service publishes it. Asks the service's table at `iteration` itself:
    a rank asking at a later iteration tells the service the job got there, and a plan published
    meanwhile would start past it."""

    def table() -> dict | None:
        reply = request(endpoint, "get_table", job_id=job_id, rank=0, iteration=iteration, sweep_version=4)
        return reply if reply is not None and reply.get("plan_version") == version else None

    return max(iteration, wait_until(table, timeout_s=30)["plan_start_iteration"])
