"""`perseus serve`: run the planner service that profiles, plans and steers a training job's ranks."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from perseus.exceptions import ConfigError
from perseus.server.protocol import DEFAULT_ADDRESS
from perseus.server.security import PLAINTEXT, CurveServer, Security
from perseus.server.service import PlannerService
from perseus.server.state import default_state_dir

log = logging.getLogger(__name__)

EPILOG = f"""examples:
  perseus serve                                       listen on {DEFAULT_ADDRESS}
  perseus serve --state-dir ./perseus-state           keep profiles and plans beside the job
  perseus serve --bind tcp://127.0.0.1:0              pick a free port (printed on start)
  perseus keys --dir keys --client node1 --client node2
  perseus serve --bind tcp://0.0.0.0:7787 --curve-keys keys
                                                      other machines, CURVE-authenticated: ranks
                                                      set PERSEUS_CURVE_KEYS=keys PERSEUS_CURVE_CLIENT=node1
  rm keys/clients/node2.key; kill -HUP <pid>          revoke node2: its open connections are refused and
                                                      closed at their next message (without SIGHUP, from
                                                      about a second after the deletion)

Start it beside torchrun; ranks reach it through perseus.instrument(..., address=...).
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
    parser.add_argument("--bind", default=DEFAULT_ADDRESS, metavar="ENDPOINT", help=f"ZeroMQ endpoint to listen on (default {DEFAULT_ADDRESS}; beyond loopback it needs --curve-keys or --insecure)")
    parser.add_argument("--state-dir", default=None, metavar="DIR", help=f"where jobs, profiles and plans are kept (default {default_state_dir()})")
    parser.add_argument(
        "--curve-keys", default=None, metavar="DIR",
        help="encrypt and authenticate with ZeroMQ CURVE: the service's keys from DIR/server, accepting only clients "
        "whose public keys are in DIR/clients (create them with `perseus keys --dir DIR`)",
    )
    parser.add_argument(
        "--insecure", action="store_true",
        help="allow binding a non-loopback address without --curve-keys (anyone who can reach the port can change your GPUs' clocks)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity (default info)")
    parser.add_argument("--log-every", type=int, default=10, metavar="N", help="log predicted against measured every N planned iterations (default 10)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.log_every < 1:
        raise ConfigError(f"--log-every must be 1 or more (log every N-th planned iteration), got {args.log_every}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    security = CurveServer(args.curve_keys) if args.curve_keys else PLAINTEXT
    service = PlannerService(args.bind, args.state_dir, security=security, insecure=args.insecure, log_every=args.log_every)
    try:
        endpoint = service.bind()
        previous = {sig: signal.signal(sig, lambda *_: service.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
        if hasattr(signal, "SIGHUP"):  # not on Windows
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: _reload_keys(security, args.curve_keys))
        print(f"perseus serve: listening on {endpoint}", flush=True)
        try:
            service.serve_forever()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        service.close()
    return 0


def _reload_keys(security: Security, keys_dir: str | None) -> None:
    """SIGHUP: read the accepted client keys again, so a deleted key's open connections are
    refused now rather than within the second the service takes to notice by itself."""
    allowed = security.reload()
    if allowed is None:
        log.info("SIGHUP: no client keys to reload (the service runs without --curve-keys)")
    else:
        log.info("SIGHUP: reloaded the client keys in %s: %d allowed; connections with other keys are refused and closed", keys_dir, allowed)
