"""When the demo's torchrun job fails, the error names the rank that failed first and what it
raised, read from a real torchrun log (the rest of the log follows it)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from perseus.demo.launcher import first_rank_error

FAILING = textwrap.dedent(
    """
    import torch.distributed as dist
    from perseus.exceptions import ConfigError

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ConfigError("perseus.instrument supports torch 2.6 to 2.15, found 2.16.0")
    dist.barrier()  # rank 0 fails here once rank 1 is gone: a consequence, not the cause
    """
)


@pytest.mark.slow
def test_the_root_cause_rank_and_its_exception_come_first(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    log = run.stdout + run.stderr
    expected = "perseus.exceptions.ConfigError: perseus.instrument supports torch 2.6 to 2.15, found 2.16.0"
    assert first_rank_error(log) == f"rank 1: {expected}"
    # Releases that do not prefix ranks' lines: the first traceback's exception, rank unknown.
    unprefixed = re.sub(r"^\[rank\d+\]: ?", "", log, flags=re.M)
    assert first_rank_error(unprefixed) in (expected, f"rank 1: {expected}")


def test_no_traceback_no_error():
    assert first_rank_error("W1201 worker exited\nE1201 failed (exitcode: -9) local_rank: 0") is None
