"""Request traces for replay (``kvshelf replay``): the format of ``../shared/data/traces/README.md``.

One JSON object per line, e.g. ``{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids":
[46, 47, ..., 2354]}``: ``hash_ids`` are a request's prompt blocks in chain order (two requests sharing a prefix
share its leading ids; equal ids mean equal block content). ``hash_ids`` is required: a non-empty list of
non-negative integers. ``timestamp`` and ``input_length`` are kept when present and must then be non-negative
numbers; other fields are ignored. Blank lines are skipped. Anything else is a ``TraceError`` naming the file, the
1-based line number and what is wrong.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvshelf.kvstore.errors import TraceError


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its prompt's block ids in chain order."""

    hash_ids: tuple[int, ...]
    timestamp: float | None = None
    input_length: int | None = None


@dataclass(frozen=True)
class Trace:
    """A trace's requests in file order."""

    path: str
    requests: tuple[TraceRequest, ...]

    @property
    def total_blocks(self) -> int:
        """Block look-ups over the whole trace (the hit rate's denominator)."""
        return sum(len(r.hash_ids) for r in self.requests)

    def distinct_blocks(self) -> int:
        """How many different block ids the trace names (what a capacity fraction is a fraction of)."""
        return len({i for r in self.requests for i in r.hash_ids})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(record: dict, field: str, where: str, *, integral: bool) -> float | int | None:
    if field not in record:
        return None
    value = record[field]
    ok = _is_int(value) or (not integral and isinstance(value, float) and math.isfinite(value))
    if not ok or value < 0:
        kind = "a non-negative integer" if integral else "a non-negative number"
        raise TraceError(f"{where}: {field!r} must be {kind}, got {_short(value)}")
    return value


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_line(text: str, where: str) -> TraceRequest:
    """One trace line (not blank) -> a request; ``TraceError`` prefixed with ``where`` when it is malformed."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise TraceError(f"{where}: not JSON (nested too deeply)") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__} {_short(record)}")
    if "hash_ids" not in record:
        raise TraceError(f"{where}: no 'hash_ids' (each line needs the request's block ids)")
    ids = record["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of block ids, got {_short(ids)}")
    if not ids:
        raise TraceError(f"{where}: 'hash_ids' is empty (a request has at least one block)")
    for n, block_id in enumerate(ids):
        if not _is_int(block_id) or block_id < 0:
            raise TraceError(f"{where}: hash_ids[{n}] must be a non-negative integer, got {_short(block_id)}")
    timestamp = _number(record, "timestamp", where, integral=False)
    input_length = _number(record, "input_length", where, integral=True)
    return TraceRequest(tuple(ids), None if timestamp is None else float(timestamp), input_length)  # type: ignore[arg-type]


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Every request of the trace at ``path``; ``TraceError`` for a missing, unreadable, empty or malformed one."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw_lines = fh.read().split(b"\n")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    requests = []
    for number, raw in enumerate(raw_lines, 1):
        where = f"{path}: line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(f"{where}: not UTF-8 text (byte {exc.start + 1})") from None
        if text.strip():
            requests.append(parse_line(text, where))
    if not requests:
        raise TraceError(f"trace {path} has no requests (empty, or only blank lines)")
    return Trace(str(path), tuple(requests))


__all__ = ["Trace", "TraceError", "TraceRequest", "parse_line", "read_trace"]
