"""`perseus keys`: create the ZeroMQ CURVE key pairs of the planner service and its clients."""

from __future__ import annotations

import argparse
from pathlib import Path

from perseus.wire.security import DEFAULT_CLIENT, create_keys

EPILOG = """examples:
  perseus keys                                   ./perseus-keys: the service's pair and one client, "client"
  perseus keys --dir keys --client node1 --client node2
  perseus keys --dir keys --client node3         add a client later (the service reads clients/ at each handshake)

Then: perseus serve --curve-keys keys --bind tcp://0.0.0.0:7787, and on each node
PERSEUS_CURVE_KEYS=keys PERSEUS_CURVE_CLIENT=node1 (a copy of keys/server/server.key and that
client's two files is all a node needs). Delete clients/NAME.key to revoke a client: the
service refuses its messages and ends its connections within a second (at once on SIGHUP).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="create CURVE keys for an authenticated planner service",
        description="Create the planner service's CURVE key pair (DIR/server, kept if present) and a key pair per "
        "client (DIR/clients). Secret keys are written mode 0600; `perseus serve --curve-keys DIR` accepts exactly "
        "the clients whose public keys are in DIR/clients.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dir", default="perseus-keys", metavar="DIR", help="where to write the keys (default ./perseus-keys)"
    )
    parser.add_argument(
        "--client",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a client to create keys for (repeatable; default one named {DEFAULT_CLIENT!r} when the folder is new)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace existing keys of the service and of the named clients"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fresh = not (Path(args.dir) / "server").exists()
    clients = args.client if args.client is not None else ([DEFAULT_CLIENT] if fresh else [])
    written = create_keys(args.dir, clients, force=args.force)
    for path in written:
        print(f"wrote {path}{' (secret: keep it private)' if path.name.endswith('_secret') else ''}")
    if not written:
        print(f"{args.dir} already holds the service's keys; add clients with --client NAME")
    return 0
