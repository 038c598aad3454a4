"""Work that keeps a GPU busy while a probe watches its power reading rise and its clocks change.

Probing only reads the GPU's settings; a load changes none of them. A simulated GPU runs queued
`Work`; a real one (NVIDIA, or AMD through ROCm's torch) multiplies matrices in a thread through
torch, when torch can reach it. Without torch, the probe skips what needs a load.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work

logger = logging.getLogger(__name__)


class Load(Protocol):
    #: Whether the GPU needs this load to hold a locked clock (a real idle GPU may park lower).
    holds_clocks: bool

    def start(self, seconds: float) -> float:
        """Start keeping the GPU busy for at least `seconds`; returns when it began (GPU clock)."""

    def stop(self) -> None:
        """Stop, and wait until the GPU is idle again."""


class SimLoad:
    """Queues `seconds` of full-clock work on a simulated GPU (it runs longer at lower clocks)."""

    holds_clocks = False  # a simulated GPU reads its clock in force, busy or not

    def __init__(self, gpu: SimGPU) -> None:
        self.gpu = gpu

    def start(self, seconds: float) -> float:
        began = self.gpu.clock.now()
        self.gpu.execute(Work(seconds), blocking=False)
        return began

    def stop(self) -> None:
        self.gpu.synchronize()


class TorchLoad:
    """Matrix multiplications on a real GPU through torch, in a thread, until `stop`."""

    holds_clocks = True

    def __init__(self, gpu: GPU, torch_module: object) -> None:
        self.gpu = gpu
        self._torch = torch_module
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, seconds: float) -> float:
        self._stop.clear()
        began = self.gpu.clock.now()
        self._thread = threading.Thread(target=self._run, name="perseus-probe-load", daemon=True)
        self._thread.start()
        return began

    def _run(self) -> None:
        torch = self._torch
        device = f"cuda:{self.gpu.index}"
        try:
            a = torch.randn(4096, 4096, device=device)  # type: ignore[attr-defined]
            while not self._stop.is_set():
                a = torch.tanh(a @ a)  # type: ignore[attr-defined]
                torch.cuda.synchronize(device)  # type: ignore[attr-defined]
        except Exception:  # the probe then reads no rise and reports no power window
            logger.exception("the probe's load on %r failed", self.gpu)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def load_for(gpu: GPU) -> Load | None:
    """A load for `gpu`, or None (logged) where none can run on it."""
    if isinstance(gpu, SimGPU):
        return SimLoad(gpu)
    try:
        import torch
    except ImportError:
        logger.warning("torch is not installed: the probe cannot load %r, so it skips the power window", gpu)
        return None
    try:
        usable = torch.cuda.is_available() and gpu.index < torch.cuda.device_count()
    except Exception as e:  # a broken driver or runtime: nothing to run on
        logger.warning("torch cannot reach %r (%s): the probe skips the power window", gpu, e)
        return None
    if not usable:
        logger.warning("torch sees no GPU %d: the probe skips the power window", gpu.index)
        return None
    return TorchLoad(gpu, torch)
