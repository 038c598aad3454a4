"""The pid lock: one holder, the refused one told who, nothing left behind by a clean release."""

from __future__ import annotations

import os
import subprocess
import sys

from perseus.pidlock import release_pid_lock, take_pid_lock


def test_a_second_taker_is_told_the_holder_and_a_release_removes_the_file(tmp_path):
    path = str(tmp_path / "x.lock")
    fd = take_pid_lock(path)
    assert isinstance(fd, int)
    assert take_pid_lock(path) == str(os.getpid())  # another open file of the same path is refused
    release_pid_lock(fd, path)
    assert not os.path.exists(path)
    again = take_pid_lock(path)
    assert isinstance(again, int)
    release_pid_lock(again, path)


def test_a_holder_that_dies_leaves_the_lock_free(tmp_path):
    path = str(tmp_path / "x.lock")
    code = f"import os; from perseus.pidlock import take_pid_lock; take_pid_lock({path!r}); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert os.path.exists(path)  # killed, it could not remove its file: the next holder reuses it
    fd = take_pid_lock(path)
    assert isinstance(fd, int)
    with open(path) as f:
        assert f.read() == f"{os.getpid()}\n"
    release_pid_lock(fd, path)


def test_a_release_leaves_a_newer_holders_file_alone(tmp_path):
    path = str(tmp_path / "x.lock")
    old = take_pid_lock(path)
    assert isinstance(old, int)
    os.unlink(path)  # as if released by someone else and taken again
    new = take_pid_lock(path)
    assert isinstance(new, int)
    release_pid_lock(old, path)
    assert os.path.exists(path)
    assert take_pid_lock(path) == str(os.getpid())
    release_pid_lock(new, path)
    assert not os.path.exists(path)
