"""The inner framing every compressing codec uses for its payload: length-prefixed sections plus a CRC-32.

Layout (little-endian)::

    b"KC" | version: u8 | sections: u8 | length of each section: u64 * sections | sections... | crc32: u32

The outer block format (``kvstore.encoding``) has its own checksum; this one lets a codec reject a damaged or
truncated payload handed to ``decode`` directly, and validates every section's length before any tensor is
built. CRC-32 is ``zlib.crc32`` (stable everywhere; never Python's ``hash``).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

from kvshelf.kvstore.errors import CorruptBlockError

_MAGIC = b"KC"
_VERSION = 1
_HEAD = struct.Struct("<2sBB")
_CRC = struct.Struct("<I")


def frame_bytes(count: int) -> int:
    """Bytes the frame of ``count`` sections adds around them (magic, version, count, lengths, CRC)."""
    return _HEAD.size + 8 * count + _CRC.size


def pack_sections(sections: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """Frame ``sections`` (at most 255); return buffers to concatenate (the sections are not copied)."""
    if len(sections) > 255:
        raise ValueError("at most 255 sections")
    head = _HEAD.pack(_MAGIC, _VERSION, len(sections)) + struct.pack(
        f"<{len(sections)}Q", *(len(s) for s in sections)
    )
    crc = zlib.crc32(head)
    for section in sections:
        crc = zlib.crc32(section, crc)
    return [head, *sections, _CRC.pack(crc)]


def unpack_sections(payload: memoryview | bytes, count: int, codec: str, *, verified: bool = False
                    ) -> list[memoryview]:
    """Check the framing and CRC of ``payload``; return its ``count`` sections as views (no copy).

    Raises ``CorruptBlockError`` naming ``codec`` on a bad magic, version, section count, length or CRC.
    ``verified``: the payload's bytes were just checked by the block's own checksum (``kvstore.encoding``'s xxh3
    over the whole value): the CRC is not computed again (the framing and lengths still are). The CRC pass cost
    more than the host-to-device copy int8 saves (docs/benchmarks.md, "GPU").
    """
    view = memoryview(payload).cast("B") if not isinstance(payload, memoryview) else payload
    table = _HEAD.size + 8 * count
    if len(view) < table + _CRC.size:
        raise CorruptBlockError(f"{codec} payload truncated: {len(view)} bytes")
    magic, version, n = _HEAD.unpack_from(view, 0)
    if magic != _MAGIC or version != _VERSION or n != count:
        raise CorruptBlockError(f"{codec} payload has a bad frame (magic {bytes(magic)!r}, v{version}, {n} sections)")
    lengths = struct.unpack_from(f"<{count}Q", view, _HEAD.size)
    if table + sum(lengths) + _CRC.size != len(view):
        raise CorruptBlockError(f"{codec} payload is {len(view)} bytes, its sections say {table + sum(lengths) + 4}")
    body_end = len(view) - _CRC.size
    if not verified and zlib.crc32(view[:body_end]) != _CRC.unpack_from(view, body_end)[0]:
        raise CorruptBlockError(f"{codec} payload checksum mismatch")
    out, pos = [], table
    for length in lengths:
        out.append(view[pos : pos + length])
        pos += length
    return out


def expect_len(section: memoryview, expected: int, what: str, codec: str) -> memoryview:
    """``section`` itself if it is ``expected`` bytes long, else ``CorruptBlockError``."""
    if len(section) != expected:
        raise CorruptBlockError(f"{codec} payload: {what} is {len(section)} bytes, expected {expected}")
    return section
