"""`perseus reset` says what it did: each setting that really changed, `already at defaults` where
nothing did, and a setting it could not reset as a failure (each error once, exit status 1) --
directly, with a clock switch latency, and unprivileged; through an agent, see test_agent_cli."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
from agent_helpers import MAX_MHZ, PRESET, Child

import perseus.cli.reset  # noqa: F401 -- main() imports it lazily; the uid-dropped child cannot
from perseus.cli.main import main
from perseus.devices.reset import reset as reset_gpu
from perseus.devices.sim import SimGPU
from perseus.devices.sim_realism import SimRealism

NOBODY = 65534
NAME = "NVIDIA A100-SXM4-40GB (simulated)"


@pytest.fixture
def sims(node, monkeypatch):
    """Two simulated GPUs in the node's folder, changed directly (no agent)."""
    monkeypatch.setenv("PERSEUS_GPU", f"sim:{PRESET}:2")
    monkeypatch.setenv("PERSEUS_SIM_DIR", node.sim_dir)
    monkeypatch.setenv("PERSEUS_AGENT", "off")
    return node


def reset(capsys) -> tuple[int, list[str], str]:
    code = main(["reset"])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_only_what_changed_is_printed(sims, capsys):
    sims.gpu(1).lock_sm_clock(1005)
    code, lines, err = reset(capsys)
    assert (code, err) == (0, "")
    assert lines == [f"GPU 0 ({NAME}): already at defaults", f"GPU 1 ({NAME}): SM clock unlocked (1005 -> 1410 MHz)"]
    sims.gpu(0).set_power_limit_mw(250_000)
    code, lines, _ = reset(capsys)
    assert code == 0 and lines == [f"GPU 0 ({NAME}): power limit 250 -> 400 W", f"GPU 1 ({NAME}): already at defaults"]
    assert reset(capsys) == (0, [f"GPU {i} ({NAME}): already at defaults" for i in (0, 1)], "")


def test_a_clock_switch_latency_is_waited_out_before_reading(sims, capsys, monkeypatch):
    """Realistic simulated GPUs keep the old clock for a while after a change: the reset reads the
    clock once the default is in force, so the unlock is reported (not `already at defaults`)."""
    monkeypatch.setenv("PERSEUS_SIM_MODE", "realistic")
    monkeypatch.setenv("PERSEUS_SIM_SWITCH_LATENCY_S", "0.05")
    gpu = SimGPU(PRESET, 0, state_dir=sims.sim_dir, realism=SimRealism(switch_latency_s=0.05))
    gpu.lock_sm_clock(990)
    while gpu.sm_clock() != 990:  # in force once the latency has passed
        time.sleep(0.01)
    code, lines, _ = reset(capsys)
    assert code == 0 and lines[0] == f"GPU 0 ({NAME}): SM clock unlocked (990 -> 1410 MHz)"
    assert gpu.sm_clock() == MAX_MHZ


def reset_as_nobody(node) -> dict:
    """`perseus reset` in a child dropped to uid 65534 (forked: the interpreter's files are root's)."""

    def body(report) -> None:
        os.environ.update({"PERSEUS_GPU": f"sim:{PRESET}:2", "PERSEUS_SIM_DIR": node.sim_dir, "PERSEUS_AGENT": "off"})
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["reset"])
        report({"code": code, "out": out.getvalue(), "err": err.getvalue()})

    child = Child(body, uid=NOBODY)
    try:
        return child.next()
    finally:
        child.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="running reset as another user needs root")
def test_unprivileged_a_locked_gpu_is_a_failure_and_one_at_defaults_is_not(node):
    """The GPUs' folder is root's (privilege mode): nobody may read their settings, not change them."""
    node.gpu(0).lock_sm_clock(990)
    os.chmod(node.sim_dir, 0o755)
    failed = reset_as_nobody(node)
    assert failed["code"] == 1
    assert failed["out"].splitlines() == [
        f"GPU 0 ({NAME}): SM clock NOT reset",  # the power limit was at its default: nothing to say
        f"GPU 1 ({NAME}): already at defaults",
    ]
    assert failed["err"].count("perseus: error: GPU 0:") == 1
    assert f"only the owner of {node.sim_dir} (uid 0) may change this simulated GPU's clocks" in failed["err"]
    assert node.gpu(0).sm_clock() == 990
    node.gpu(0).reset_sm_clock()
    clean = reset_as_nobody(node)
    assert clean["code"] == 0, clean["err"]
    assert clean["out"].splitlines() == [f"GPU {i} ({NAME}): already at defaults" for i in (0, 1)]


def test_a_setting_that_fails_oddly_leaves_the_other_reset(node):
    """A driver's surprise (not a Perseus error) on the SM clock still lets the power limit reset."""
    gpu = node.gpu(0)
    gpu.set_power_limit_mw(250_000)

    def broken() -> None:
        raise RuntimeError("driver hiccup")

    gpu.reset_sm_clock = broken  # type: ignore[method-assign]
    outcome = reset_gpu(gpu)
    assert outcome.failed == ["SM clock"] and outcome.errors == ["RuntimeError: driver hiccup"]
    assert outcome.changes == ["power limit 250 -> 400 W"] and gpu.power_limit_mw() == 400_000
