"""A simulated GPU's runtime record: rewritten in place (no rename over an existing file, which
ext4 flushes first), torn reads detected and read again, older whole-JSON files still read."""

from __future__ import annotations

import json
import os
import threading

import pytest

from perseus.devices import sim_record
from perseus.devices.sim import SimGPU


def test_a_record_is_rewritten_in_place(tmp_path):
    path = str(tmp_path / "gpu.json")
    sim_record.write(path, sim_record.encode({"sm_clock_mhz": 810}))
    inode = os.stat(path).st_ino
    sim_record.write(path, sim_record.encode({"sm_clock_mhz": 1410, "power_limit_mw": None}))
    assert os.stat(path).st_ino == inode
    assert os.path.getsize(path) == sim_record.SIZE
    assert sim_record.read(path) == {"sm_clock_mhz": 1410, "power_limit_mw": None}


def test_each_write_stamps_a_new_mtime(tmp_path):
    path = str(tmp_path / "gpu.json")
    stamps = set()
    for mhz in range(100):
        sim_record.write(path, sim_record.encode({"sm_clock_mhz": mhz}))
        stamps.add(os.stat(path).st_mtime_ns)
    assert len(stamps) == 100


def test_a_torn_record_is_not_a_record():
    old, new = sim_record.encode({"sm_clock_mhz": 1410}), sim_record.encode({"sm_clock_mhz": 810})
    assert sim_record.decode(new) == {"sm_clock_mhz": 810}
    for cut in range(1, sim_record.SIZE):
        torn = new[:cut] + old[cut:]
        assert sim_record.decode(torn) in (None, {"sm_clock_mhz": 810})
    assert sim_record.decode(new[:20] + old[20:]) is None  # the digits differ: a mix, caught by the checksum


def test_readers_never_see_half_a_write(tmp_path):
    path = str(tmp_path / "gpu.json")
    sim_record.write(path, sim_record.encode({"sm_clock_mhz": 0, "pad": ""}))
    docs = [{"sm_clock_mhz": i, "pad": "x" * (i % 300)} for i in range(2000)]
    stop = threading.Event()

    def writer() -> None:
        for doc in docs:
            sim_record.write(path, sim_record.encode(doc))
        stop.set()

    seen = []
    thread = threading.Thread(target=writer)
    thread.start()
    while not stop.is_set():
        seen.append(sim_record.read(path))
    thread.join()
    valid = [{"sm_clock_mhz": 0, "pad": ""}, *docs]
    assert all(doc in valid for doc in seen)
    assert sim_record.read(path) == docs[-1]


def test_an_older_whole_json_file_reads(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"sm_clock_mhz": 1005, "power_limit_mw": None, "slowdown": 1.0}))
    assert sim_record.read(str(path))["sm_clock_mhz"] == 1005
    sim_record.write(str(path), sim_record.encode({"sm_clock_mhz": 810}))  # rewritten in place, in the new form
    assert sim_record.read(str(path)) == {"sm_clock_mhz": 810}


def test_junk_is_unreadable(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_bytes(b"12345678 not json")
    with pytest.raises(ValueError, match="not a whole runtime record"):
        sim_record.read(str(path))
    path.write_text('{"sm_clock_mhz": ')  # an older file cut short
    with pytest.raises(ValueError):
        sim_record.read(str(path))


def test_a_document_over_the_slot_is_refused():
    with pytest.raises(ValueError, match="over its 512-byte slot"):
        sim_record.encode({"x": "y" * 600})


def test_a_simulated_gpu_reads_what_another_process_object_wrote(tmp_path):
    a = SimGPU("a100-sxm", state_dir=str(tmp_path), realism="ideal")
    b = SimGPU("a100-sxm", state_dir=str(tmp_path), realism="ideal")
    for mhz in (810, 1005, 1410, 705):
        a.lock_sm_clock(mhz)
        assert b.sm_clock() == mhz
    a.reset_sm_clock()
    assert b.sm_clock() == b.max_frequency()
    assert not os.listdir(tmp_path) or all(not name.endswith("-0.json") for name in os.listdir(tmp_path))


def test_write_returns_the_key_a_reader_stats(tmp_path):
    path = str(tmp_path / "gpu.json")
    for mhz in (810, 1005):  # created by rename, then rewritten in place
        assert sim_record.write(path, sim_record.encode({"sm_clock_mhz": mhz})) == sim_record.key(os.stat(path))


def test_a_clock_change_neither_reads_back_nor_decodes_its_own_writes(tmp_path, monkeypatch):
    """A controller changes clocks dozens of times an iteration: each change re-reads the state
    under the lock (another process may have changed it) but decodes nothing it wrote itself, and
    encodes only the switch record once each state was seen."""
    gpu = SimGPU("a100-sxm", state_dir=str(tmp_path), realism="realistic")
    for mhz in (810, 1005):
        gpu.lock_sm_clock(mhz)
    calls = {"parse": 0, "encode": 0}

    def counted(name):
        real = getattr(sim_record, name)

        def call(*args):
            calls[name] += 1
            return real(*args)

        return call

    monkeypatch.setattr(sim_record, "parse", counted("parse"))
    monkeypatch.setattr(sim_record, "encode", counted("encode"))
    for i in range(20):
        gpu.lock_sm_clock((810, 1005)[i % 2])
        assert gpu._state().sm_clock_mhz == (810, 1005)[i % 2]
    assert calls == {"parse": 0, "encode": 20}
    other = SimGPU("a100-sxm", state_dir=str(tmp_path), realism="realistic")
    # What it cached of its writes is what any other process reads: the state and the switch in flight.
    assert other._state() == gpu._state() and other._switch.read() == gpu._switch.read() is not None
    assert other.sm_clock() == gpu.sm_clock()
    assert calls["parse"] == 2  # the other object's reads: state and switch


def test_a_change_keeps_another_writers_setting_even_where_the_stat_cannot_tell(tmp_path):
    """Under the lock the state is compared byte for byte, not by its stat key: on a file system
    whose timestamps are too coarse to tell two writes apart, another process's change still holds."""
    a = SimGPU("a100-sxm", state_dir=str(tmp_path), realism="ideal")
    b = SimGPU("a100-sxm", state_dir=str(tmp_path), realism="ideal")
    a.lock_sm_clock(810)
    path = a.state_path
    stamp = os.stat(path).st_mtime_ns
    b.set_power_limit_mw(300_000)
    os.utime(path, ns=(stamp, stamp))  # b's write, with the timestamp a last saw
    assert a.power_limit_mw() == 400_000  # a's cache cannot tell, as such a file system would have it
    a.lock_sm_clock(1005)
    assert b.sm_clock() == 1005 and b.power_limit_mw() == 300_000
    assert a.power_limit_mw() == 300_000
