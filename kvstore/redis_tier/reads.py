"""The get path: manifests read and checked before any chunk, chunks read in bounded rounds, damaged values removed.

A damaged value (a key of the wrong type, a header that contradicts itself, chunks that do not add up) reads as
``b""`` and is removed by a script that deletes only what was read; a value with a chunk missing (Redis evicted it)
reads as a miss and is counted out. See docs/storage.md ("Redis tier", Damage).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis.exceptions as rex

from kvshelf.kvstore.redis_tier.connection import _UNAVAILABLE, Client, _readable
from kvshelf.kvstore.redis_tier.layout import (
    _CHUNKED,
    _DROP_DAMAGED,
    _HEADER,
    _INLINE,
    _ROUND_BYTES,
    _ROUND_COMMANDS,
    _Damage,
    _Manifest,
    read_manifest,
)

log = logging.getLogger(__package__)


class _ChunkRead:
    """The chunks of one value being read (``GET``) or measured (``STRLEN``) round by round."""

    __slots__ = ("done", "got", "keys", "manifest", "next", "parts", "result")

    def __init__(self, keys: Callable[[int], str], manifest: _Manifest) -> None:
        self.keys = keys
        self.manifest = manifest
        self.next = 0  # the next chunk to ask for
        self.got = 0  # bytes (or lengths) received so far
        self.parts: list[bytes] = []
        self.done = False
        self.result: Any = None

    def finish(self, result: Any) -> None:
        self.done, self.result, self.parts = True, result, []


class Reads:
    """``get_many``, ``prefix_run_length`` and what they share (a mixin of ``RedisTier``)."""

    def _manifest(self, raw: bytes | BaseException | None, *, whole: bool) -> _Manifest | _Damage | None:
        return read_manifest(_readable(raw), self.max_value_bytes, whole=whole)

    def _read_chunks(self, client: Client, values: Sequence[tuple[bytes, _Manifest]], *, lengths: bool) -> list[Any]:
        """Each chunked value's chunks, in rounds of at most ``_ROUND_COMMANDS`` commands and about
        ``_ROUND_BYTES`` bytes: with ``lengths``, ``STRLEN`` (the value's chunk lengths add up: ``True``), else
        ``GET`` (the value's bytes). ``None`` where a chunk is missing (the read of that value stops there);
        ``_Damage`` where a chunk is of the wrong type, empty, or the chunks do not add up."""
        reads = [_ChunkRead(self._chunk_key_fn(key, manifest), manifest) for key, manifest in values]
        active = list(reads)
        while active:
            pipe = self._pipeline(client)
            plan: list[tuple[_ChunkRead, int]] = []
            budget_bytes = _ROUND_BYTES
            for read in active:
                chunk = read.manifest.chunk_size
                while read.next < read.manifest.chunks and len(plan) < _ROUND_COMMANDS and (
                        not plan or lengths or budget_bytes >= chunk):
                    name = read.keys(read.next)
                    pipe.strlen(name) if lengths else pipe.get(name)
                    plan.append((read, read.next))
                    read.next += 1
                    budget_bytes -= chunk
                if len(plan) >= _ROUND_COMMANDS or (not lengths and budget_bytes < chunk):
                    break
            for (read, index), reply in zip(plan, pipe.execute(raise_on_error=False), strict=True):
                if read.done:
                    continue
                reply = _readable(reply)
                if isinstance(reply, BaseException):
                    read.finish(_Damage(f"chunk {index}: {reply}", None, read.manifest))
                elif reply is None or (lengths and reply == 0):
                    read.finish(None)  # missing: evicted, or a write cut short
                elif not lengths and len(reply) == 0:
                    read.finish(_Damage(f"chunk {index} is empty", None, read.manifest))
                else:
                    read.got += int(reply) if lengths else len(reply)
                    if read.got > read.manifest.total:
                        read.finish(_Damage(f"chunks longer than the {read.manifest.total} bytes declared", None,
                                            read.manifest))
                    elif not lengths:
                        read.parts.append(reply)
            for read in active:
                if not read.done and read.next == read.manifest.chunks:
                    if read.got != read.manifest.total:
                        read.finish(_Damage(f"chunks of {read.got} bytes, {read.manifest.total} declared", None,
                                            read.manifest))
                    else:
                        read.finish(True if lengths else b"".join(read.parts))
            active = [read for read in active if not read.done]
        return [read.result for read in reads]

    def _heal(self, client: Client, damaged: Sequence[tuple[bytes, _Damage]]) -> None:
        """Remove damaged values, each only if it is still what was read (a put may have replaced it since)."""
        for key, damage in damaged:
            name = self._manifest_key(key)
            manifest = damage.manifest
            seen = manifest.pack() if manifest is not None else damage.seen
            try:
                if seen is None:
                    dropped = client.eval(_DROP_DAMAGED, 1, name, "type", "")
                else:
                    dropped = client.eval(_DROP_DAMAGED, 1, name, "bytes", seen)
            except rex.ResponseError as exc:
                if isinstance(exc, _UNAVAILABLE):
                    raise
                log.warning("Redis tier %s: cannot remove damaged value %s (%s): %s", self.name, key.hex(),
                            damage.reason, exc)
                continue
            if not dropped:
                continue
            log.warning("Redis tier %s: removed damaged value %s: %s", self.name, key.hex(), damage.reason)
            if manifest is not None:  # a sound manifest: its chunks are known, and it was counted when written
                self._account(client, [self._op("x", key, manifest)])
                self._execute(client, (lambda p, c=c: p.delete(c) for c in self._chunk_keys(key, manifest)))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys``: ``None`` where absent or a chunk is missing (Redis evicted it: the value is counted
        out, reported as an eviction, and what is left of it removed), ``b""`` where damaged (removed)."""
        if not keys:
            return []

        def fn(client: Client) -> tuple[list[bytes | None], list[bytes]]:
            pipe = self._pipeline(client)
            for key in keys:
                pipe.get(self._manifest_key(key))
            raws = pipe.execute(raise_on_error=False)
            out: list[bytes | None] = [None] * len(keys)
            wanted: list[tuple[int, bytes, _Manifest]] = []
            damaged: list[tuple[bytes, _Damage]] = []
            for i, (key, raw) in enumerate(zip(keys, raws, strict=True)):
                manifest = self._manifest(raw, whole=True)
                if manifest is None:
                    continue
                if isinstance(manifest, _Damage):
                    out[i] = b""
                    damaged.append((key, manifest))
                elif manifest.kind == _INLINE:
                    out[i] = raw[_HEADER.size:]
                else:
                    wanted.append((i, key, manifest))
            broken: list[tuple[bytes, _Manifest]] = []
            if wanted:
                values = self._read_chunks(client, [(key, m) for _, key, m in wanted], lengths=False)
                for (i, key, manifest), value in zip(wanted, values, strict=True):
                    if isinstance(value, _Damage):
                        out[i] = b""
                        damaged.append((key, value))
                    elif value is None:
                        broken.append((key, manifest))
                    else:
                        out[i] = value
            if damaged:
                self._heal(client, damaged)
            return out, self._lost(client, broken)

        out, evicted = self._run("get", fn)
        self._report(evicted)
        return out

    def _headers(self, client: Client, keys: Sequence[bytes]) -> list[_Manifest | _Damage | None]:
        """The manifest headers of ``keys`` (``GETRANGE``: the inline data is not transferred)."""
        replies = self._execute(client, (lambda p, k=key: p.getrange(self._manifest_key(k), 0, _HEADER.size - 1)
                                         for key in keys))
        return [self._manifest(raw, whole=False) for raw in replies]

    def prefix_run_length(self, keys: Sequence[bytes]) -> int:
        """The leading run of ``keys`` whose manifest is present and sound and whose chunks add up to the value's
        length (``STRLEN`` of each chunk: no chunk data is transferred). A damaged value found is removed; one with a
        chunk missing is counted out and removed (as ``get_many`` does)."""
        if not keys:
            return 0

        def fn(client: Client) -> tuple[int, list[bytes]]:
            damaged: list[tuple[bytes, _Damage]] = []
            broken: list[tuple[bytes, _Manifest]] = []
            sound: list[_Manifest] = []
            for key, manifest in zip(keys, self._headers(client, keys), strict=True):
                if not isinstance(manifest, _Manifest):
                    if manifest is not None:
                        damaged.append((key, manifest))
                    break
                sound.append(manifest)
            run = len(sound)
            chunked = [i for i, manifest in enumerate(sound) if manifest.kind == _CHUNKED]
            if chunked:
                results = self._read_chunks(client, [(keys[i], sound[i]) for i in chunked], lengths=True)
                for i, result in zip(chunked, results, strict=True):
                    if isinstance(result, _Damage):
                        damaged.append((keys[i], result))
                    elif result is None:
                        broken.append((keys[i], sound[i]))
                    if result is not True:
                        run = min(run, i)  # a chunk is missing or damaged: the value is absent
            if damaged:
                self._heal(client, damaged)
            return run, self._lost(client, broken)

        run, evicted = self._run("contains", fn)
        self._report(evicted)
        return run
