"""What the agent tests share: a node's folder, agents in this process, waiting for a condition."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from perseus.agent.daemon import Agent, AgentConfig
from perseus.agent.process import AgentProcess
from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU

PRESET = "a100-sxm"
GPUS = 2
MAX_MHZ = 1410
DEFAULT_LIMIT_MW = 400_000


class Node:
    """One node's folder: simulated GPU state, the agent's socket, lease file and log."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.sim_dir = os.path.join(root, "sim")
        self.socket = os.path.join(root, "agent.sock")
        self.leases = os.path.join(root, "leases.json")
        self.log = os.path.join(root, "agent.log")

    def gpu(self, index: int) -> SimGPU:
        """A direct view of simulated GPU `index` (what the hardware says)."""
        return SimGPU(PRESET, index, state_dir=self.sim_dir)

    def sim_gpus(self, count: int = GPUS) -> list[SimGPU]:
        return [self.gpu(i) for i in range(count)]

    def process(self, *args: str, count: int = GPUS) -> AgentProcess:
        return AgentProcess(
            self.socket,
            self.leases,
            f"sim:{PRESET}:{count}",
            self.log,
            env={"PERSEUS_SIM_DIR": self.sim_dir},
            args=args,
        )

    def log_text(self) -> str:
        try:
            with open(self.log, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return ""


def make_root() -> str:
    # Short (a socket path holds 107 bytes) and traversable by other users (tests drop to uid 65534).
    root = tempfile.mkdtemp(prefix="pagent-", dir="/tmp")
    os.chmod(root, 0o755)
    return root


class ThreadAgent:
    """An Agent serving in a thread of this process; `stop()` ends it (and resets what is leased)."""

    def __init__(self, node: Node, timeout_s: float = 5.0, gpus: list[GPU] | None = None, **config) -> None:
        self.node = node
        gpus = node.sim_gpus() if gpus is None else gpus
        config.setdefault("claims_dir", node.root)  # real (fake NVML) GPUs: claimed in the node's folder
        self.agent = Agent(gpus, AgentConfig(node.socket, node.leases, timeout_s=timeout_s, **config))
        self.agent.start()
        self._thread = threading.Thread(target=self.agent.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.agent.stop()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the agent did not stop"


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """Poll `predicate` until it returns something truthy (returned); AssertionError naming `what`
    after `timeout_s` (generous: the condition's own time is what benchmarks measure)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.01)


def at_defaults(gpu: SimGPU) -> bool:
    return gpu.sm_clock() == MAX_MHZ and gpu.power_limit_mw() == DEFAULT_LIMIT_MW


class Child:
    """A forked process running `body(report)` in its own process group, as `uid`/`gid` if given
    (after setgroups(`groups`)): a rank without privileges. `report(doc)` sends a JSON line to
    the test, `next()` reads it. Only modules imported before the fork can be used after the
    uid drop (the interpreter's files may be unreadable to that user)."""

    def __init__(
        self,
        body: Callable[[Callable[[dict], None]], None],
        *,
        uid: int | None = None,
        gid: int | None = None,
        groups: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            os.close(read)
            code = 0
            try:
                os.setpgid(0, 0)
                os.environ.update(env or {})
                if uid is not None:
                    os.setgroups(list(groups))
                    os.setgid(uid if gid is None else gid)
                    os.setuid(uid)
                body(lambda doc: os.write(write, (json.dumps(doc) + "\n").encode()))
            except BaseException:
                os.write(write, (json.dumps({"error": traceback.format_exc()}) + "\n").encode())
                code = 1
            finally:
                os._exit(code)
        os.close(write)
        self.pid = pid
        self._reader = os.fdopen(read)
        self.status: int | None = None

    def next(self, timeout_s: float = 60.0) -> dict:
        """The child's next report; AssertionError if it reported an error or said nothing in time."""
        ready, _, _ = select.select([self._reader], [], [], timeout_s)
        assert ready, f"child {self.pid} reported nothing in {timeout_s:g} s"
        line = self._reader.readline()
        assert line, f"child {self.pid} exited without a report"
        doc = json.loads(line)
        assert "error" not in doc, f"child {self.pid}: {doc['error']}"
        return doc

    def kill_group(self) -> None:
        os.killpg(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.status is None:
            _, status = os.waitpid(self.pid, 0)
            self.status = status
        return self.status

    def close(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait()
        self._reader.close()


def sleep_forever() -> None:
    while True:
        time.sleep(3600)
