"""Fuzz target of the vLLM KV event replay request parser (``kvstore/vllm_events_replay.py``,
``parse_replay_request``).

``check_request(raw)``: ``raw`` is read as a request's frames (``frames_of``: a length-prefixed list, as ZeroMQ hands
a ROUTER the frames of one message); ``parse_replay_request`` returns ``(start, topic)`` exactly when the frames are
an optional empty delimiter, an 8-byte start and at most one topic of ``MAX_TOPIC_BYTES``, else None, and never
raises.

The test suite runs it through hypothesis, beside random frames sent to a real publisher's ROUTER
(``tests/kvstore/test_vllm_events_abuse.py``); for a long run with coverage guidance::

    pip install atheris
    python tests/support/fuzz_replay.py -max_total_time=600

Without atheris the script runs a seeded random mutation loop instead (``python tests/support/fuzz_replay.py
[rounds]``).
"""

from __future__ import annotations

from fuzz_driver import fuzz_main

from kvshelf.kvstore import vllm_events_replay
from kvshelf.kvstore.vllm_events_replay import MAX_TOPIC_BYTES, parse_replay_request


def encode_frames(frames: list[bytes]) -> bytes:
    """``frames`` as the fuzz input: each a 2-byte big-endian length, then its bytes."""
    return b"".join(len(frame).to_bytes(2, "big") + frame for frame in frames)


def frames_of(raw: bytes) -> list[bytes]:
    """The frames ``raw`` encodes (``encode_frames``); a cut-off last frame is kept as what is there."""
    frames, pos = [], 0
    while pos + 2 <= len(raw):
        size = int.from_bytes(raw[pos:pos + 2], "big")
        frames.append(raw[pos + 2:pos + 2 + size])
        pos += 2 + size
    return frames


#: requests the fallback loop mutates: vLLM's (no topic), a REQ client's, kvshelf's with a topic, malformed ones
SEEDS: tuple[bytes, ...] = (
    encode_frames([b"", bytes(8)]),
    encode_frames([(5).to_bytes(8, "big")]),
    encode_frames([b"", (7).to_bytes(8, "big"), b"kv.tenant-a"]),
    encode_frames([b"", b"short"]),
    encode_frames([b"", bytes(8), b"topic", b"extra"]),
)


def check_request(raw: bytes) -> None:
    """Assert that ``parse_replay_request`` reads ``frames_of(raw)`` as the module docstring says."""
    frames = frames_of(raw)
    parsed = parse_replay_request(frames)
    body = frames[1:] if frames and frames[0] == b"" else frames
    valid = 1 <= len(body) <= 2 and len(body[0]) == 8 and (len(body) == 1 or len(body[1]) <= MAX_TOPIC_BYTES)
    if not valid:
        assert parsed is None, f"a malformed request was read: {frames!r}"
        return
    assert parsed == (int.from_bytes(body[0], "big"), body[1] if len(body) == 2 else None), frames


def main() -> None:
    """Run atheris on ``check_request`` when it is installed, else the seeded fallback loop."""
    fuzz_main(check_request, SEEDS, vllm_events_replay, "fuzz_replay: {rounds} mutated requests read or refused "
              "cleanly (install atheris for a guided run)")


if __name__ == "__main__":
    main()
