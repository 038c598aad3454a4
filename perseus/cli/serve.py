"""`perseus serve`: run the planner service that profiles, plans and steers a training job's ranks."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from perseus.exceptions import ConfigError
from perseus.metrics.exporter import DEFAULT_HOST as DEFAULT_METRICS_HOST
from perseus.metrics.exporter import MetricsServer, start_metrics_server
from perseus.pidlock import release_pid_lock, take_pid_lock
from perseus.service.budget import Budget
from perseus.service.service import PlannerService
from perseus.service.state import default_state_dir
from perseus.wire.limits import DEFAULT_ADDRESS
from perseus.wire.security import PLAINTEXT, CurveServer, Security

log = logging.getLogger(__name__)

EPILOG = f"""examples:
  perseus serve                                       listen on {DEFAULT_ADDRESS}
  perseus serve --state-dir ./perseus-state           keep profiles and plans beside the job
  perseus serve --bind tcp://127.0.0.1:0              pick a free port (printed on start)
  perseus serve --metrics-port 9400                   Prometheus metrics on http://127.0.0.1:9400/metrics
  perseus keys --dir keys --client node1 --client node2
  perseus serve --bind tcp://0.0.0.0:7787 --curve-keys keys
                                                      other machines, CURVE-authenticated: ranks
                                                      set PERSEUS_CURVE_KEYS=keys PERSEUS_CURVE_CLIENT=node1
  rm keys/clients/node2.key; kill -HUP <pid>          revoke node2: its open connections are refused and
                                                      closed at their next message (without SIGHUP, from
                                                      about a second after the deletion)

Start it beside torchrun; ranks reach it through perseus.instrument(..., client="tcp://HOST:PORT") or $PERSEUS_PLANNER.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the planner service for training jobs",
        description="Run the Perseus planner service: ranks register, profile their stages during "
        "training, and receive a frequency plan per instruction. Stop it with Ctrl-C or SIGTERM; "
        "state (profiles, plans, jobs) persists in --state-dir and is resumed on restart.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--bind",
        default=DEFAULT_ADDRESS,
        metavar="ENDPOINT",
        help=(
            f"ZeroMQ endpoint to listen on (default {DEFAULT_ADDRESS}; beyond loopback it needs --curve-keys or "
            "--insecure)"
        ),
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help=f"where jobs, profiles and plans are kept (default {default_state_dir()})",
    )
    parser.add_argument(
        "--curve-keys",
        default=None,
        metavar="DIR",
        help="encrypt and authenticate with ZeroMQ CURVE: the service's keys from DIR/server, accepting only clients "
        "whose public keys are in DIR/clients (create them with `perseus keys --dir DIR`)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help=(
            "allow binding a non-loopback address without --curve-keys (anyone who can reach the port can change your "
            "GPUs' clocks)"
        ),
    )
    limits = parser.add_argument_group(
        "budgets", "what one service holds and does; a job over a budget is refused with over_budget"
    )
    default = Budget()
    limits.add_argument(
        "--max-jobs",
        type=int,
        default=default.max_jobs,
        metavar="N",
        help=f"jobs held at once (default {default.max_jobs})",
    )
    limits.add_argument(
        "--memory-budget-mib",
        type=int,
        default=default.memory_bytes >> 20,
        metavar="MIB",
        help=f"estimated service memory of all jobs together (default {default.memory_bytes >> 20})",
    )
    limits.add_argument(
        "--max-job-ranks",
        type=int,
        default=default.max_job_ranks,
        metavar="N",
        help=f"ranks of one job (default {default.max_job_ranks})",
    )
    limits.add_argument(
        "--max-job-pipelines",
        type=int,
        default=default.max_job_pipelines,
        metavar="N",
        help=f"data-parallel pipelines of one job (default {default.max_job_pipelines})",
    )
    limits.add_argument(
        "--max-plan-choices",
        type=int,
        default=default.max_plan_choices,
        metavar="N",
        help=(
            "(instruction, frequency) choices of one pipeline's plan, which size its planning time (default "
            f"{default.max_plan_choices})"
        ),
    )
    limits.add_argument(
        "--planning-workers",
        type=int,
        default=default.planning_workers,
        metavar="N",
        help=f"plans solved at once (default {default.planning_workers})",
    )
    limits.add_argument(
        "--job-ttl-hours",
        type=float,
        default=default.job_ttl_s / 3600,
        metavar="H",
        help=(
            "a job with no request for this long is evicted; its cached profile stays (default "
            f"{default.job_ttl_s / 3600:g})"
        ),
    )
    limits.add_argument(
        "--evict-idle-minutes",
        type=float,
        default=default.evict_idle_s / 60,
        metavar="M",
        help=(
            "when --max-jobs or the memory budget is full, the least recently active job idle this long makes room "
            f"(default {default.evict_idle_s / 60:g})"
        ),
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: any free port, printed on start; needs "
        "pip install 'perseus-energy[metrics]')",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        metavar="HOST",
        help=f"address the metrics endpoint binds (default {DEFAULT_METRICS_HOST}; 0.0.0.0 for a Prometheus elsewhere)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default info)",
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=10,
        metavar="N",
        help="log predicted against measured every N planned iterations (default 10; the measured figure is that "
        "one iteration's, which a stepping energy counter moves by a step either way)",
    )
    parser.set_defaults(func=run)


# Checked here, so that an error names the flag (the Budget's own check names its fields).
BUDGET_FLAGS = (
    "--max-jobs",
    "--memory-budget-mib",
    "--max-job-ranks",
    "--max-job-pipelines",
    "--max-plan-choices",
    "--planning-workers",
    "--job-ttl-hours",
    "--evict-idle-minutes",
)


def run(args: argparse.Namespace) -> int:
    if args.log_every < 1:
        raise ConfigError(f"--log-every must be 1 or more (log every N-th planned iteration), got {args.log_every}")
    for flag in BUDGET_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if not value > 0:
            raise ConfigError(f"{flag} must be more than 0, got {value:g}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    budget = Budget(
        max_jobs=args.max_jobs,
        memory_bytes=args.memory_budget_mib * (1 << 20),
        max_job_ranks=args.max_job_ranks,
        max_job_pipelines=args.max_job_pipelines,
        max_plan_choices=args.max_plan_choices,
        planning_workers=args.planning_workers,
        job_ttl_s=args.job_ttl_hours * 3600,
        evict_idle_s=args.evict_idle_minutes * 60,
    )
    security = CurveServer(args.curve_keys) if args.curve_keys else PLAINTEXT
    claim = _claim_state_dir(args.state_dir or default_state_dir())  # held until this process exits
    service = PlannerService(
        args.bind, args.state_dir, security=security, insecure=args.insecure, log_every=args.log_every, budget=budget
    )
    metrics: MetricsServer | None = None
    try:
        endpoint = service.bind()
        if args.metrics_port is not None:
            from perseus.metrics.collectors import ServiceCollector  # needs prometheus-client (ConfigError naming it)

            metrics = start_metrics_server(
                [ServiceCollector(service.metrics.board)], args.metrics_port, args.metrics_host
            )
        previous = {sig: signal.signal(sig, lambda *_: service.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
        if hasattr(signal, "SIGHUP"):  # not on Windows
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: _reload_keys(security, args.curve_keys))
        print(f"perseus serve: listening on {endpoint}", flush=True)
        if metrics is not None:
            print(f"perseus serve: metrics on {metrics.url}", flush=True)
        try:
            service.serve_forever()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if metrics is not None:
            metrics.close()
        service.close()
        release_pid_lock(*claim)
    return 0


def _claim_state_dir(state_dir: str) -> tuple[int, str]:
    """An exclusive lock on the state directory (its file `serve.lock`): two services resuming the
    same jobs would each plan them and overwrite each other's records."""
    try:
        os.makedirs(os.path.expanduser(state_dir), exist_ok=True)
        path = os.path.join(os.path.expanduser(state_dir), "serve.lock")
        fd = take_pid_lock(path)
    except OSError as e:
        raise ConfigError(
            f"cannot use the state directory {state_dir}: {e.strerror or e}; pass a writable --state-dir"
        ) from None
    if isinstance(fd, str):
        raise ConfigError(
            f"another perseus serve (pid {fd}) uses the state directory {state_dir}; stop it, or give this "
            "service its own --state-dir"
        )
    return fd, path


def _reload_keys(security: Security, keys_dir: str | None) -> None:
    """SIGHUP: read the accepted client keys again, so a deleted key's open connections are
    refused now rather than within the second the service takes to notice by itself."""
    allowed = security.reload()
    if allowed is None:
        log.info("SIGHUP: no client keys to reload (the service runs without --curve-keys)")
    else:
        log.info(
            "SIGHUP: reloaded the client keys in %s: %d allowed; connections with other keys are refused and closed",
            keys_dir,
            allowed,
        )
