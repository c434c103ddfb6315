"""The key layout of a value in Redis, its manifest header, the limits a reader trusts, and the damage script.

A value is stored under keys sharing one hash tag ``{<prefix><hex key>}`` (one Cluster slot): ``...:m`` is the
manifest (a 25-byte header, then an inline value of at most ``chunk_bytes``), ``...:<generation hex>:<i>`` chunk ``i``
of a larger value. See docs/storage.md ("Redis tier").
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: magic, kind, generation, chunk count, total length
_HEADER = struct.Struct("<4sB8sIQ")
_MAGIC = b"kvR1"
_INLINE, _CHUNKED = 0, 1

#: the chunk sizes a writer may use (``chunk_bytes``); a manifest implying chunks outside them is damaged
MIN_CHUNK_BYTES = 1 * KiB
MAX_CHUNK_BYTES = 512 * MiB  # Redis's largest string (proto-max-bulk-len)
#: the largest value a tier stores and reads by default (``max_value_bytes``)
DEFAULT_MAX_VALUE_BYTES = 1 * GiB
#: one round trip of chunk reads: at most this many commands and about this many bytes
_ROUND_COMMANDS = 256
_ROUND_BYTES = 64 * MiB
#: ``delete_prefix``: slots a SCAN call walks (Redis's ``COUNT`` hint), and keys removed per round
CLEAR_SCAN_COUNT = 1000
CLEAR_BATCH = 1000
#: the most chunk keys removed of one value found broken, and checked (EXISTS) by a reconciliation
_DROP_CHUNKS = 4096
#: at most one "Redis refused writes" warning this often (seconds)
_WARN_EVERY_S = 30.0

#: deletes KEYS[1] only if it is still the damaged thing a reader saw: ARGV[1] "type": a key of a type other than
#: string; "bytes": a string starting with ARGV[2]. Returns 1 when it deleted.
_DROP_DAMAGED = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if ARGV[1] == 'type' then
  if t == 'string' then return 0 end
elseif t ~= 'string' or redis.call('GETRANGE', KEYS[1], 0, #ARGV[2] - 1) ~= ARGV[2] then
  return 0
end
return redis.call('DEL', KEYS[1])
"""


class _Manifest:
    """The decoded manifest header of one value."""

    __slots__ = ("chunks", "generation", "kind", "total")

    def __init__(self, kind: int, generation: bytes, chunks: int, total: int) -> None:
        self.kind, self.generation, self.chunks, self.total = kind, generation, chunks, total

    def pack(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.kind, self.generation, self.chunks, self.total)

    @property
    def chunk_size(self) -> int:
        """The smallest chunk size that cuts ``total`` into ``chunks`` chunks (a chunked manifest)."""
        return -(-self.total // self.chunks)


class _Damage:
    """A damaged manifest or value, and what was seen of it (so that only that is removed)."""

    __slots__ = ("manifest", "reason", "seen")

    def __init__(self, reason: str, seen: bytes | None, manifest: _Manifest | None = None) -> None:
        self.reason = reason
        self.seen = seen  # the manifest's first bytes; None: the manifest key is of the wrong type
        self.manifest = manifest  # a sound manifest whose chunks are damaged


def read_manifest(raw: bytes | BaseException | None, max_value_bytes: int, *,
                  whole: bool) -> _Manifest | _Damage | None:
    """The manifest in ``raw`` (a GET or GETRANGE reply: ``whole`` says whether an inline value follows the
    header in full), ``None`` when absent, or ``_Damage`` saying why it cannot be ours."""
    if raw is None:
        return None
    if isinstance(raw, BaseException):
        return _Damage(f"manifest key: {raw}", None)
    seen = bytes(raw[:_HEADER.size])
    if len(raw) < _HEADER.size:
        return _Damage(f"manifest of {len(raw)} bytes, shorter than its {_HEADER.size}-byte header", seen)
    magic, kind, generation, chunks, total = _HEADER.unpack_from(raw)
    if magic != _MAGIC or kind not in (_INLINE, _CHUNKED):
        return _Damage(f"not a kvshelf manifest (magic {magic!r}, kind {kind})", seen)
    if total > max_value_bytes:
        return _Damage(f"declares {total} bytes, over the {max_value_bytes}-byte value limit", seen)
    manifest = _Manifest(kind, generation, chunks, total)
    if kind == _INLINE:
        if chunks != 0:
            return _Damage(f"inline value declaring {chunks} chunks", seen)
        if whole and len(raw) - _HEADER.size != total:
            return _Damage(f"inline value of {len(raw) - _HEADER.size} bytes, its header says {total}", seen)
        return manifest
    # a chunked value is longer than the writer's chunk size c, cut into ceil(total / c) non-empty chunks:
    # the sizes c that give `chunks` chunks are [ceil(total / chunks), ceil(total / (chunks - 1)) - 1]
    if chunks < 2 or total < chunks:
        return _Damage(f"chunked value of {total} bytes in {chunks} chunks", seen)
    low, high = -(-total // chunks), -(-total // (chunks - 1)) - 1
    if max(low, MIN_CHUNK_BYTES) > min(high, MAX_CHUNK_BYTES):
        return _Damage(f"{total} bytes cannot be cut into {chunks} chunks of {MIN_CHUNK_BYTES} to "
                       f"{MAX_CHUNK_BYTES} bytes", seen)
    return manifest


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class KeyLayout:
    """The Redis names of one tier's values (a mixin of ``RedisTier``: ``prefix`` and ``max_value_bytes`` are its)."""

    prefix: str
    max_value_bytes: int

    def _tag(self, key: bytes) -> str:
        return f"{{{self.prefix}{key.hex()}}}"

    def _manifest_key(self, key: bytes) -> str:
        return self._tag(key) + ":m"

    def _chunk_key_fn(self, key: bytes, manifest: _Manifest) -> Callable[[int], str]:
        base = f"{self._tag(key)}:{manifest.generation.hex()}:"
        return lambda i: base + str(i)

    def _chunk_keys(self, key: bytes, manifest: _Manifest) -> Iterator[str]:
        """The chunk keys of a sound manifest, lazily (a damaged one's chunk count is never trusted)."""
        if manifest.kind != _CHUNKED:
            return iter(())
        name = self._chunk_key_fn(key, manifest)
        return (name(i) for i in range(manifest.chunks))


    def _names(self, key: bytes, manifest: _Manifest) -> list[str]:
        return [self._manifest_key(key), *self._chunk_keys(key, manifest)]
