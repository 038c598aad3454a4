"""The examples run as written (small sizes, simulated GPUs, no planner service).

A few seconds each: the torch example starts torchrun with 2 ranks (torch imported per rank).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from perseus.devices.sim import SimGPU

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env(tmp_path: Path, gpus: int) -> dict[str, str]:
    return {
        **os.environ,
        "PERSEUS_GPU": f"sim:a100-sxm:{gpus}",
        "PERSEUS_SIM_DIR": str(tmp_path / "sim"),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _at_default(tmp_path: Path, gpus: int) -> bool:
    return all(
        not os.path.exists(SimGPU("a100-sxm", i, state_dir=str(tmp_path / "sim")).state_path) for i in range(gpus)
    )


@pytest.mark.slow
def test_plain_loop_hooks_example(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "plain_loop_hooks.py"), "--steps", "3", "--width", "32"],
        env=_env(tmp_path, 1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("iteration ")]
    assert [line.split(":")[0] for line in lines] == ["iteration 0", "iteration 1", "iteration 2"]
    assert all(" J, loss " in line for line in lines)
    assert _at_default(tmp_path, 1)


@pytest.mark.slow
def test_pipeline_torch_example(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "pipeline_torch.py"),
            "--steps",
            "3",
            "--width",
            "32",
            "--microbatches",
            "4",
            "--no-planner",
        ],
        env=_env(tmp_path, 2),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("iteration ")]
    assert [line.split(":")[0] for line in lines] == ["iteration 0", "iteration 1"]
    assert all("on this GPU, loss " in line for line in lines)
    assert _at_default(tmp_path, 2)
