"""Hostile profile files: every one is refused with a ProfileError naming the file, the line or
point, the field, the value and the allowed range -- never another exception, never a plan
built on nonsense."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from perseus.exceptions import ProfileError
from perseus.profiler import Profile, ProfilePoint, load_profile, save_profile
from perseus.profiler import profile as profile_module

HEADER = "stage,instruction,frequency,time,energy\n"
GOOD = HEADER + "0,forward,1410,0.05,24.0\n0,forward,1395,0.051,23.5\n0,backward,1410,0.09,44.0\n"


def doc(**changes) -> dict:
    return {
        "format": "perseus.profile",
        "version": 1,
        "blocking_power_w": 80.0,
        "meta": {"gpu": "a40"},
        "points": [{"stage": 0, "instruction": "forward", "frequency": 1410, "time": 0.05, "energy": 24.0}],
        **changes,
    }


def write(tmp_path: Path, content: str | bytes, name: str = "p.csv") -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


@pytest.mark.parametrize(
    "row,message",
    [
        ("0,forward,1e308,0.05,24", r"frequency is 1e\+308, but it must be positive, between 1 and 100000 MHz"),
        ("0,forward,1e400,0.05,24", r"frequency is inf, but it must be positive, between 1 and 100000 MHz"),
        ("0,forward,0,0.05,24", r"frequency is 0, but it must be positive, between 1 and 100000 MHz"),
        ("0,forward,100001,0.05,24", r"frequency is 100001, but it must be positive, between 1 and 100000 MHz"),
        ("0,forward,1410,1e-320,24", r"time is 1e-320, but it must be positive, between 1e-06 and 86400 s"),
        ("0,forward,1410,86401,24", r"time is 86401, but it must be positive, between 1e-06 and 86400 s"),
        ("0,forward,1410,0.05,1e-320", r"energy is 1e-320, but it must be positive, between 1e-06 and 864000000 J"),
        (
            "0,forward,1410,0.05,1e10",
            r"energy is 10000000000, but it must be positive, between 1e-06 and 864000000 J",
        ),
        ("-1,forward,1410,0.05,24", r"stage is -1, but it must be between 0 and 1048575;"),
        ("1e308,forward,1410,0.05,24", r"stage is 1e\+308, but it must be between 0 and 1048575;"),
        ("0,forward,1410," + "9" * 500 + ",24", r"time is inf, but it must be positive"),
    ],
)
def test_values_out_of_range_name_file_line_field_value_and_range(tmp_path, row, message):
    with pytest.raises(ProfileError, match=rf"p.csv:3: {message}"):
        load_profile(write(tmp_path, HEADER + "0,backward,1410,0.09,44\n" + row + "\n"), 83.64)


def test_limits_themselves_are_accepted(tmp_path):
    p = load_profile(write(tmp_path, HEADER + "0,forward,1,0.000001,0.000001\n0,forward,100000,86400,864e6\n"), 0.0)
    assert p.points[(0, "forward")] == [ProfilePoint(100000, 86400.0, 864e6), ProfilePoint(1, 1e-6, 1e-6)]


def test_a_row_over_10_kw_a_version_it_does_not_read_and_numbers_as_strings_are_refused(tmp_path):
    """2000 J in 6 ms (333 kW: millijoules written as joules), a JSON profile of version 99, and
    "0.006" where a number belongs are each refused with what to write instead."""
    with pytest.raises(ProfileError, match=r"p.csv:2: 2000 J in 0.006 s is 333,333 W, over the 10,000 W .* joules"):
        load_profile(write(tmp_path, HEADER + "0,forward,1410,0.006,2000\n"), 80.0)
    with pytest.raises(ProfileError, match="p.json: profile version 99 is not 1"):
        load_profile(write(tmp_path, json.dumps({**doc(), "version": 99}), "p.json"))
    text = doc()
    text["points"][0]["time"] = "0.006"
    with pytest.raises(ProfileError, match=r"p.json: points\[0\]: time '0.006' is not a number but a string"):
        load_profile(write(tmp_path, json.dumps(text), "p.json"))


@pytest.mark.parametrize("power", [float("nan"), -1.0, 1e308, "many"])
def test_blocking_power_out_of_range(tmp_path, power):
    with pytest.raises(ProfileError, match="p.csv: blocking power .* (between 0 and 100000 W|is not a number)"):
        load_profile(write(tmp_path, GOOD), power)
    with pytest.raises(ProfileError, match="p.json: blocking power"):
        load_profile(write(tmp_path, json.dumps(doc(blocking_power_w=power)), "p.json"))


def test_in_memory_profile_is_held_to_the_same_limits():
    with pytest.raises(ProfileError, match="row stage=0,instruction=forward,frequency=1410: time is 1e-320"):
        Profile({(0, "forward"): [ProfilePoint(1410, 1e-320, 1.0)]}, 80.0).validate()
    with pytest.raises(ProfileError, match="blocking power is 1e\\+308"):
        Profile({(0, "forward"): [ProfilePoint(1410, 0.1, 1.0)]}, 1e308).validate()


def test_binary_files(tmp_path):
    with pytest.raises(ProfileError, match=r"p.csv:1: byte 0xff is not UTF-8 text; save the profile as UTF-8"):
        load_profile(write(tmp_path, b"\xff\xfe\x00\x01garbage"), 83.64)
    with pytest.raises(ProfileError, match=r"p.csv:3: byte 0xc3 is not UTF-8"):
        load_profile(write(tmp_path, GOOD.encode().replace(b"1395", b"13\xc3\x28")), 83.64)
    with pytest.raises(ProfileError, match=r"p.json: not valid JSON"):
        load_profile(write(tmp_path, b"\xff\xfe\x00\x01garbage", "p.json"))


@pytest.mark.parametrize(
    "meta,shown",
    [([1], r"\[\.\.\.\]"), ("x", "'x'"), (None, "null"), ({"k": 1}, r"\{\.\.\.\}"), ({"k": ["v"]}, r"\{\.\.\.\}")],
)
def test_meta_must_map_strings_to_strings(tmp_path, meta, shown):
    with pytest.raises(ProfileError, match=f"p.json: meta must be an object mapping strings to strings, got {shown}"):
        load_profile(write(tmp_path, json.dumps(doc(meta=meta)), "p.json"))
    assert (
        load_profile(write(tmp_path, json.dumps({k: v for k, v in doc().items() if k != "meta"}), "p.json")).meta == {}
    )


def test_deeply_nested_json(tmp_path):
    with pytest.raises(ProfileError, match=r"p.json: not valid JSON \(RecursionError"):
        load_profile(write(tmp_path, "[" * 100_000 + "]" * 100_000, "p.json"))
    deep = json.dumps(doc()).replace('"time": 0.05', '"time": ' + "[" * 900 + "]" * 900)
    with pytest.raises(ProfileError, match=r"points\[0\]: time \[\.\.\.\] is not a number"):
        load_profile(write(tmp_path, deep, "p.json"))


@pytest.mark.parametrize(
    "value,shown", [(True, "true"), (None, "null"), ("1410x", "'1410x'"), ({"a": 1}, r"\{\.\.\.\}")]
)
def test_json_values_of_the_wrong_type(tmp_path, value, shown):
    bad = doc()
    bad["points"][0]["frequency"] = value
    with pytest.raises(ProfileError, match=rf"p.json: points\[0\]: frequency {shown} is not a number"):
        load_profile(write(tmp_path, json.dumps(bad), "p.json"))


def test_json_integer_too_long_to_parse(tmp_path):
    with pytest.raises(ProfileError, match="p.json: not valid JSON"):
        load_profile(write(tmp_path, json.dumps(doc()).replace("1410", "9" * 5000), "p.json"))


def test_file_over_the_size_limit_is_refused_unread(tmp_path):
    path = tmp_path / "p.csv"
    with path.open("wb") as f:
        f.truncate(300 << 20)  # 300 MB, sparse: one "line" of NUL bytes
    with pytest.raises(ProfileError, match=r"p.csv: larger than 16 MiB, the limit for a profile"):
        load_profile(path, 83.64)


def test_size_limit_holds_max_rows_as_save_profile_writes_them(tmp_path):
    def size(rows: int) -> int:
        longest = ProfilePoint(100_000, 1.2345678901234567e-05, 0.09234567890123457)  # 7.5 kW
        points = {
            ((1 << 20) - 1, "backward_weight"): [
                ProfilePoint(longest.frequency - i, longest.time, longest.energy) for i in range(rows)
            ]
        }
        save_profile(Profile(points, 83.64, {"gpu": "a100-sxm"}), tmp_path / "p.json")
        return (tmp_path / "p.json").stat().st_size

    per_row = (size(20) - size(10)) / 10
    assert size(10) + per_row * profile_module.MAX_ROWS < profile_module.MAX_BYTES


def test_line_over_the_field_limit(tmp_path):
    with pytest.raises(ProfileError, match=r"p.csv:3: not valid CSV \(field larger than field limit"):
        load_profile(write(tmp_path, GOOD.replace("0.051", "1" * 200_000)), 83.64)


@pytest.mark.parametrize("name", ["p.csv", "p.json"])
def test_row_limit(tmp_path, monkeypatch, name):
    monkeypatch.setattr(profile_module, "MAX_ROWS", 2)
    points = [{**doc()["points"][0], "frequency": f} for f in (1410, 1395, 1380)]
    content = GOOD if name == "p.csv" else json.dumps(doc(points=points))
    where = "p.csv:4" if name == "p.csv" else r"p.json: points\[2\]"
    with pytest.raises(ProfileError, match=f"{where}: more than 2 rows, the limit for a profile"):
        load_profile(write(tmp_path, content, name), 83.64)


def test_byte_order_mark_and_line_endings_are_accepted(tmp_path):
    expected = load_profile(write(tmp_path, GOOD), 83.64).points
    for content in (
        "\ufeff" + GOOD,
        GOOD.replace("\n", "\r\n"),
        GOOD.replace("\n", "\r"),
        "\ufeff" + GOOD.replace("\n", "\r\n"),
    ):
        assert load_profile(write(tmp_path, content), 83.64).points == expected
    assert load_profile(write(tmp_path, "\ufeff" + json.dumps(doc()), "p.json")).meta == {"gpu": "a40"}


def test_duplicate_found_after_other_rows_names_the_first(tmp_path):
    rows = GOOD + "1,forward,1410,0.05,24.0\n0,forward,1395,0.05,24.0\n"
    with pytest.raises(
        ProfileError,
        match=r"p.csv:6: duplicate row for stage 0 instruction forward frequency 1395 \(first at .*p.csv:3\)",
    ):
        load_profile(write(tmp_path, rows), 83.64)


# ---- fuzzing: random bytes and mutated valid files -------------------------------------------

TOKENS = [
    b"nan",
    b"inf",
    b"-",
    b"1e308",
    b"1e-320",
    b"\xff",
    b"\x00",
    b'"',
    b",",
    b"\n",
    b"\r",
    b"\xef\xbb\xbf",
    b"9" * 400,
    b"forward",
    b" ",
    b"0x10",
    b"1_0",
    b"[",
    b"{",
    b"}",
    b"]",
    b"null",
    b"true",
    b"-0",
    b"1e999",
]
JSON_VALUES = [
    None,
    True,
    False,
    [],
    {},
    "",
    "x",
    "forward",
    0,
    -1,
    1,
    1410,
    2**70,
    1e308,
    1e-320,
    -0.0,
    [1],
    {"a": "b"},
    "1e-320",
]


def _mutate_bytes(r: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(r.randint(1, 6)):
        at = r.randint(0, len(data))
        choice = r.random()
        if choice < 0.4:
            data[at : at + r.randint(1, 4)] = r.choice(TOKENS)
        elif choice < 0.7 and data:
            data[min(at, len(data) - 1)] = r.randrange(256)
        else:
            del data[at : at + r.randint(1, 8)]
    return bytes(data)


def _mutate_json(r: random.Random, node):
    """Replace one randomly chosen value of the document tree with a hostile JSON value."""
    if isinstance(node, dict) and node and r.random() < 0.8:
        key = r.choice(list(node))
        node[key] = _mutate_json(r, node[key])
        return node
    if isinstance(node, list) and node and r.random() < 0.8:
        i = r.randrange(len(node))
        node[i] = _mutate_json(r, node[i])
        return node
    return r.choice(JSON_VALUES)


def _only_profile_errors(path: Path, content: bytes, power) -> None:
    path.write_bytes(content)
    try:
        profile = load_profile(path, power)
    except ProfileError:
        return
    profile.validate()  # whatever loads is within the limits


def test_fuzz_only_profile_errors(tmp_path):
    r = random.Random(20240917)
    csv_path, json_path = tmp_path / "f.csv", tmp_path / "f.json"
    valid_json = json.dumps(
        doc(
            points=doc()["points"]
            + [{"stage": 1, "instruction": "backward", "frequency": 1395, "time": 0.1, "energy": 40.0}]
        )
    )
    for _ in range(400):
        power = r.choice([83.64, None, float("nan"), -1.0, 0.0])
        _only_profile_errors(csv_path, bytes(r.randrange(256) for _ in range(r.randint(0, 64))), 80.0)
        _only_profile_errors(csv_path, _mutate_bytes(r, GOOD.encode()), 80.0 if power is None else power)
        _only_profile_errors(json_path, _mutate_bytes(r, valid_json.encode()), power)
        tree = _mutate_json(r, json.loads(valid_json))
        _only_profile_errors(json_path, json.dumps(tree).encode(), power)
