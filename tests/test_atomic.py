"""perseus.atomic: the file mode follows the umask (or an explicit mode), the data and the
folder entry are fsynced, and a failed write leaves no temp file and raises."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from perseus import atomic
from perseus.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic


@pytest.fixture
def umask():
    """Set the process umask for one test (tests run in one thread), restored after."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_mode_follows_the_umask_unless_given(tmp_path, umask):
    umask(0o022)
    write_json_atomic(tmp_path / "plan.json", {"a": 1})
    assert _mode(tmp_path / "plan.json") == 0o644  # other users can read a plan, as with open()
    umask(0o027)
    assert atomic._umask() == 0o027  # read without changing it
    write_text_atomic(tmp_path / "plan.json", "replaced\n")
    assert _mode(tmp_path / "plan.json") == 0o640  # the new file's mode, not the old one's
    assert (tmp_path / "plan.json").read_text() == "replaced\n"
    umask(0)
    write_bytes_atomic(tmp_path / "secret", b"s", mode=0o600)
    assert _mode(tmp_path / "secret") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "secret"]


def test_umask_fallback_without_proc(monkeypatch):
    monkeypatch.setattr(atomic, "_proc_umask", lambda: None)
    assert atomic._umask() == atomic._IMPORT_UMASK


def test_data_and_folder_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)) or real_fsync(fd))
    write_bytes_atomic(tmp_path / "f", b"x")
    assert synced == [False, True]  # the file, then its folder after the rename
    synced.clear()
    write_bytes_atomic(tmp_path / "f", b"y", fsync=False)
    assert synced == [] and (tmp_path / "f").read_bytes() == b"y"


def test_short_writes_are_continued(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))
    write_bytes_atomic(tmp_path / "f", b"0123456789")
    assert (tmp_path / "f").read_bytes() == b"0123456789"


@pytest.mark.parametrize("failing", ["write", "fsync"])
def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch, failing):
    write_text_atomic(tmp_path / "plan.json", "old\n")

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, failing, full)
    with pytest.raises(OSError) as e:
        write_text_atomic(tmp_path / "plan.json", "new\n" * 1000)
    assert e.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert (tmp_path / "plan.json").read_text() == "old\n"


def test_an_interrupted_write_leaves_no_temp_file(tmp_path, monkeypatch):
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_bytes_atomic(tmp_path / "f", b"x")
    assert list(tmp_path.iterdir()) == []
