"""The lease table: all-or-none grants, one holder per GPU, and the file a restarted agent reads."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import pytest

from perseus.agent.leases import Lease, LeaseConflict, LeaseTable, read_lease_file
from perseus.agent.protocol import Holder
from perseus.exceptions import ConfigError

A = Holder(pid=11, uid=1000, gid=1000, client="rank 0", client_pid=11, since=1.0)
B = Holder(pid=22, uid=1001, gid=1001, client="rank 1", client_pid=22, since=2.0)


def test_grants_are_all_or_none_and_persisted(tmp_path):
    path = str(tmp_path / "leases.json")
    table = LeaseTable(path)
    assert [lease.uuid for lease in table.acquire(1, A, [("GPU-0", 0), ("GPU-1", 1)])] == ["GPU-0", "GPU-1"]
    assert table.acquire(1, A, [("GPU-0", 0)]) == []  # held already by this connection
    with pytest.raises(LeaseConflict) as conflict:
        table.acquire(2, B, [("GPU-2", 2), ("GPU-1", 1)])
    assert conflict.value.lease.holder == A
    assert table.lease("GPU-2") is None  # none of the request was granted
    assert [(lease.uuid, lease.holder.pid) for lease in read_lease_file(path)[0]] == [("GPU-0", 11), ("GPU-1", 11)]
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_ending_and_revoking_remove_leases_from_the_file(tmp_path):
    path = str(tmp_path / "leases.json")
    table = LeaseTable(path)
    table.acquire(1, A, [("GPU-0", 0)])
    table.acquire(2, B, [("GPU-1", 1)])
    assert [lease.uuid for lease in table.revoke(["GPU-1", "GPU-9"])] == ["GPU-1"]
    assert table.holds(1, "GPU-0") and not table.holds(2, "GPU-1")
    assert [lease.uuid for lease in table.end(1)] == ["GPU-0"]
    leases, revoked = read_lease_file(path)
    assert leases == [] and [(r.uuid, r.holder) for r in revoked] == [("GPU-1", B)]
    assert table.was_revoked("GPU-1", replace(B, since=9.0)) and not table.was_revoked("GPU-1", A)


def test_revocations_are_kept_while_their_holder_runs(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = replace(A, pid=os.getpid())
    table = LeaseTable(str(tmp_path / "leases.json"))
    table.keep_revoked([Lease("GPU-0", 0, alive, 0), Lease("GPU-1", 1, replace(A, pid=gone.pid), 0)])
    assert table.was_revoked("GPU-0", alive) and not table.was_revoked("GPU-1", replace(A, pid=gone.pid))


def test_a_lease_file_that_cannot_be_written_leaves_the_lease_standing(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    table = LeaseTable(str(blocker / "leases.json"))
    assert len(table.acquire(1, A, [("GPU-0", 0)])) == 1
    assert table.holds(1, "GPU-0")
    assert "cannot write the lease file" in caplog.text


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{", "is damaged"),
        ('{"version": 9, "leases": []}', "not a version 1 lease file"),
        ('{"version": 1, "leases": [{"uuid": "GPU-0"}]}', "leases[0].index"),
        ('{"version": 1, "leases": [{"uuid": "GPU-0", "index": 0, "pid": 1}]}', "missing field(s) uid"),
        (
            '{"version": 1, "leases": [{"uuid": "GPU-0", "index": 0, "pid": "x", "uid": 0, "gid": 0, "client": "", '
            '"client_pid": 0, "since": 0}]}',
            "holder.pid",
        ),
        ('{"version": 1, "leases": "all"}', "leases must be a list"),
    ],
)
def test_a_damaged_lease_file_is_named(tmp_path, content, words):
    path = tmp_path / "leases.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="lease file") as damaged:
        read_lease_file(str(path))
    assert words in str(damaged.value)


def test_no_file_means_nothing_stale(tmp_path):
    assert read_lease_file(str(tmp_path / "none.json")) == ([], [])
    (tmp_path / "empty.json").write_text(json.dumps({"version": 1, "leases": []}))
    assert read_lease_file(str(tmp_path / "empty.json")) == ([], [])
