"""Reading request traces (kvstore.trace): the format of ../shared/data/traces/README.md, and every malformed line
named by file and 1-based line number."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.trace import TraceError, TraceRequest, read_trace

GOOD = '{"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]}'


def write(tmp_path: Path, *lines: str, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_requests_in_order_skipping_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD, "", "   ", '{"timestamp": 27.5, "hash_ids": [0, 1, 7]}', '{"hash_ids": [9]}')
    trace = read_trace(path)
    assert trace.path == str(path)
    assert trace.requests == (
        TraceRequest((0, 1, 2), 0.0, 1500),
        TraceRequest((0, 1, 7), 27.5, None),
        TraceRequest((9,), None, None),
    )
    assert trace.total_blocks == 7
    assert trace.distinct_blocks() == 5


def test_a_last_line_without_newline_and_crlf_endings_are_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"hash_ids": [1]}\r\n{"hash_ids": [2, 3]}')
    assert [r.hash_ids for r in read_trace(path).requests] == [(1,), (2, 3)]


@pytest.mark.parametrize(("line", "what"), [
    ('{"hash_ids": [1, 2', "not JSON"),
    ("hash_ids: [1]", "not JSON"),
    ("[1, 2, 3]", "expected a JSON object, got list"),
    ('"text"', "expected a JSON object, got str"),
    ('{"timestamp": 3}', "no 'hash_ids'"),
    ('{"hash_ids": []}', "'hash_ids' is empty"),
    ('{"hash_ids": 5}', "'hash_ids' must be a list"),
    ('{"hash_ids": null}', "'hash_ids' must be a list"),
    ('{"hash_ids": [1, "2"]}', 'hash_ids[1] must be a non-negative integer, got "2"'),
    ('{"hash_ids": [1, 2.5]}', "hash_ids[1] must be a non-negative integer, got 2.5"),
    ('{"hash_ids": [1.0]}', "hash_ids[0] must be a non-negative integer, got 1.0"),
    ('{"hash_ids": [true]}', "hash_ids[0] must be a non-negative integer, got true"),
    ('{"hash_ids": [0, -4]}', "hash_ids[1] must be a non-negative integer, got -4"),
    ('{"hash_ids": [[1]]}', "hash_ids[0] must be a non-negative integer, got [1]"),
    ('{"hash_ids": [1], "timestamp": "now"}', "'timestamp' must be a non-negative number"),
    ('{"hash_ids": [1], "timestamp": -1}', "'timestamp' must be a non-negative number"),
    ('{"hash_ids": [1], "input_length": 1.5}', "'input_length' must be a non-negative integer"),
])
def test_a_malformed_line_names_the_file_and_its_line_number(tmp_path: Path, line: str, what: str) -> None:
    path = write(tmp_path, GOOD, "", line, GOOD)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}: line 3: ")
    assert what in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_a_deeply_nested_line_is_a_trace_error(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(TraceError, match=r": line 2: "):
        read_trace(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"hash_ids": [1]}\n{"hash_ids": [2]}\xff\n')
    with pytest.raises(TraceError, match=r": line 2: not UTF-8"):
        read_trace(path)


def test_a_missing_file_or_a_directory_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"cannot read trace .*nope.jsonl: No such file"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match=r"cannot read trace .*: Is a directory"):
        read_trace(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_a_trace_error(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    path.chmod(0)
    with pytest.raises(TraceError, match=r"cannot read trace .*: Permission denied"):
        read_trace(path)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_trace_is_a_trace_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=r"has no requests"):
        read_trace(path)
