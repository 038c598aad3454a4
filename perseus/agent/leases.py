"""Who holds which GPU, and the record of it on disk.

A lease binds GPUs to one connection. The table grants a request's GPUs all together or not at
all, revokes, and ends a connection's leases; every change is written at once to the lease file
(atomically, fsynced). No lease outlives the agent, so an agent that starts and finds leases in
that file knows which GPUs a client that is gone may have left locked, and resets them. A lease an
administrator revoked is recorded there too, so that its holder cannot take it back for as long as
it lives: not on a new connection, nor from a restarted agent (its client reconnects on its own).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from perseus.agent.protocol import Holder, check_uuid
from perseus.atomic import write_json_atomic
from perseus.exceptions import ConfigError
from perseus.wire.fields import check_int, check_seq

logger = logging.getLogger(__name__)

FILE_VERSION = 1
MAX_FILE_BYTES = 1 << 20
MAX_REVOKED = 256  # the oldest revocations are forgotten first


@dataclass(frozen=True)
class Lease:
    uuid: str
    index: int  # the agent's index of the GPU
    holder: Holder
    connection: int  # the agent's number for the connection holding it (0 for a lease read from the file)


def same_process(a: Holder, b: Holder) -> bool:
    """Whether two holders are one process (pid 0, a peer from another pid namespace, is told
    apart by what it says of itself)."""
    return (a.pid, a.uid, a.gid, a.client, a.client_pid) == (b.pid, b.uid, b.gid, b.client, b.client_pid)


def _alive(pid: int) -> bool:
    """Whether process `pid` of the agent's pid namespace may still run (0: it cannot tell)."""
    if pid == 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class LeaseConflict(Exception):
    """A GPU asked for is leased to another connection."""

    def __init__(self, lease: Lease) -> None:
        super().__init__(lease.uuid)
        self.lease = lease


class LeaseTable:
    """The agent's leases; thread-safe. Every change is persisted before the call returns."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._revoked: list[Lease] = []
        self._write_failed = False

    def acquire(self, connection: int, holder: Holder, gpus: list[tuple[str, int]]) -> list[Lease]:
        """Lease every (uuid, index) of `gpus` to `connection` (those it holds already stay as they
        are), or none: LeaseConflict names the first one another connection holds."""
        with self._lock:
            for uuid, _ in gpus:
                held = self._leases.get(uuid)
                if held is not None and held.connection != connection:
                    raise LeaseConflict(held)
            granted = []
            for uuid, index in gpus:
                if uuid not in self._leases:
                    lease = Lease(uuid, index, holder, connection)
                    self._leases[uuid] = lease
                    granted.append(lease)
            if granted:
                self._save()
            return granted

    def holds(self, connection: int, uuid: str) -> bool:
        lease = self._leases.get(uuid)
        return lease is not None and lease.connection == connection

    def lease(self, uuid: str) -> Lease | None:
        return self._leases.get(uuid)

    def end(self, connection: int) -> list[Lease]:
        """Remove and return every lease of `connection`."""
        with self._lock:
            ended = [lease for lease in self._leases.values() if lease.connection == connection]
            return self._remove(ended)

    def revoke(self, uuids: list[str]) -> list[Lease]:
        """Remove and return the leases on `uuids`, recording them as revoked."""
        with self._lock:
            ended = [self._leases[u] for u in uuids if u in self._leases]
            self._revoked = ([r for r in self._revoked if _alive(r.holder.pid)] + ended)[-MAX_REVOKED:]
            return self._remove(ended)

    def was_revoked(self, uuid: str, holder: Holder) -> bool:
        """Whether an administrator revoked this process's lease on GPU `uuid`."""
        return any(r.uuid == uuid and same_process(r.holder, holder) for r in self._revoked)

    def keep_revoked(self, revoked: list[Lease]) -> None:
        """At start: the revocations a previous agent recorded, for holders that still run."""
        with self._lock:
            self._revoked = [r for r in revoked if _alive(r.holder.pid)][-MAX_REVOKED:]

    def clear(self) -> list[Lease]:
        with self._lock:
            return self._remove(list(self._leases.values()))

    def _remove(self, leases: list[Lease]) -> list[Lease]:
        for lease in leases:
            del self._leases[lease.uuid]
        if leases:
            self._save()
        return leases

    def save(self) -> None:
        """Write the file now (at start: no leases); ConfigError if it cannot be written, for an
        agent that could not tell after a crash which GPUs to reset must not start."""
        with self._lock:
            try:
                write_json_atomic(self.path, self._document(), mode=0o600)
            except OSError as e:
                raise ConfigError(f"cannot write the lease file {self.path} ({e}); choose --state-file") from e

    def _document(self) -> dict:
        return {
            "version": FILE_VERSION,
            "agent_pid": os.getpid(),
            "written": time.time(),
            "leases": [_record(lease) for lease in self._leases.values()],
            "revoked": [_record(lease) for lease in self._revoked],
        }

    def _save(self) -> None:
        try:
            write_json_atomic(self.path, self._document(), mode=0o600)
        except OSError as e:
            # The lease still stands (training goes on); only a crash of this agent could now leave
            # these GPUs locked until someone runs `perseus reset`.
            if not self._write_failed:
                logger.error(
                    "cannot write the lease file %s (%s): if this agent crashes, a restarted one cannot tell "
                    "which GPUs to reset; free the disk or point --state-file elsewhere",
                    self.path,
                    e,
                )
            self._write_failed = True
        else:
            if self._write_failed:
                logger.info("the lease file %s is written again", self.path)
            self._write_failed = False


def _record(lease: Lease) -> dict:
    return {"uuid": lease.uuid, "index": lease.index, **lease.holder.to_wire()}


def read_lease_file(path: str) -> tuple[list[Lease], list[Lease]]:
    """(the leases, the revoked leases) an agent that is gone recorded in the lease file (none when
    there is no file). ConfigError naming the problem when the file cannot be trusted."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return [], []
    except OSError as e:
        raise ConfigError(f"cannot read the lease file {path}: {e}") from e
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"the lease file {path} is over {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != FILE_VERSION:
            raise ConfigError(f"not a version {FILE_VERSION} lease file")
        return _leases(doc.get("leases"), "leases"), _leases(doc.get("revoked", []), "revoked")
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError, as is bad JSON
        raise ConfigError(f"the lease file {path} is damaged: {e}") from e


def _leases(records: object, name: str) -> list[Lease]:
    leases = []
    for i, record in enumerate(check_seq(records, name, 4096)):
        if not isinstance(record, dict):
            raise ConfigError(f"{name}[{i}] is not a map")
        record = dict(record)
        uuid = check_uuid(record.pop("uuid", None), f"{name}[{i}].uuid")
        index = check_int(record.pop("index", None), f"{name}[{i}].index", 0, 1 << 16)
        leases.append(Lease(uuid, index, Holder.from_wire(record), 0))
    return leases
