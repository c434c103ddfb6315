"""``kvshelf replay TRACE`` and ``kvshelf bench replay``: the table, --json, --plot, and every bad input as one
``error: ...`` line with exit code 2 (two of them through a real subprocess, the rest through ``main()``)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from kvshelf.cli import main
from kvshelf.kvstore import eviction
from tests.support.service_helpers import kvshelf_cli

LINES = [[0, 1, 2, 3], [0, 1, 2, 4, 5], [0, 6], [0, 1, 2, 4, 5, 7], [8, 9], [0, 6, 10], [0, 1, 2, 3, 11]]


def write_trace(tmp_path: Path, lines: list[str] | None = None) -> Path:
    path = tmp_path / "trace.jsonl"
    if lines is None:
        lines = [json.dumps({"timestamp": n, "input_length": 512 * len(ids), "hash_ids": ids})
                 for n, ids in enumerate(LINES * 4)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``kvshelf ARGS`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["kvshelf", *args])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_prints_the_table_and_writes_json_and_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path)
    out_json, out_png = tmp_path / "out" / "replay.json", tmp_path / "plot.png"
    code, out, err = run_main(monkeypatch, capsys, "replay", str(trace), "--capacities", "0.25,0.5,8KiB",
                              "--block-bytes", "1KiB", "--json", str(out_json), "--plot", str(out_png))
    assert (code, err) == (0, "")
    assert "OPT" in out and "lru" in out and f"wrote {out_json}" in out
    payload = json.loads(out_json.read_text())
    assert set(payload) == {"trace", "results"} and payload["trace"] == str(trace)
    assert len(payload["results"]) == 3 * len(eviction.POLICIES)
    for result in payload["results"]:
        assert {"policy", "default", "capacity_fraction", "hit_rate", "opt_hit_rate", "lru_hit_rate"} <= set(result)
        assert 0 < result["hit_rate"] <= result["opt_hit_rate"] + 1e-9 or result["policy"] != "lru"
    assert [r["capacity_fraction"] for r in payload["results"] if r["policy"] == "lru"] == [0.25, 0.5, 8 / 12]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_replay_writes_its_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    code, out, err = run_main(monkeypatch, capsys, "bench", "replay", str(write_trace(tmp_path)), "--policies",
                              "lru", "--capacities", "0.5", "--block-bytes", "64", "--json", str(out_json))
    assert (code, err) == (0, "")
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["policy"] == "lru" and result["hit_rate"] == result["lru_hit_rate"]


def test_replay_drives_the_lmdb_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out_json = tmp_path / "disk.json"
    trace = write_trace(tmp_path)
    args = ["--policies", "lru", "--capacities", "0.25,1", "--block-bytes", "64KiB"]
    code, out, err = run_main(monkeypatch, capsys, "replay", str(trace), *args, "--tier", "lmdb", "--json",
                              str(out_json))
    assert (code, err) == (0, "")
    assert "lmdb tier" in out
    disk = json.loads(out_json.read_text())["results"]
    assert [r["tier"] for r in disk] == ["lmdb", "lmdb"]
    assert list(scratch.iterdir()) == []  # the environments are removed
    code, out, err = run_main(monkeypatch, capsys, "replay", str(trace), *args, "--json", str(out_json))
    memory = json.loads(out_json.read_text())["results"]
    assert [(r["hit_rate"], r["evictions"]) for r in disk] == [(r["hit_rate"], r["evictions"]) for r in memory]
    assert disk[0]["evictions"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--capacities", "0"], "capacity '0' must be positive"),
    (["--capacities", "-0.05"], "must be positive"),
    (["--capacities", "0GiB"], "is 0 bytes"),
    (["--capacities", "-1GiB"], "negative"),
    (["--capacities", "0.001"], "less than one block"),
    (["--capacities", "1000B"], "smaller than one block (--block-bytes 1024)"),
    (["--capacities", "3"], "above 1"),
    (["--policies", "lru,belady"], "unknown eviction policy 'belady'; known policies: "),
    (["--block-bytes", "0"], "--block-bytes must be a positive number of bytes"),
    (["--block-bytes", "big"], "--block-bytes: cannot read size 'big'"),
    (["--tier", "redis"], "--tier must be one of memory, lmdb"),
    (["--tier", "lmdb", "--capacities", "1000TiB"], "does not fit the "),
    (["--block-bytes", "2GiB"], "--block-bytes '2GiB' is too large"),
    (["--workers", "0"], "--workers must be at least 1"),
])
def test_bad_settings_are_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run_main(monkeypatch, capsys, "replay", str(write_trace(tmp_path)), "--block-bytes", "1KiB",
                              *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert out == ""


@pytest.mark.parametrize(("lines", "message"), [
    (['{"hash_ids": [1]}', '{"hash_ids": [1, 2]', '{"hash_ids": [3]}'], "line 2: not JSON"),
    (['{"hash_ids": [1]}', "", "[1, 2]"], "line 3: expected a JSON object"),
    (['{"input_length": 5}'], "line 1: no 'hash_ids'"),
    (['{"hash_ids": [1]}', '{"hash_ids": []}'], "line 2: 'hash_ids' is empty"),
    (['{"hash_ids": [1, "x"]}'], "line 1: hash_ids[1] must be a non-negative integer"),
    (['{"hash_ids": [1, -2]}'], "line 1: hash_ids[1] must be a non-negative integer, got -2"),
    ([""], "has no requests"),
])
def test_a_bad_trace_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str], lines: list[str], message: str) -> None:
    code, out, err = run_main(monkeypatch, capsys, "replay", str(write_trace(tmp_path, lines)))
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and "trace.jsonl" in err


def test_a_missing_trace_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(monkeypatch, capsys, "replay", str(tmp_path / "nope.jsonl"))
    assert code == 2
    assert err.startswith("error: cannot read trace ") and "No such file" in err and err.count("\n") == 1


def test_an_unwritable_json_path_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    trace = write_trace(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "replay", str(trace), "--capacities", "0.5", "--json",
                              str(tmp_path / "file" / "out.json"))
    assert (code, out) == (2, "")  # refused before the replay, not after it
    assert err.startswith("error: cannot write --json ") and err.count("\n") == 1
    code, out, err = run_main(monkeypatch, capsys, "replay", str(trace), "--capacities", "0.5", "--plot",
                              str(tmp_path))
    assert (code, out) == (2, "")
    assert err == f"error: cannot write --plot {tmp_path}: it is a directory\n"


def test_the_real_command_exits_2_with_the_line_number(tmp_path: Path) -> None:
    trace = write_trace(tmp_path, ['{"hash_ids": [1, 2]}', '{"hash_ids": [1, 2, 3]}', '{"hash_ids": [2.5]}'])
    result = kvshelf_cli("replay", str(trace))
    assert result.returncode == 2
    assert result.stderr == f"error: {trace}: line 3: hash_ids[0] must be a non-negative integer, got 2.5\n"
    result = kvshelf_cli("replay", str(trace), "--policies", "nope")
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown eviction policy 'nope'; known policies: ")
    assert all(name in result.stderr for name in eviction.POLICIES)


def test_bench_eviction_bounds_prints_and_writes_its_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bounds.json"
    code, out, err = run_main(monkeypatch, capsys, "bench", "eviction-bounds", str(write_trace(tmp_path)),
                              "--capacities", "0.25,0.5", "--json", str(out_json))
    assert (code, err) == (0, "")
    assert "o.GDF/OPT" in out
    rows = json.loads(out_json.read_text())["results"]
    assert [r["capacity_fraction"] for r in rows] == [0.25, 0.5]
    assert all(r["lru"] <= r["dead_lru"] for r in rows)
    code, _, err = run_main(monkeypatch, capsys, "bench", "eviction-bounds", str(write_trace(tmp_path)),
                            "--capacities", "8KiB")
    assert code == 2 and err.count("\n") == 1 and "fractions" in err
