"""What the commands that talk to a running planner service share: its address and keys on the
command line, and a client that fails with one clear error (`perseus straggler`, `perseus status`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator

from perseus.client.planner_client import PlannerClient
from perseus.exceptions import ConfigError, ServiceError
from perseus.wire.envelope import ErrorCode
from perseus.wire.limits import DEFAULT_ADDRESS, PLANNER_ENV
from perseus.wire.messages import GetStatus, Status
from perseus.wire.security import DEFAULT_CLIENT, CurveClient


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=os.environ.get(PLANNER_ENV) or DEFAULT_ADDRESS,
        metavar="ENDPOINT",
        help=f"the planner service (default ${PLANNER_ENV}, the ranks' own, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--curve-keys", default=None, metavar="DIR", help="CURVE keys folder, for a service run with --curve-keys"
    )
    parser.add_argument(
        "--client",
        default=DEFAULT_CLIENT,
        metavar="NAME",
        help=f"client key name in DIR/clients (default {DEFAULT_CLIENT})",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the service (default 5)"
    )


def check_job_id(job: str | None) -> None:
    """ConfigError unless `job` is None or a job id as the service logs it."""
    if job is None:
        return
    try:
        GetStatus(job)  # the protocol's own check of a job id
    except ConfigError:
        raise ConfigError(f"--job takes a job id as perseus serve logs it (job-<hex>), got {job!r}") from None


def unreachable(args: argparse.Namespace) -> ServiceError:
    """No answer: the service is down, or (CURVE gives a client no other sign) refuses this client's key."""
    keys = (
        f"; is it running, and does it accept the key {args.client!r} (--client) from {args.curve_keys}?"
        if args.curve_keys
        else "; is it running? (A service started with --curve-keys answers only clients that pass --curve-keys.)"
    )
    return ServiceError(
        "unreachable", f"the planner service at {args.address} did not answer within {args.timeout:g} s{keys}"
    )


@contextlib.contextmanager
def service_client(args: argparse.Namespace) -> Iterator[PlannerClient]:
    """A client of the service at --address; every failure is raised once, as the command's error."""
    if not 0 < args.timeout <= 3600:
        raise ConfigError(f"--timeout is in seconds, more than 0 and at most 3600; got {args.timeout:g}")
    security = CurveClient.from_dir(args.curve_keys, args.client) if args.curve_keys else None
    # The client logs for training ranks ("training continues ..."): quiet here.
    client_log = logging.getLogger("perseus.client")  # the client package: its connection thread logs the timeouts
    level = client_log.level
    client_log.setLevel(logging.CRITICAL)
    try:
        with PlannerClient(args.address, timeout_s=args.timeout, security=security) as client:
            yield client
    except ServiceError as e:
        if e.code == ErrorCode.UNKNOWN_JOB.value and getattr(args, "job", None):
            raise ServiceError(
                e.code,
                f"no job {args.job} on the service at {args.address}; check --job (perseus serve logs each job's id, "
                "perseus status lists them)",
            ) from None
        raise
    finally:
        client_log.setLevel(level)


def fetch_status(client: PlannerClient, args: argparse.Namespace, job: str | None) -> Status:
    status = client.status(job)
    if status is None:
        raise unreachable(args)
    return status
