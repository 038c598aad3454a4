"""How long registering a large job holds the planner service's socket loop.

    python benchmarks/service_register.py [--stages 8]

A `perseus serve` process on loopback is pinged every 5 ms by one DEALER while a job at the
instruction cap (protocol.MAX_INSTRUCTIONS) registers, once with a named 1F1B schedule and once
with the same order as explicit stage_orders (about a megabyte on the wire). Printed side by
side for each: the longest ping round trip while idle and from the registration until the
schedule is built, the register_job round trip, and how long building the schedule takes (in
this process) -- what the loop would stall for on top if it built the schedule itself, as it
did before schedules moved to a worker thread. Wall-clock figures; noisy when other
processes share the CPUs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import zmq

SERVE = (
    "import argparse, sys; from perseus.cli import serve; p = argparse.ArgumentParser(); "
    "serve.register(p.add_subparsers()); a = p.parse_args(); sys.exit(a.func(a))"
)


class Pinger(threading.Thread):
    """Pings the service every `interval_s`; keeps (send time, round trip) of each."""

    def __init__(self, endpoint: str, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.interval_s = endpoint, interval_s
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        ping = msgpack.packb({"v": 1, "id": 1, "type": "ping"})
        while not self.stop.is_set():
            t0 = time.perf_counter()
            sock.send(ping)
            if sock.poll(30_000):
                sock.recv()
            self.samples.append((t0, time.perf_counter() - t0))
            time.sleep(self.interval_s)
        sock.close()

    def worst(self, start: float, end: float) -> float:
        return max((rtt for t0, rtt in self.samples if start <= t0 + rtt and t0 <= end), default=0.0)


def request(endpoint: str, payload: bytes) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(payload)
    if not sock.poll(60_000):
        raise SystemExit("the service did not answer within 60 s")
    reply = msgpack.unpackb(sock.recv(), raw=False)
    sock.close()
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=8)
    args = parser.parse_args()

    from perseus.schedules import build_schedule
    from perseus.service.planning import job_schedule
    from perseus.wire import JobSpec
    from perseus.wire.envelope import encode_request
    from perseus.wire.limits import MAX_INSTRUCTIONS
    from perseus.wire.messages import RegisterJob

    pp = args.stages
    microbatches = MAX_INSTRUCTIONS // (2 * pp)
    order = build_schedule("1f1b", pp, microbatches)
    orders = tuple(tuple((i.kind.value, i.microbatch, i.chunk) for i in row) for row in order.stages)
    specs = {
        "named 1f1b": JobSpec(pp, pp, schedule_name="1f1b", num_microbatches=microbatches, gpu_model="bench"),
        "stage_orders": JobSpec(
            pp, pp, schedule_name="1f1b", num_microbatches=microbatches, gpu_model="bench", stage_orders=orders, tag="o"
        ),
    }
    builds = {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        job_schedule(spec)
        builds[name] = time.perf_counter() - t0
    print(f"{pp} stages x {microbatches} microbatches = {2 * pp * microbatches} instructions (the cap)")
    with tempfile.TemporaryDirectory() as state:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "serve", "--bind", "tcp://127.0.0.1:0", "--state-dir", state],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            endpoint = proc.stdout.readline().split()[-1]
            pinger = Pinger(endpoint)
            pinger.start()
            time.sleep(1.0)
            idle = pinger.worst(0.0, time.perf_counter())
            print(
                f"{'spec':<14} {'wire':>9} {'idle ping':>10} {'ping while registering':>23} "
                f"{'register_job':>13} {'schedule build':>15}"
            )
            for name, spec in specs.items():
                payload = encode_request(1, RegisterJob(spec))
                t0 = time.perf_counter()
                reply = request(endpoint, payload)
                registered = time.perf_counter() - t0
                assert reply["ok"], reply
                time.sleep(max(1.0, 3 * builds[name]))  # the build runs on the service's worker meanwhile
                worst = pinger.worst(t0, time.perf_counter())
                print(
                    f"{name:<14} {len(payload) / 1e6:6.2f} MB {idle * 1e3:7.1f} ms {worst * 1e3:20.1f} ms "
                    f"{registered * 1e3:10.1f} ms {builds[name] * 1e3:12.1f} ms"
                )
            pinger.stop.set()
            pinger.join()
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
