"""Profiles: CSV/JSON round trips, the real SOSP'24 profile, and bad rows named by line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perseus.exceptions import ConfigError, ProfileError
from perseus.profiler import Profile, ProfilePoint, load_profile, save_profile
from perseus.schedules import build_schedule

DATA = Path(__file__).resolve().parents[2] / "../shared/data/perseus-sosp24/stage_profiles"

GOOD = """stage,instruction,frequency,time,energy
0,forward,1410,0.05,24.0
0,backward,1410,0.09,44.0
0,forward,1395,0.051,23.5
0,backward,1395,0.092,43.0
1,forward,1410,0.06,25.0
1,backward,1410,0.1,45.0
1,forward,1395,0.061,24.5
1,backward,1395,0.101,44.5
"""


def write(tmp_path: Path, text: str, name: str = "p.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_csv(tmp_path):
    p = load_profile(write(tmp_path, GOOD), blocking_power_w=83.64)
    assert p.stages() == [0, 1] and p.kinds(0) == ["forward", "backward"]
    assert p.frequencies(1, "backward") == [1410, 1395]
    assert p.lookup(1, "forward", 1395) == ProfilePoint(1395, 0.061, 24.5)
    assert p.blocking_power_w == 83.64
    p.validate(build_schedule("1f1b", 2, 4))


def test_csv_needs_blocking_power(tmp_path):
    with pytest.raises(ProfileError, match="pass blocking_power_w"):
        load_profile(write(tmp_path, GOOD))


@pytest.mark.parametrize(
    "value,message",
    [
        ("nan", "time is nan"),
        ("inf", "time is inf"),
        ("0", "time is 0, but it must be positive"),
        ("-0.2", "time is -0.2"),
        ("abc", "time 'abc' is not a number"),
    ],
)
def test_bad_time_names_the_line(tmp_path, value, message):
    lines = GOOD.splitlines()
    lines[4] = f"1,forward,1410,{value},25.0"  # file line 5
    with pytest.raises(ProfileError, match=f"p.csv:5: {message}"):
        load_profile(write(tmp_path, "\n".join(lines)), 83.64)


@pytest.mark.parametrize("value", ["nan", "-inf", "0", "-3"])
def test_bad_energy_names_the_line(tmp_path, value):
    lines = GOOD.splitlines()
    lines[2] = f"0,backward,1410,0.09,{value}"
    with pytest.raises(ProfileError, match="p.csv:3: energy"):
        load_profile(write(tmp_path, "\n".join(lines)), 83.64)


def test_duplicate_row_names_both_lines(tmp_path):
    with pytest.raises(
        ProfileError,
        match=r"p.csv:10: duplicate row for stage 0 instruction forward frequency 1410 \(first at .*p.csv:2\)",
    ):
        load_profile(write(tmp_path, GOOD + "0,forward,1410,0.05,24.0\n"), 83.64)


def test_bad_instruction_header_and_frequency(tmp_path):
    with pytest.raises(ProfileError, match="p.csv:10: unknown instruction 'fwd'"):
        load_profile(write(tmp_path, GOOD + "0,fwd,1200,0.05,24.0\n"), 83.64)
    with pytest.raises(ProfileError, match=r"header lacks columns \['energy'\]"):
        load_profile(write(tmp_path, "stage,instruction,frequency,time\n0,forward,1410,0.05\n"), 83.64)
    with pytest.raises(ProfileError, match=r"lacks columns \['stage'\] \(it has Stage,.*; names are lower case\)"):
        load_profile(write(tmp_path, "Stage,instruction,frequency,time,energy\n0,forward,1410,0.05,24.0\n"), 83.64)
    with pytest.raises(ProfileError, match="p.csv:10: frequency '1200.5' must be a whole number"):
        load_profile(write(tmp_path, GOOD + "0,forward,1200.5,0.05,24.0\n"), 83.64)
    with pytest.raises(ProfileError, match="p.csv:10: row has more fields than the header"):
        load_profile(write(tmp_path, GOOD + "0,forward,1200,0.05,24.0,7\n"), 83.64)
    with pytest.raises(ProfileError, match="p.csv:10: row has too few fields"):
        load_profile(write(tmp_path, GOOD + "0,forward,1200\n"), 83.64)
    with pytest.raises(ProfileError, match="unknown profile format '.txt'"):
        load_profile(write(tmp_path, GOOD, "p.txt"), 83.64)
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "absent.csv", 83.64)


def test_missing_stage_and_kind_for_schedule(tmp_path):
    p = load_profile(write(tmp_path, GOOD), 83.64)
    with pytest.raises(ProfileError, match=r"needs profile stage 2, but the profile has stages \[0, 1\]"):
        p.validate(build_schedule("1f1b", 3, 4))
    with pytest.raises(ProfileError, match="needs rows for stage 0 instruction backward_input.*with_split_backward"):
        p.validate(build_schedule("zb-h1", 2, 4))
    p.with_split_backward(0.5).validate(build_schedule("zb-h1", 2, 4))
    half = p.with_split_backward(0.4).lookup(1, "backward_weight", 1395)
    assert (half.time, half.energy) == pytest.approx((0.101 * 0.6, 44.5 * 0.6))
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        p.with_split_backward(1.0)


def test_validate_in_memory_profile():
    P = ProfilePoint
    with pytest.raises(ProfileError, match="row stage=0,instruction=forward,frequency=900: energy is nan"):
        Profile({(0, "forward"): [P(1000, 1.0, 1.0), P(900, 1.0, float("nan"))]}, 1.0).validate()
    with pytest.raises(ProfileError, match="frequency=1000 appears twice"):
        Profile({(0, "forward"): [P(1000, 1.0, 1.0), P(1000, 1.1, 1.0)]}, 1.0).validate()
    with pytest.raises(ProfileError, match="sorted by frequency"):
        Profile({(0, "forward"): [P(900, 1.0, 1.0), P(1000, 1.1, 1.0)]}, 1.0).validate()
    with pytest.raises(ProfileError, match="blocking power"):
        Profile({(0, "forward"): [P(1000, 1.0, 1.0)]}, -1.0).validate()
    with pytest.raises(ConfigError, match="frequency 1100 MHz is not in the profile of stage 0 instruction forward"):
        Profile({(0, "forward"): [P(1000, 1.0, 1.0)]}, 1.0).lookup(0, "forward", 1100)
    with pytest.raises(ProfileError, match="no rows for stage 0 instruction backward"):
        Profile({(0, "forward"): [P(1000, 1.0, 1.0)]}, 1.0).lookup(0, "backward", 1000)


@pytest.mark.parametrize("name", ["q.csv", "q.json"])
def test_round_trip(tmp_path, name):
    p = load_profile(write(tmp_path, GOOD), 70.38).with_split_backward(0.3)
    p.meta["gpu"] = "a40"
    save_profile(p, tmp_path / name)
    q = load_profile(tmp_path / name, 70.38 if name.endswith(".csv") else None)
    assert q.points == p.points
    assert q.blocking_power_w == 70.38
    if name.endswith(".json"):
        assert q.meta == {"gpu": "a40"}
        assert load_profile(tmp_path / name, 10.0).blocking_power_w == 10.0
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temp file left


def test_json_bad_point_named(tmp_path):
    doc = {
        "format": "perseus.profile",
        "version": 1,
        "blocking_power_w": 1.0,
        "points": [
            {"stage": 0, "instruction": "forward", "frequency": 1000, "time": 1.0, "energy": 2.0},
            {"stage": 0, "instruction": "forward", "frequency": 900, "time": -1.0, "energy": 2.0},
        ],
    }
    with pytest.raises(ProfileError, match=r"points\[1\]: time is -1"):
        load_profile(write(tmp_path, json.dumps(doc), "p.json"))
    with pytest.raises(ProfileError, match="not a Perseus profile"):
        load_profile(write(tmp_path, "[]", "p.json"))
    one = load_profile(write(tmp_path, json.dumps({**doc, "points": doc["points"][:1]}), "p.json"))
    with pytest.raises(ConfigError, match="unknown profile format"):
        save_profile(one, tmp_path / "x.yaml")


@pytest.mark.skipif(not DATA.exists(), reason="shared Perseus SOSP'24 data not present")
@pytest.mark.parametrize("name,freqs", [("gpt3-175b+a100_sxm_bf16.csv", 38), ("bloom+a40_bf16.csv", 60)])
def test_real_profiles(name, freqs):
    p = load_profile(DATA / name, blocking_power_w=83.64)
    assert p.stages() == list(range(8))
    for stage in p.stages():
        assert p.kinds(stage) == ["forward", "backward"]
        assert len(p.frequencies(stage, "forward")) == freqs
    top = p.points[(0, "forward")][0]
    slowest = p.points[(0, "forward")][-1]
    assert top.time < slowest.time  # a lower clock is slower
    p.validate(build_schedule("1f1b", 8, 96))


def _three_stage_profile() -> Profile:
    kinds = ("forward", "backward", "backward_input", "backward_weight")
    points = {(s, k): [ProfilePoint(1410, 0.010, 3.0), ProfilePoint(1200, 0.012, 2.5)] for s in range(3) for k in kinds}
    return Profile(points, 80.0, {"source": "test"})


def test_with_overheads_adds_host_work_and_hops_where_a_peer_sends():
    profile = _three_stage_profile()
    out = profile.with_overheads(instruction_s=0.001, hop_s=0.002)
    receives = {
        (1, "forward"),
        (2, "forward"),
        (0, "backward"),
        (1, "backward"),
        (0, "backward_input"),
        (1, "backward_input"),
    }
    for key, pts in out.points.items():
        added = 0.001 + (0.002 if key in receives else 0.0)
        for before, after in zip(profile.points[key], pts):
            assert after.frequency == before.frequency
            assert after.time == pytest.approx(before.time + added)
            assert after.energy == pytest.approx(before.energy + 80.0 * added)  # the GPU idles, blocked
    assert out.blocking_power_w == 80.0 and out.meta == {"source": "test"}
    assert profile.points[(1, "forward")][0].time == 0.010  # the original is untouched
    out.validate()


def test_with_overheads_num_stages_sets_the_last_stage():
    out = _three_stage_profile().with_overheads(
        hop_s=0.002, num_stages=4
    )  # stage 2 is not the last: it receives gradients
    assert out.points[(2, "backward")][0].time == pytest.approx(0.012)
    with pytest.raises(ConfigError, match="num_stages"):
        _three_stage_profile().with_overheads(hop_s=0.002, num_stages=2)


def test_with_overheads_zero_is_identity():
    profile = _three_stage_profile()
    out = profile.with_overheads()
    assert out.points == profile.points and out.blocking_power_w == profile.blocking_power_w


@pytest.mark.parametrize("value", [-0.001, float("nan"), float("inf"), "0.001", True])
def test_with_overheads_rejects_bad_values(value):
    with pytest.raises(ConfigError, match="instruction_s must be a finite number of seconds >= 0"):
        _three_stage_profile().with_overheads(instruction_s=value)
    with pytest.raises(ConfigError, match="hop_s must be a finite number of seconds >= 0"):
        _three_stage_profile().with_overheads(hop_s=value)


def test_repeated_maps_a_deeper_pipeline_onto_the_profiled_stages():
    from perseus.profiler.profile import SWITCH_LATENCIES_META, SWITCH_LATENCY_META

    points = {
        (s, k): [ProfilePoint(1000 + s, 0.1 * (s + 1), 1.0 * (s + 1))]
        for s in range(3)
        for k in ("forward", "backward")
    }
    meta = {f"{SWITCH_LATENCY_META}@1": "0.02", f"{SWITCH_LATENCIES_META}@2": "1000:0.03", "source": "test"}
    profile = Profile(points, 60.0, meta)
    tiled = profile.repeated(7, "tile")
    stretched = profile.repeated(6, "stretch")
    assert tiled.stages() == list(range(7)) and stretched.stages() == list(range(6))
    assert [tiled.points[(s, "forward")][0].frequency - 1000 for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [stretched.points[(s, "backward")][0].frequency - 1000 for s in range(6)] == [0, 0, 1, 1, 2, 2]
    assert tiled.switch_latency_s(4) == 0.02 and tiled.switch_latency_s(3) == 0.0
    assert stretched.switch_latencies_s(5) == {1000: 0.03} and stretched.meta["source"] == "test"
    assert profile.repeated(2, "tile").stages() == [0, 1]
    for bad, message in (((6, "spread"), "unknown stage mapping 'spread'"), ((0, "tile"), "positive whole number")):
        with pytest.raises(ConfigError, match=message):
            profile.repeated(*bad)
    gappy = Profile({k: v for k, v in points.items() if k[0] != 1}, 60.0)
    with pytest.raises(ConfigError, match="not 0..K-1"):
        gappy.repeated(6)
