"""`perseus agent`: run the node's GPU agent, show its leases, or revoke one."""

from __future__ import annotations

import argparse
import grp
import json
import logging
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

from perseus.agent.location import DEFAULT_SOCKET, configured_socket
from perseus.cli.common import add_gpu_argument, parse_gpu_indices
from perseus.devices.select import get_gpus
from perseus.exceptions import ConfigError

if TYPE_CHECKING:
    from perseus.agent.client import AgentClient

DEFAULT_STATE_FILE = "/var/lib/perseus-agent/leases.json"

EPILOG = f"""examples:
  sudo perseus agent                               serve every GPU on {DEFAULT_SOCKET}
  sudo perseus agent --group perseus               members of group perseus may connect
  perseus agent status                             GPUs, clocks, power limits and who holds each
  sudo perseus agent revoke --gpu-index 2          end GPU 2's lease and restore its defaults
  sudo PERSEUS_GPU=sim:a100-sxm:4 perseus agent --group "$(id -gn)"
                                                   simulated GPUs; your processes use them with
                                                   PERSEUS_AGENT=/run/perseus/agent.sock

Training processes use the agent when PERSEUS_AGENT names its socket (or, for real GPUs, when its
socket is at {DEFAULT_SOCKET}): their clock and power-limit changes go through it, under a lease
per GPU, and the agent restores a GPU's defaults as soon as its holder exits or is killed.
deploy/ has a hardened systemd unit, a container recipe and a Kubernetes DaemonSet.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="the node's GPU agent: unprivileged training changes clocks through it",
        description="Run the node's GPU agent (the default action), the one process that changes GPU clocks "
        "and power limits, for clients on a Unix socket; `status` shows its GPUs and leases, `revoke` ends "
        "leases.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", default="serve", choices=("serve", "status", "revoke"))
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=None,
        help=f"the agent's Unix socket (default: $PERSEUS_AGENT, else {DEFAULT_SOCKET})",
    )
    add_gpu_argument(parser)
    parser.add_argument(
        "--group",
        metavar="NAME|GID",
        default=None,
        help="the socket's group: its members may connect (default: the agent's own group)",
    )
    parser.add_argument(
        "--mode", metavar="OCTAL", default="660", help="the socket's permissions (default 660: owner and group)"
    )
    parser.add_argument(
        "--state-file",
        metavar="PATH",
        default=DEFAULT_STATE_FILE,
        help=f"the lease file, read at start to reset what a stopped agent left leased (default {DEFAULT_STATE_FILE})",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        metavar="S",
        type=float,
        default=1.0,
        help="a client silent this long loses its leases and its GPUs are reset (default 1 s; it sends "
        "heartbeats 4 times as often)",
    )
    parser.add_argument("--max-connections", metavar="N", type=int, default=256, help="default 256")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="default info"
    )
    parser.add_argument(
        "--gpu-index",
        metavar="I",
        type=int,
        action="append",
        default=None,
        help="revoke: the agent's GPU index (as `status` shows it); repeatable",
    )
    parser.add_argument("--all", action="store_true", help="revoke: every leased GPU")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = args.socket or configured_socket() or DEFAULT_SOCKET
    if args.action == "serve":
        return serve(args, path)
    from perseus.agent.client import AgentClient

    client = AgentClient(path)
    try:
        if args.action == "status":
            return show_status(client, args.json)
        return revoke(client, args.gpu_index, args.all)
    finally:
        client.close()


def serve(args: argparse.Namespace, path: str) -> int:
    from perseus.agent.daemon import Agent, AgentConfig, notify_systemd

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    gpus = get_gpus(args.gpu, direct=True)
    indices = parse_gpu_indices(args.gpu_indices, [gpu.index for gpu in gpus])
    if indices is not None:
        gpus = [gpu for gpu in gpus if gpu.index in indices]
    config = AgentConfig(
        socket_path=path,
        state_path=args.state_file,
        timeout_s=args.heartbeat_timeout,
        mode=parse_mode(args.mode),
        group=parse_group(args.group),
        max_connections=args.max_connections,
    )
    agent = Agent(gpus, config)

    def stop(signum: int, frame: FrameType | None) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.start()
    simulated = "" if agent.sim_dir is None else f" (simulated, in {agent.sim_dir})"
    print(f"perseus agent: serving {len(gpus)} GPU(s){simulated} on {path}", flush=True)
    notify_systemd("READY=1")
    agent.serve_forever()
    notify_systemd("STOPPING=1")
    return 0


def parse_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"--mode {text!r}: give the socket's permissions in octal, e.g. 660 or 600")
    return mode


def parse_group(text: str | None) -> int | None:
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ConfigError(f"--group {text!r}: no such group on this machine (give a name or a numeric gid)") from None


def show_status(client: AgentClient, as_json: bool) -> int:
    status = client.status()
    served = client.served()
    if as_json:
        doc = {**status.to_wire(), "socket": client.path, "backend": served.backend, "sim_dir": served.sim_dir}
        print(json.dumps(doc, indent=2))
        return 0
    print(f"perseus agent (pid {status.agent_pid}) on {client.path}: {status.connections} other connection(s)")
    if served.sim_dir is not None:
        print(f"simulated GPUs, their state in {served.sim_dir} (every process on this node uses these)")
    now = time.time()
    for gpu in status.gpus:
        clock = "?" if gpu.sm_clock_mhz is None else f"{gpu.sm_clock_mhz} MHz"
        limit = "?" if gpu.power_limit_mw is None else f"{gpu.power_limit_mw / 1000:g} W"
        default = "?" if gpu.default_power_limit_mw is None else f"{gpu.default_power_limit_mw / 1000:g} W"
        held = "free" if gpu.holder is None else f"leased to {gpu.holder.describe()} for {now - gpu.holder.since:.0f} s"
        print(f"GPU {gpu.index}: {gpu.name}  {gpu.uuid}")
        print(f"  SM clock {clock} (max {gpu.max_mhz} MHz); power limit {limit} (default {default}); {held}")
        if gpu.error:
            print(f"  ({gpu.error})")
    return 0


def revoke(client: AgentClient, indices: list[int] | None, every: bool) -> int:
    status = client.status()
    by_index = {gpu.index: gpu for gpu in status.gpus}
    if every:
        chosen = [gpu for gpu in status.gpus if gpu.holder is not None]
    elif indices:
        unknown = [i for i in indices if i not in by_index]
        if unknown:
            raise ConfigError(
                f"--gpu-index {unknown[0]}: the agent serves GPUs {', '.join(map(str, sorted(by_index)))}"
            )
        chosen = [by_index[i] for i in dict.fromkeys(indices)]
    else:
        raise ConfigError("revoke needs --gpu-index I (repeatable) or --all")
    if not chosen:
        print("no GPU is leased")
        return 0
    ended = set(client.revoke(tuple(gpu.uuid for gpu in chosen)))
    for gpu in chosen:
        what = f"lease of {gpu.holder.describe()} revoked" if gpu.uuid in ended and gpu.holder else "not leased"
        print(f"GPU {gpu.index} ({gpu.uuid}): {what}; back at default clocks and power limit")
    return 0
