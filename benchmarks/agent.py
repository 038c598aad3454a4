"""What the perseus agent costs and what it buys, side by side with the direct path, in one run.

On simulated GPUs (one `perseus agent` process serving them, as on a node):
  1. training-thread cost per instruction: FrequencyController.before_instruction with a new clock
     on every instruction (the worst case: a hand-off to the worker thread every time), its GPU
     written directly and through the agent (target: under 20 us either way);
  2. end-to-end latency of a clock change: from the request on the training thread until the GPU
     has the clock (FrequencyController.apply_now), and of one raw lock_sm_clock and
     set_power_limit_mw call, direct and through the agent;
  3. what a kill leaves: a rank process (its own process group) locks GPU clocks, then its whole
     group is SIGKILLed: the time until the GPU is back at defaults through the agent (target 1 s),
     against the direct path's watchdog process (which survives a process-group kill) and against
     the direct path when the watchdog is killed too (a cgroup kill: scancel, a deleted pod); and a
     SIGSTOPped rank, whose heartbeats stop, through the agent.
Timed in interleaved rounds so load from other processes hits both paths alike.

    python benchmarks/agent.py [--instructions 20000] [--kills 5]

Exits 1 if the agent path misses a target (20 us median per instruction, 1 s median after a kill).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from perseus.agent.process import AgentProcess
from perseus.controller import FrequencyController
from perseus.devices.agent_gpu import through_agent
from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU

PRESET = "a100-sxm"
INSTRUCTION_TARGET_US = 20.0
RESET_TARGET_MS = 1000.0
HEARTBEAT_TIMEOUT_S = 1.0
LEFT_LOCKED_AFTER_S = 2.0
CLOCKS = (1410, 1005)

# A rank: locks GPU 0's clock (through the agent, or directly with a frequency controller and its
# watchdog), says so, and trains on until killed.
RANK = """
import os, sys, time
from perseus.controller import FrequencyController
from perseus.devices import get_gpus
gpu = get_gpus()[0]
controller = FrequencyController(gpu, handle_signals=False)
assert controller.apply_now(990, timeout=30)
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def per_instruction(controllers: dict[str, FrequencyController], instructions: int, rounds: int = 20) -> dict:
    """Training-thread ns per before_instruction, a new clock each time, interleaved by rounds."""
    keys = [("forward", m, 0) for m in range(64)]
    for controller in controllers.values():
        controller.set_plan(keys, [CLOCKS[i % 2] for i in range(len(keys))])
    clock = time.perf_counter_ns
    samples: dict[str, list[int]] = {name: [] for name in controllers}
    per_round = max(1, instructions // rounds)
    for _ in range(rounds):
        for name, controller in controllers.items():
            out = samples[name]
            before = controller.before_instruction
            for i in range(per_round):
                if i % len(keys) == 0:
                    controller.begin_iteration()
                kind, microbatch, chunk = keys[i % len(keys)]
                t0 = clock()
                before(kind, microbatch, chunk)
                out.append(clock() - t0)
            controller.wait_applied(5.0)
            time.sleep(0.002)
    return samples


def timed_calls(calls: dict[str, Callable[[int], None]], repeats: int) -> dict[str, list[int]]:
    """ns per call of each `calls[name](i)`, interleaved."""
    samples: dict[str, list[int]] = {name: [] for name in calls}
    clock = time.perf_counter_ns
    for i in range(repeats):
        for name, call in calls.items():
            t0 = clock()
            call(i)
            samples[name].append(clock() - t0)
    return samples


def start_rank(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A rank process in its own process group, once it holds the clock, and its child processes
    (the direct path's watchdog; none through the agent)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK], stdout=subprocess.PIPE, env={**os.environ, **env}, start_new_session=True
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"the rank did not start (exit code {proc.poll()})")
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        return proc, [int(pid) for pid in f.read().split()]


def until_default(gpu: SimGPU, began: float, timeout_s: float) -> float | None:
    """ms from `began` until `gpu` is back at defaults (its state file gone), None after `timeout_s`."""
    while os.path.exists(gpu.state_path):
        if time.monotonic() - began > timeout_s:
            return None
        time.sleep(0.0005)
    return (time.monotonic() - began) * 1000


def kill_runs(kind: str, env: dict[str, str], gpu: SimGPU, runs: int) -> list[float | None]:
    """ms until defaults after each of `runs` kills of a rank ("group", "group+watchdog" or "stop")."""
    results: list[float | None] = []
    for _ in range(runs):
        proc, children = start_rank(env)
        began = time.monotonic()
        if kind == "stop":
            os.kill(proc.pid, signal.SIGSTOP)
        else:
            if kind == "group+watchdog":
                # The watchdog (its own session, so only a cgroup kill reaches it) goes first: killed
                # after the rank, it may see the rank die and reset the GPU in between.
                for child in children:
                    os.kill(child, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
        timeout = LEFT_LOCKED_AFTER_S if kind == "group+watchdog" else 30.0
        results.append(until_default(gpu, began, timeout))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        gpu.reset_sm_clock()  # what `perseus reset` would do after a run that left it locked
        gpu.reset_power_limit()
    return results


def row(name: str, values: list[float], unit_scale: float = 1.0, width: int = 58) -> str:
    ordered = sorted(values)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return f"  {name:{width}} {statistics.median(values) * unit_scale:9.2f} {p99 * unit_scale:9.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instructions", type=int, default=20_000, help="instructions timed per path")
    parser.add_argument("--calls", type=int, default=300, help="clock changes timed per path")
    parser.add_argument("--kills", type=int, default=5, help="rank processes killed per case")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="pbench-") as root:
        sim_dir = os.path.join(root, "sim")
        agent = AgentProcess(
            os.path.join(root, "agent.sock"),
            os.path.join(root, "leases.json"),
            f"sim:{PRESET}:4",
            os.path.join(root, "agent.log"),
            env={"PERSEUS_SIM_DIR": sim_dir},
            args=("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
        ).start()
        try:
            return run(args, sim_dir, agent)
        finally:
            agent.stop()


def run(args: argparse.Namespace, sim_dir: str, agent: AgentProcess) -> int:
    direct: GPU = SimGPU(PRESET, 1, state_dir=sim_dir)
    (through,) = through_agent([SimGPU(PRESET, 2, state_dir=sim_dir)], agent.socket_path)
    controllers = {
        "direct": FrequencyController(direct, handle_signals=False, watchdog=False),
        "agent": FrequencyController(through, handle_signals=False, watchdog=False),
    }
    try:
        instruction_ns = per_instruction(controllers, args.instructions)

        def apply(controller: FrequencyController) -> Callable[[int], None]:
            def change(i: int) -> None:
                assert controller.apply_now(CLOCKS[i % 2], timeout=10.0), "a clock change was not applied in 10 s"

            return change

        calls = {
            "apply_now direct": apply(controllers["direct"]),
            "apply_now agent": apply(controllers["agent"]),
            "lock_sm_clock direct": lambda i: direct.lock_sm_clock(CLOCKS[i % 2]),
            "lock_sm_clock agent": lambda i: through.lock_sm_clock(CLOCKS[i % 2]),
            "set_power_limit_mw direct": lambda i: direct.set_power_limit_mw(250_000 + 1000 * (i % 2)),
            "set_power_limit_mw agent": lambda i: through.set_power_limit_mw(250_000 + 1000 * (i % 2)),
        }
        change_ns = timed_calls(calls, args.calls)
    finally:
        for controller in controllers.values():
            controller.close()
        direct.reset_power_limit()
        through.reset_power_limit()
        through.agent.close()

    gpu0 = SimGPU(PRESET, 0, state_dir=sim_dir)
    rank_env = {"PERSEUS_GPU": f"sim:{PRESET}:1", "PERSEUS_SIM_DIR": sim_dir}
    via_agent = {**rank_env, "PERSEUS_AGENT": agent.socket_path}
    direct_env = {**rank_env, "PERSEUS_AGENT": "off"}
    kills = {
        "agent: rank's process group SIGKILLed": kill_runs("group", via_agent, gpu0, args.kills),
        "direct + watchdog: rank's process group SIGKILLed": kill_runs("group", direct_env, gpu0, args.kills),
        "direct + watchdog: rank and watchdog SIGKILLed": kill_runs("group+watchdog", direct_env, gpu0, args.kills),
        f"agent: rank SIGSTOPped (heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s)": kill_runs(
            "stop", via_agent, gpu0, args.kills
        ),
    }

    width = 58
    print(f"Training-thread cost per instruction, new clock every instruction, {args.instructions} per path (us)")
    print(f"  {'':{width}} {'median':>9} {'p99':>9}")
    for name, samples in instruction_ns.items():
        print(row(f"controller.before_instruction, {name}", samples, 1e-3))
    inst = {name: statistics.median(s) / 1000 for name, s in instruction_ns.items()}
    print(f"  agent / direct: {inst['agent'] / inst['direct']:.2f}x (target: under {INSTRUCTION_TARGET_US:g} us)")
    print(f"\nClock and power-limit changes, end to end, {args.calls} per path (us)")
    print(f"  {'':{width}} {'median':>9} {'p99':>9}")
    for name, samples in change_ns.items():
        print(row(name, samples, 1e-3))
    med = {name: statistics.median(s) / 1000 for name, s in change_ns.items()}
    print(
        f"  agent / direct: apply_now {med['apply_now agent'] / med['apply_now direct']:.2f}x, lock_sm_clock "
        f"{med['lock_sm_clock agent'] / med['lock_sm_clock direct']:.2f}x, set_power_limit_mw "
        f"{med['set_power_limit_mw agent'] / med['set_power_limit_mw direct']:.2f}x"
    )
    print(f"\nAfter a kill: until the GPU is back at default clocks, {args.kills} runs each (ms)")
    print(f"  {'':{width}} {'median':>9} {'max':>9}")
    for name, results in kills.items():
        done = [r for r in results if r is not None]
        left = len(results) - len(done)
        if done:
            line = f"  {name:{width}} {statistics.median(done):9.1f} {max(done):9.1f}"
        else:
            line = f"  {name:{width}} {'never':>9} {'never':>9}"
        print(line + (f"  ({left} of {len(results)} left locked after {LEFT_LOCKED_AFTER_S:g} s)" if left else ""))
    agent_kill = [r for r in kills["agent: rank's process group SIGKILLed"] if r is not None]
    ok_instruction = inst["agent"] <= INSTRUCTION_TARGET_US
    ok_kill = len(agent_kill) == args.kills and statistics.median(agent_kill) <= RESET_TARGET_MS
    print(
        f"\nagent: {inst['agent']:.2f} us per instruction (target <= {INSTRUCTION_TARGET_US:g} us): "
        f"{'met' if ok_instruction else 'MISSED'}; GPU reset {statistics.median(agent_kill) if agent_kill else 0:.1f} "
        f"ms after a kill (target <= {RESET_TARGET_MS:g} ms): {'met' if ok_kill else 'MISSED'}"
    )
    return 0 if ok_instruction and ok_kill else 1


if __name__ == "__main__":
    sys.exit(main())
