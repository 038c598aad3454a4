"""`perseus plan --profile FILE` on hostile files: a one-line error and exit status 1, never a
traceback and never a plan built on values no GPU could measure."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from perseus.cli.main import main
from perseus.profiler import profile as profile_module

HEADER = "stage,instruction,frequency,time,energy\n"
ROWS = [
    "0,forward,1410,0.05,24.0",
    "0,forward,1200,0.06,20.0",
    "0,backward,1410,0.09,44.0",
    "0,backward,1200,0.11,37.0",
]


def csv_text(*replace: tuple[int, str]) -> str:
    rows = list(ROWS)
    for i, row in replace:
        rows[i] = row
    return HEADER + "\n".join(rows) + "\n"


def json_text(**changes) -> str:
    points = [
        dict(
            zip(
                ("stage", "instruction", "frequency", "time", "energy"),
                (int(r[0]), r[1], int(r[2]), float(r[3]), float(r[4])),
            )
        )
        for r in (row.split(",") for row in ROWS)
    ]
    return json.dumps(
        {"format": "perseus.profile", "version": 1, "blocking_power_w": 80.0, "meta": {}, "points": points, **changes}
    )


CASES = {
    "huge-frequency.csv": (
        csv_text((1, "0,forward,1e308,0.06,20.0")),
        r"huge-frequency.csv:3: frequency is 1e\+308, but it must be positive, between 1 and 100000 MHz",
    ),
    "tiny-time.csv": (
        csv_text((1, "0,forward,1200,1e-320,20.0")),
        r"tiny-time.csv:3: time is 1e-320, but it must be positive, between 1e-06 and 86400 s",
    ),
    "binary.csv": (
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xff",
        r"binary.csv:1: byte 0x89 is not UTF-8 text; save the profile as UTF-8",
    ),
    "meta-list.json": (
        json_text(meta=[1]),
        r"meta-list.json: meta must be an object mapping strings to strings, got \[\.\.\.\]",
    ),
    "deep.json": ("[" * 100_000 + "]" * 100_000, r"deep.json: not valid JSON \(RecursionError"),
}


def run_plan(capsys, path, *extra: str) -> tuple[int, str, str]:
    code = main(
        ["plan", "--profile", str(path), "--blocking-power", "80", "--stages", "1", "--microbatches", "2", *extra]
    )
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_profile_is_a_one_line_error(tmp_path, capsys, name):
    content, message = CASES[name]
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    code, out, err = run_plan(capsys, path)
    assert code == 1
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("perseus: error: ")
    assert re.search(message, err), err


def test_oversized_file_and_too_many_rows(tmp_path, capsys, monkeypatch):
    path = tmp_path / "huge.csv"
    with path.open("wb") as f:
        f.truncate(300 << 20)  # a sparse 300 MB file with no line break
    code, _, err = run_plan(capsys, path)
    assert code == 1 and "huge.csv: larger than 16 MiB, the limit for a profile" in err
    monkeypatch.setattr(profile_module, "MAX_ROWS", 3)
    path = tmp_path / "rows.csv"
    path.write_text(csv_text())
    code, _, err = run_plan(capsys, path)
    assert code == 1 and "rows.csv:5: more than 3 rows, the limit for a profile" in err


def test_byte_order_mark_is_accepted(tmp_path, capsys):
    path = tmp_path / "excel.csv"
    path.write_text("\ufeff" + csv_text().replace("\n", "\r\n"))
    code, out, err = run_plan(capsys, path)
    assert code == 0, err
    assert "Perseus is within" in out


def test_no_traceback_from_the_real_command(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\x00\xff" * 64)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "perseus.cli.main",
            "plan",
            "--profile",
            str(path),
            "--stages",
            "1",
            "--microbatches",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("perseus: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "binary.json: not valid JSON" in result.stderr


def test_a_missing_csv_is_said_missing_before_its_blocking_power(tmp_path, capsys):
    missing = tmp_path / "typo.csv"
    assert main(["plan", "--profile", str(missing), "--stages", "1", "--microbatches", "2"]) == 1
    err = capsys.readouterr().err
    assert f"cannot read profile {missing}: No such file or directory" in err and "blocking" not in err
    present = tmp_path / "gpt3.csv"
    present.write_text(csv_text())
    assert main(["plan", "--profile", str(present), "--stages", "1", "--microbatches", "2"]) == 1
    assert "carries no blocking power; pass --blocking-power W" in capsys.readouterr().err
