"""Stragglers through a real `perseus serve` process and the real planner: a declared straggler
(`perseus straggler`) and a detected one re-plan the other pipeline at the straggler's pace,
every rank of that pipeline switches at one iteration, and recovery restores the no-slowdown
plan. About 5 s: the service imports the planner and solves three plans."""

from __future__ import annotations

import time

import pytest
from server_helpers import job_spec, rank_info, stage_profile, wait_until

from perseus.cli.main import main
from perseus.client.planner_client import PlannerClient
from perseus.exceptions import ServiceError
from perseus.wire.phases import Phase


class Ranks:
    """Four ranks' clients stepping through iterations together (ranks 0, 1: pipeline 0)."""

    def __init__(self, clients: list[PlannerClient]) -> None:
        self.clients = clients
        self.iteration = 0

    def step(self) -> list:
        self.iteration += 1
        return [c.assignment(self.iteration) for c in self.clients]

    def until_version(self, ranks: list[int], version: int) -> list:
        return wait_until(lambda: (a := self.step()) and all(a[r].plan_version == version for r in ranks) and a)

    def report(self, iterations: int, slow: float, job_id: str, times: dict[int, float]) -> None:
        """Iterations in which pipeline 1 takes `slow` x its plan's time and pipeline 0 the time
        its plan in force predicts (`times`: plan version -> predicted time)."""
        for _ in range(iterations):
            plans = self.step()
            for r, c in enumerate(self.clients):
                time_s = times[plans[r].plan_version] * (slow if r >= 2 else 1.0)
                c.report_iteration(job_id, r, self.iteration, time_s, 30.0)
            time.sleep(0.05)  # ranks poll every 0.05 s: new plans arrive before they start
        assert all(c.flush(5.0) for c in self.clients)


def planned(endpoint: str) -> tuple[Ranks, str]:
    """A job of two pipelines of two stages on the service at `endpoint`, each rank at plan v1."""
    spec = job_spec(world_size=4, dp=2, rank_mapping="torch")  # ranks 0, 1: pipeline 0; 2, 3: pipeline 1
    clients = [PlannerClient(endpoint, timeout_s=2.0, poll_interval_s=0.05) for _ in range(4)]
    ranks = Ranks(clients)
    job_id = clients[0].register_job(spec)
    for r, c in enumerate(clients):
        c.register_rank(job_id, rank_info(r, stage=r % 2, dp_index=r // 2))
    for s in (0, 1):
        clients[s].upload_profile(job_id, s, stage_profile(s))
    assert all(c.wait_for_plan(20.0) for c in clients)
    return ranks, job_id


def test_declared_and_detected_stragglers_replan_the_other_pipeline(serve, capsys):
    served = serve()
    ep = served.endpoint
    ranks, job_id = planned(ep)
    clients = ranks.clients
    try:
        base = ranks.until_version([0, 1, 2, 3], 1)
        assert base[0].frequencies == base[2].frequencies and base[0].phase == Phase.PLANNED
        base_time = clients[0].status(job_id).jobs[0].pipelines[0].predicted_iteration_time_s

        # An operator declares pipeline 1 20% slow.
        assert main(["straggler", "--job", job_id, "--pipeline", "1", "--factor", "1.2", "--address", ep]) == 0
        out = capsys.readouterr().out
        assert f"job {job_id}: pipeline 1 declared 1.2x" in out
        assert f"{1.2 * base_time:.4f}" in out  # the command waited for the re-plan it caused
        slowed = ranks.until_version([0, 1], 2)
        assert slowed[2] is base[2] and slowed[3] is base[3]  # the straggler keeps its plan
        assert sum(slowed[0].frequencies) + sum(slowed[1].frequencies) < sum(base[0].frequencies) + sum(
            base[1].frequencies
        )
        job = clients[0].status(job_id).jobs[0]
        slowed_time = job.pipelines[0].predicted_iteration_time_s
        assert job.pipelines[0].deadline_s == pytest.approx(1.2 * base_time, rel=1e-5)
        assert job.pipelines[0].predicted_iteration_time_s <= 1.2 * base_time * (1 + 1e-5)
        assert (job.pipelines[1].straggler, job.pipelines[1].straggler_factor, job.pipelines[1].deadline_s) == (
            "declared",
            1.2,
            None,
        )
        # The straggler runs its no-slowdown plan at its pace: that is its predicted time.
        assert job.pipelines[1].predicted_iteration_time_s == pytest.approx(1.2 * base_time, rel=1e-5)
        assert main(["straggler", "--job", job_id, "--address", ep]) == 0
        table = capsys.readouterr().out
        assert "declared 1.200x" in table and f"{1.2 * base_time:.4f}" in table
        assert clients[0].declare_straggler(job_id, 0, 1.1)  # shadowed by pipeline 1's 1.2x: said so
        assert "the slowest, pipeline 1 (1.200x, declared), sets the others' pace" in served.log()
        assert clients[0].declare_straggler(job_id, 0, None)

        assert main(["straggler", "--job", job_id, "--pipeline", "1", "--clear", "--address", ep]) == 0
        assert ranks.until_version([0, 1], 3)[0].frequencies == base[0].frequencies
        assert "planning" not in served.log().split("pipeline 1 no longer declared")[1]  # the base plan was kept

        # Detected: ranks report pipeline 1 persistently 20% over its plan's time.
        times = {1: base_time, 3: base_time, 4: slowed_time, 5: base_time}
        ranks.report(12, 1.2, job_id, times)
        job = wait_until(lambda: [j for j in clients[0].status(job_id).jobs if j.plan_version == 4])[0]
        assert job.pipelines[1].straggler == "detected" and job.pipelines[1].straggler_factor == pytest.approx(
            1.2, rel=0.01
        )
        # Both ranks of pipeline 0 switched at one iteration, running the old plan until then
        # (not max clocks); the same pace as declared gives the same plan.
        switched = [
            min(i for i in range(ranks.iteration + 1) if c.assignment(i).plan_version == 4) for c in clients[:2]
        ]
        assert switched[0] == switched[1] and clients[0].assignment(switched[0] - 1).plan_version == 3
        assert clients[0].assignment(ranks.iteration).frequencies == slowed[0].frequencies

        ranks.report(12, 1.0, job_id, times)  # pipeline 1 recovered
        assert ranks.until_version([0, 1], 5)[0].frequencies == base[0].frequencies
        assert "pipeline 1 recovered" in served.log()

        with pytest.raises(ServiceError, match="dp=2"):
            clients[0].declare_straggler(job_id, 2, 1.2)
    finally:
        for c in clients:
            c.close()


def test_a_declaration_its_iterations_contradict_gets_no_plan_and_the_reply_says_so(serve, capsys):
    """Pipeline 1 runs as fast as pipeline 0, and is declared 1.5x slow: its measured iterations
    contradict that at once, so no plan is solved for the declared pace (an outsider's reply
    showed one as in force, withdrawn at the next iteration) and the reply says why."""
    served = serve()
    ranks, job_id = planned(served.endpoint)
    try:
        ranks.until_version([0, 1, 2, 3], 1)
        base_time = ranks.clients[0].status(job_id).jobs[0].pipelines[0].predicted_iteration_time_s
        ranks.report(8, 1.0, job_id, {1: base_time})
        declare = ["straggler", "--job", job_id, "--pipeline", "1", "--factor", "1.5", "--address", served.endpoint]
        assert main(declare) == 0
        out = capsys.readouterr().out
        assert "nothing to re-plan: no straggler sets a pace, and the plans in force already run the clocks" in out
        assert "pipeline 1: declared 1.500x, contradicted by measurement: its iterations measure 1.0" in out
        assert "the measured factor sets the pace: none, it is no straggler" in out and "--factor 1.00" in out
        assert f"{1.5 * base_time:.4f}" not in out and "no plan published" not in out
        assert "deadline" not in served.log().split("pipeline 1 declared 1.500x, contradicted")[1]  # none solved
        job = ranks.clients[0].status(job_id).jobs[0]
        assert job.plan_version == 1 and [p.straggler for p in job.pipelines] == ["", ""]
    finally:
        for c in ranks.clients:
            c.close()


def test_a_clear_that_changes_no_plan_says_so_at_once(serve, capsys):
    """Nothing is declared: --clear changes no plan, and says so (and why) without waiting for a
    re-plan that never comes (it used to wait 5 s and say no plan was published)."""
    served = serve()
    ranks, job_id = planned(served.endpoint)
    try:
        ranks.until_version([0, 1, 2, 3], 1)
        assert main(["straggler", "--job", job_id, "--pipeline", "1", "--clear", "--address", served.endpoint]) == 0
        out = capsys.readouterr().out
        held = "nothing to re-plan: pipeline 1 held no declaration that set the pace; "
        assert f"job {job_id}: pipeline 1 cleared\n{held}" in out
        assert "no straggler sets a pace, and the plans in force already run the clocks for it" in out
        assert "no plan published" not in out and "v1" in out
    finally:
        for c in ranks.clients:
            c.close()


def test_straggler_and_serve_flag_errors_name_the_flag_or_the_service(tmp_path, capsys, caplog):
    job = ["straggler", "--job", "job-1a2b3c4d5e6f7a8b", "--address", f"ipc://{tmp_path}/absent", "--timeout", "0.3"]
    assert main([*job, "--pipeline", "1", "--factor", "0.5"]) == 1
    assert "--factor is the straggler's iteration time over its planned time, in [1, 10]" in capsys.readouterr().err
    assert main([*job, "--pipeline", "-1", "--factor", "1.2"]) == 1
    assert "--pipeline is a data-parallel index" in capsys.readouterr().err
    assert main(["straggler", "--job", "nope"]) == 1
    assert "--job takes a job id as perseus serve logs it (job-<hex>), got 'nope'" in capsys.readouterr().err
    assert main([*job, "--timeout", "0"]) == 1
    assert "--timeout is in seconds" in capsys.readouterr().err
    assert main(["serve", "--log-every", "0"]) == 1
    assert "--log-every must be 1 or more" in capsys.readouterr().err
    assert main(["serve", "--job-ttl-hours", "-1"]) == 1
    assert "--job-ttl-hours must be more than 0, got -1" in capsys.readouterr().err
    assert main(job) == 1
    assert "did not answer within 0.3 s; is it running?" in capsys.readouterr().err
    # The client's warning to training ranks ("training continues ...") is not shown to an operator.
    assert not [r for r in caplog.records if r.name.startswith("perseus.client") and r.levelno < 40]


def test_straggler_cli_on_an_unknown_job_says_so(serve, capsys):
    """The service's unknown_job reply to a declaration used to be taken for a lost request
    (retried as if from a rank), so the command reported the service as unreachable."""
    served = serve()
    job = ["straggler", "--job", "job-1a2b3c4d5e6f7a8b", "--address", served.endpoint, "--timeout", "2"]
    for extra in ([], ["--pipeline", "1", "--factor", "1.2"]):
        assert main([*job, *extra]) == 1
        err = capsys.readouterr().err
        assert (
            "[unknown_job] no job job-1a2b3c4d5e6f7a8b" in err and "check --job" in err and "did not answer" not in err
        )
        assert err.count("\n") == 1  # one error line, no client log besides
