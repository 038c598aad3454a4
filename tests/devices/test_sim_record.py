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
    sim_record.write(path, {"sm_clock_mhz": 810})
    inode = os.stat(path).st_ino
    sim_record.write(path, {"sm_clock_mhz": 1410, "power_limit_mw": None})
    assert os.stat(path).st_ino == inode
    assert os.path.getsize(path) == sim_record.SIZE
    assert sim_record.read(path) == {"sm_clock_mhz": 1410, "power_limit_mw": None}


def test_each_write_stamps_a_new_mtime(tmp_path):
    path = str(tmp_path / "gpu.json")
    stamps = set()
    for mhz in range(100):
        sim_record.write(path, {"sm_clock_mhz": mhz})
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
    sim_record.write(path, {"sm_clock_mhz": 0, "pad": ""})
    docs = [{"sm_clock_mhz": i, "pad": "x" * (i % 300)} for i in range(2000)]
    stop = threading.Event()

    def writer() -> None:
        for doc in docs:
            sim_record.write(path, doc)
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
    sim_record.write(str(path), {"sm_clock_mhz": 810})  # rewritten in place, in the new form
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
