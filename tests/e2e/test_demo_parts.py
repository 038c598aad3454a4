"""The demo's parts in one process, on a virtual clock: workload table, GPU emulation, results."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from perseus.clock import VirtualClock
from perseus.demo.config import ModelConfig
from perseus.demo.emulation import EmulatedStage, GPUEmulator
from perseus.demo.launcher import DemoOptions
from perseus.demo.model import build_stage, lm_loss, make_batch
from perseus.demo.processes import stop_job, wait_for_job
from perseus.demo.report import format_report, plan_applied, predict_at_pace, summarize, summarize_straggler
from perseus.demo.results import Iteration, read_rank_record, read_verdicts, split_phases
from perseus.demo.watch import ServiceWatch
from perseus.demo.workload import DEFAULT_TIME_SCALE, GPT3_A100_STAGES, default_time_scale, stage_works
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import predict
from perseus.exceptions import ConfigError, PerseusError
from perseus.schedules.instruction import Kind
from perseus.wire.calibration import CalibrationStatus, StageFitStatus
from perseus.wire.messages import JobStatus, PipelineStatus, Status


def test_stage_works_merge_the_measured_stages_and_keep_the_last_heaviest():
    works = stage_works(4, time_scale=1.0)
    fwd = [w[Kind.FORWARD].time_s for w in works]
    bwd = [w[Kind.BACKWARD].time_s for w in works]
    assert fwd[0] == pytest.approx(2 * GPT3_A100_STAGES[0][0])
    assert fwd[3] == pytest.approx(GPT3_A100_STAGES[6][0] + GPT3_A100_STAGES[7][0])
    assert fwd[3] > fwd[0] and bwd[3] > bwd[0]
    assert sum(fwd) == pytest.approx(sum(s[0] for s in GPT3_A100_STAGES))
    # 1F1B, 4 stages x 8 microbatches: about 1.5 s at the default scale.
    scaled = stage_works(4)
    critical = (8 + 3) * (scaled[3][Kind.FORWARD].time_s + scaled[3][Kind.BACKWARD].time_s)
    assert 1.3 < critical < 1.7
    with pytest.raises(ConfigError, match="1 to 8 pipeline stages"):
        stage_works(9)
    with pytest.raises(ConfigError, match="time scale"):
        stage_works(2, time_scale=0)


def test_emulated_stage_runs_each_instruction_on_the_simulated_gpu(tmp_path):
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", 0, clock=clock, state_dir=str(tmp_path))
    works = stage_works(2, time_scale=0.1)[0]
    config = ModelConfig()
    emulator = GPUEmulator(gpu, works)
    stage = EmulatedStage(build_stage(config, 0, 2, seed=0), emulator)
    tokens, _ = make_batch(config, 2, seed=0)

    gpu.lock_sm_clock(1050)
    e0 = gpu.energy_mj()
    out = stage(tokens)
    e1 = gpu.energy_mj()
    out.sum().backward()
    e2 = gpu.energy_mj()
    spans = emulator.take_spans()

    t_fwd, e_fwd = predict("a100-sxm", works[Kind.FORWARD], 1050)
    t_bwd, e_bwd = predict("a100-sxm", works[Kind.BACKWARD], 1050)
    assert [(s.kind, s.microbatch, s.frequency) for s in spans] == [("forward", 0, 1050), ("backward", 0, 1050)]
    assert spans[0].end - spans[0].start == pytest.approx(t_fwd)
    assert spans[1].end - spans[1].start == pytest.approx(t_bwd)
    assert (e1 - e0) / 1000 == pytest.approx(e_fwd)  # the counter around the instruction sees the work
    assert (e2 - e1) / 1000 == pytest.approx(e_bwd)
    assert emulator.take_spans() == []


def test_emulator_refuses_a_real_gpu():
    class NotSim:
        pass

    with pytest.raises(ConfigError, match="PERSEUS_GPU=sim"):
        GPUEmulator(NotSim(), {})  # type: ignore[arg-type]


def test_last_stage_loss_trains():
    config = ModelConfig()
    first, last = build_stage(config, 0, 2, seed=1), build_stage(config, 1, 2, seed=1)
    tokens, targets = make_batch(config, 4, seed=1)
    optimizer = torch.optim.SGD([*first.parameters(), *last.parameters()], lr=0.1)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = lm_loss(last(first(tokens)), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _it(index, phases, time_s, energy_j, freqs=(), plans=()):
    spans = tuple(
        tuple({"kind": "forward", "microbatch": i, "start": 0.0, "end": 0.1, "frequency": f} for i, f in enumerate(row))
        for row in freqs
    )
    return Iteration(index, tuple(phases), time_s, energy_j, spans, 0.0, tuple(plans))


def test_phases_drop_warmup_and_switch_iterations_and_summarize():
    plan = [[1410, 1200], [1000, 1410]]
    status = JobStatus(
        job_id="job-0123456789abcdef",
        phase="planned",
        world_size=2,
        ranks_registered=2,
        profiled_stages=(0, 1),
        plan_version=1,
        last_iteration=8,
        predicted_iteration_time_s=1.0,
        predicted_energy_j=90.0,
        predicted_baseline_energy_j=100.0,
    )
    its = [
        _it(0, ["baseline"] * 2, 2.0, 500.0),  # warms up: dropped
        _it(1, ["baseline"] * 2, 1.0, 100.0),
        _it(2, ["baseline"] * 2, 1.0, 102.0),
        _it(3, ["warmup"] * 2, 1.0, 101.0),
        _it(4, ["profiling", "planning"], 1.2, 95.0),
        _it(5, ["planning"] * 2, 1.0, 100.0),
        _it(6, ["planned"] * 2, 1.0, 95.0, plan, plan),  # the switch: dropped
        _it(7, ["planned"] * 2, 1.01, 91.0, plan, plan),
        _it(8, ["planned"] * 2, 1.01, 93.0, [[1410, 1410], [1000, 1410]], plan),
    ]
    phases = split_phases(its)
    assert [i.index for i in phases["baseline"]] == [1, 2]
    assert [i.index for i in phases["profiling"]] == [4]
    assert [i.index for i in phases["planned"]] == [7, 8]
    result = summarize(its, status)
    assert result["baseline"] == {"iterations": 2, "iteration_time_s": 1.0, "energy_j": 101.0}
    assert result["planned"]["energy_j"] == pytest.approx(92.0)
    assert result["measured_saving"] == pytest.approx(1 - 92 / 101)
    assert result["predicted_saving"] == pytest.approx(0.1)
    assert result["iteration_time_change"] == pytest.approx(0.01)
    assert result["plan_applied"] == pytest.approx(7 / 8)
    assert result["plan_frequencies"] == plan
    assert plan_applied([]) is None
    assert summarize(its, None)["predicted_saving"] is None


def test_options_are_checked():
    with pytest.raises(ConfigError, match="--microbatches"):
        DemoOptions(ranks=4, microbatches=2)
    with pytest.raises(ConfigError, match="--ranks"):
        DemoOptions(ranks=1)
    with pytest.raises(ConfigError, match="--port"):
        DemoOptions(port=70000)
    with pytest.raises(ConfigError, match="--straggler"):
        DemoOptions(straggler=1.2)  # one pipeline
    with pytest.raises(ConfigError, match="--dp"):
        DemoOptions(ranks=4, dp=3)


def _dp_it(index, phases, versions, windows):
    """Two pipelines x 2 stages: ranks 0, 1 (pipeline 0) and 2, 3 (the straggler)."""
    spans = tuple(
        ({"kind": "backward", "microbatch": 0, "start": 0.0, "end": t, "frequency": 1410},) for t, _ in windows
    )
    return Iteration(
        index,
        tuple(phases),
        max(t for t, _ in windows),
        sum(e for _, e in windows),
        spans,
        0.0,
        (None,) * 4,
        tuple(versions),
        tuple(windows),
    )


def test_straggler_phases_split_intrinsic_from_straggler_aware_and_predict_at_its_pace():
    base, slow = [(1.0, 100.0)] * 2, [(1.2, 120.0)] * 2
    its = [
        _dp_it(0, ["baseline"] * 4, [None] * 4, base + slow),
        _dp_it(1, ["baseline"] * 4, [None] * 4, base + slow),
        _dp_it(2, ["planned"] * 4, [1] * 4, [(1.0, 98.0)] * 2 + slow),  # the switch: dropped
        _dp_it(3, ["planned"] * 4, [1] * 4, [(1.0, 98.0)] * 2 + slow),
        _dp_it(4, ["planned"] * 4, [2, 1, 1, 1], [(1.1, 90.0)] * 2 + slow),  # mixed: neither
        _dp_it(5, ["planned"] * 4, [2, 2, 1, 1], [(1.2, 80.0)] * 2 + slow),  # the switch: dropped
        _dp_it(6, ["planned"] * 4, [2, 2, 1, 1], [(1.2, 80.0)] * 2 + slow),
    ]
    phases = split_phases(its, straggler_ranks=[2, 3])
    assert [i.index for i in phases["intrinsic"]] == [3]
    assert [i.index for i in phases["planned"]] == [6]
    assert its[6].of_ranks([0, 1]).energy_j == 160.0 and its[6].of_ranks([2, 3]).time_s == 1.2
    # Plans of 1 s (max clocks 600 J) at 2 stages, blocking 50 W: at the straggler's 1.2 s pace
    # the baseline costs 600 + 2 x 50 x 0.2 = 620 J, the intrinsic plan 580 + 20, the paced plan 500.
    record = {
        "blocking_power_w": 50.0,
        "plans": {
            "0": {
                "energy_j": 500.0,
                "iteration_time_s": 1.2,
                "deadline_s": 1.2,
                "baseline_energy_j": 600.0,
                "baseline_iteration_time_s": 1.0,
            },
            "1": {
                "energy_j": 580.0,
                "iteration_time_s": 1.0,
                "deadline_s": None,
                "baseline_energy_j": 600.0,
                "baseline_iteration_time_s": 1.0,
            },
        },
    }
    # The service's fit and verdicts come with the straggler's report too.
    status = _job(
        _pipeline(2, "holds", verified_iteration_time_s=1.2), dataclasses.replace(_pipeline(1, "holds"), pipeline=1)
    )
    result = summarize_straggler(its, status, stages=2, dp=2, slowdown=1.2, record=record)
    assert [p["pipeline"] for p in result["verification"]] == [0, 1] and result["calibration"] == [FITTED.to_wire()]
    assert "the service's measurements (perseus status, means, every pipeline)" in format_report(
        {**result, "clocks_reset": True, "wall_time_s": 1.0}
    )
    predicted = predict_at_pace(record, stages=2, slow=1)
    assert predicted[0]["predicted_intrinsic_saving"] == pytest.approx(1 - 600 / 620)
    assert predicted[0]["predicted_saving"] == pytest.approx(1 - 500 / 620)
    assert predicted[1]["predicted_saving"] == pytest.approx(1 - 580 / 600)
    assert predict_at_pace(None, 2, 1) == {}


def _versions_it(index, versions):
    """One pipeline of 2 stages, planned at plan version `versions` per rank."""
    return Iteration(index, ("planned",) * 2, 1.0, 100.0, ((), ()), 0.0, (None, None), tuple(versions))


def test_the_planned_phase_is_the_plan_the_job_ran_last():
    # Verification replaced plan v1 by v2: v2's iterations after its switch are what the job runs.
    its = [_versions_it(i, v) for i, v in enumerate([(1, 1), (1, 1), (1, 1), (2, 2), (2, 2), (2, 2)])]
    assert [i.index for i in split_phases(its)["planned"]] == [4, 5]


FITTED = CalibrationStatus(
    models="NVIDIA A100-SXM4-40GB (simulated)",
    state="fitted",
    iterations=8,
    measured_s=1.5,
    model_s=1.503,
    gpu_only_s=1.45,
    explained=0.967,
    host_gap_s=0.0004,
    hop_s=0.0007,
    stages=(StageFitStatus(0, 1.4, 1.3986, 1.2, 0.0004), StageFitStatus(1, 1.42, 1.42, 1.3, 0.0005)),
    tolerance=0.01,
)


def _pipeline(version: int, verification: str, **more) -> PipelineStatus:
    return PipelineStatus(
        pipeline=0,
        plan_version=version,
        deadline_s=None,
        predicted_iteration_time_s=1.5,
        measured_iteration_time_s=1.51,
        baseline_iteration_time_s=1.4,
        target_iteration_time_s=1.4,
        verification=verification,
        **more,
    )


def _job(*pipelines: PipelineStatus, calibrations=(FITTED,)) -> JobStatus:
    return JobStatus(
        job_id="job-0123456789abcdef",
        phase="planned",
        world_size=2,
        ranks_registered=2,
        profiled_stages=(0, 1),
        plan_version=max((p.plan_version for p in pipelines), default=0),
        last_iteration=40,
        predicted_iteration_time_s=1.503,
        predicted_energy_j=90.0,
        predicted_baseline_energy_j=100.0,
        baseline_iterations=8,
        baseline_iteration_time_s=1.51,
        baseline_energy_j=101.0,
        planned_iterations=14,
        planned_iteration_time_s=1.52,
        planned_energy_j=92.0,
        pipelines=pipelines,
        calibrations=calibrations,
    )


class _Service:
    """Answers `status` with the job statuses given, one per call (the last one again)."""

    def __init__(self, *jobs: JobStatus) -> None:
        self.jobs = list(jobs)

    def status(self, job_id):
        job = self.jobs.pop(0) if len(self.jobs) > 1 else self.jobs[0]
        return Status((job,))

    def close(self) -> None:
        pass


def test_the_watch_says_what_the_service_decided_and_tells_the_ranks_which_plan_is_verified(tmp_path):
    said: list[str] = []
    watch = ServiceWatch("tcp://127.0.0.1:1", str(tmp_path), said.append)
    watch.client.close()
    watch.client = _Service(  # type: ignore[assignment]
        _job(calibrations=(CalibrationStatus(models=FITTED.models, state="collecting"),)),
        _job(_pipeline(1, "verifying")),
        _job(_pipeline(1, "verifying")),
        _job(_pipeline(1, "replanning", replans=1, reason="plan v1 runs +3.0% over its target; re-planning (1 of 3)")),
        _job(_pipeline(2, "holds", verified_iteration_time_s=1.407, replans=1)),
    )
    seen = []
    for _ in range(5):
        watch.fetch("job-0123456789abcdef")
        seen.append(read_verdicts(str(tmp_path)))
    # The ranks learn of a plan version only once verification decided on it (held here).
    assert seen == [{}, {}, {}, {}, {0: 2}]
    assert said[0] == "service: model collecting"
    assert said[1].startswith("service: model fitted on 8 baseline iterations: model 1.5030 s vs measured 1.5000 s")
    # Each change said once: the repeated "verifying" status says nothing new.
    assert said[2:] == [
        "service: pipeline 0, plan v1: verifying, target 1.4000 s",
        "service: pipeline 0, plan v1: replanning, target 1.4000 s; 1 re-plan(s): plan v1 runs +3.0% over its "
        "target; re-planning (1 of 3)",
        "service: pipeline 0, plan v2: holds, 1.4070 s measured against a 1.4000 s target (+0.5%; compute time, "
        "median of a window); 1 re-plan(s)",
    ]
    assert watch.status.pipelines[0].verification == "holds"


def test_the_report_shows_the_calibrated_fit_and_the_verdict_not_hand_measured_overheads():
    plan = [[1410, 1200], [1000, 1410]]
    its = [
        _it(0, ["baseline"] * 2, 2.0, 500.0),
        _it(1, ["baseline"] * 2, 1.5, 101.0),
        _it(2, ["planned"] * 2, 1.5, 95.0, plan, plan),
        _it(3, ["planned"] * 2, 1.51, 92.0, plan, plan),
    ]
    status = _job(_pipeline(1, "holds", verified_iteration_time_s=1.407))
    result = summarize(its, status)
    assert result["calibration"] == [FITTED.to_wire()]
    assert [p["verification"] for p in result["verification"]] == ["holds"]
    assert result["service"]["measured_saving"] == pytest.approx(1 - 92 / 101)
    assert not {"hop_latency_s", "instruction_gap_s", "model_time_gap", "gloo_latency_s"} & set(result)
    report = format_report({**result, "clocks_reset": True, "wall_time_s": 100.0})
    assert (
        "calibration (NVIDIA A100-SXM4-40GB (simulated)): model fitted on 8 baseline iterations: model 1.5030 s vs "
        "measured 1.5000 s (+0.20%, tolerance 1.0%); GPU profile alone 1.4500 s (97% explained); "
        "host gap 0.40 ms, hop 0.70 ms"
    ) in report
    assert (
        "  per stage, model/measured instruction window: 0: 1.3986/1.4000 s (-0.10%); 1: 1.4200/1.4200 s (+0.00%)"
        in (report)
    )
    assert "verification: pipeline 0, plan v1: holds, 1.4070 s measured against a 1.4000 s target (+0.5%" in report
    assert (
        "the service's measurements (perseus status, means): baseline 1.510 s 101.0 J (8 iterations), plan 1.520 s "
        "92.0 J (14 iterations), saving 8.9%"
    ) in report
    assert "pipeline hop" not in report and "host gap between instructions" not in report
    withheld = dataclasses.replace(status, saving_withheld="every pipeline fell back to maximum clocks (why)")
    report = format_report({**summarize(its, withheld), "clocks_reset": True, "wall_time_s": 100.0})
    assert "(14 iterations), no saving claimed: every pipeline fell back to maximum clocks (why)" in report


def test_default_time_scale_keeps_the_default_iteration_time_for_any_shape():
    assert default_time_scale(4, 8) == pytest.approx(DEFAULT_TIME_SCALE)
    for stages, microbatches in ((2, 8), (8, 16)):
        works = stage_works(stages, default_time_scale(stages, microbatches))
        slowest = max(w[Kind.FORWARD].time_s + w[Kind.BACKWARD].time_s for w in works)
        assert 1.35 < (microbatches + stages - 1) * slowest < 1.65


def test_rank_records_read_as_none_until_written(tmp_path):
    assert read_rank_record(str(tmp_path), 0) is None
    record = tmp_path / "rank0.jsonl"
    record.write_text('{"rank": 0, "job_id": null}\n{"iteration": 0')  # the iteration is being written
    assert read_rank_record(str(tmp_path), 0) == {"rank": 0, "job_id": None, "iterations": []}
    record.write_text(
        '{"rank": 0, "job_id": null}\n{"iteration": 0}\n{"rank": 0, "job_id": "job-1"}\n{"iteration": 1}\n'
    )
    assert read_rank_record(str(tmp_path), 0) == {
        "rank": 0,
        "job_id": "job-1",  # the later details line
        "iterations": [{"iteration": 0}, {"iteration": 1}],
    }
    record.write_text('{"rank": 0}\n{"iter\n{"iteration": 1}\n')  # not JSON
    assert read_rank_record(str(tmp_path), 0) is None


def test_waiting_on_a_job_returns_the_value_or_fails_with_what_and_its_log(tmp_path):
    log = tmp_path / "torchrun.log"
    log.write_text("rank 1 crashed\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert wait_for_job(proc, lambda: 7, "seven", 1.0, str(log)) == 7
        with pytest.raises(PerseusError, match="ran 0.1 s without the plan; its log:\nrank 1 crashed"):
            wait_for_job(proc, lambda: None, "the plan", 0.1, str(log))
    finally:
        stop_job(proc)
    assert proc.returncode == -signal.SIGTERM
    with pytest.raises(PerseusError, match=r"exited \(-15\) before the plan"):
        wait_for_job(proc, lambda: None, "the plan", 5.0, str(log))
    stop_job(proc)  # no-op once it ended


def test_the_command_line_and_the_demo_launcher_start_without_torch():
    # `perseus serve` must start fast, and `perseus demo` leaves torch to its ranks.
    code = (
        "import sys, perseus, perseus.demo.launcher; from perseus.cli.main import build_parser; build_parser(); "
        "print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
