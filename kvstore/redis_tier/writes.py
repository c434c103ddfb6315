"""The put path: each value's chunks first, its manifest last (``SET ... GET``, learning the value it replaces),
then the usage registry, then the replaced value's chunks dropped.

Each write uses a fresh generation, so an overwrite never mixes chunks of two values, and a reader never sees a
manifest before its chunks (same slot, same connection: Redis applies them in order). See docs/storage.md
("Redis tier").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from kvshelf.kvstore.redis_tier.connection import _UNAVAILABLE, Client, _is_data_error
from kvshelf.kvstore.redis_tier.layout import _CHUNKED, _INLINE, _Manifest, read_manifest

log = logging.getLogger(__package__)


class _Write:
    """One value being written: its key, the chunk keys of its new generation (none for an inline value), the
    manifest as written (bytes, and decoded), and Redis's replies to its commands (the chunks' ``SET``, then the
    manifest's ``SET ... GET``)."""

    __slots__ = ("chunk_keys", "key", "manifest", "payload", "replies")

    def __init__(self, key: bytes, chunk_keys: list[str], payload: bytes | memoryview, manifest: _Manifest) -> None:
        self.key, self.chunk_keys, self.payload, self.manifest = key, chunk_keys, payload, manifest
        self.replies: list[Any] = []

    @property
    def commands(self) -> int:
        return len(self.chunk_keys) + 1


class _PutOutcome:
    """What a put learned from Redis's replies: how many values it stored, the usage registry's changes
    (``kvstore.redis_tier.usage``), the chunk keys to remove once the registry knows, the writes whose manifest name
    holds a key of another type (to replace), and an error Redis refused a write with."""

    __slots__ = ("dropped", "ops", "refused", "replace", "stored")

    def __init__(self) -> None:
        self.stored = 0
        self.ops: list[tuple[str, str, int, int]] = []
        self.dropped: list[str] = []
        self.replace: list[_Write] = []
        self.refused: BaseException | None = None


class Writes:
    """``put_many`` and its steps (a mixin of ``RedisTier``)."""

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Write each value's chunks, then its manifest (with ``SET ... GET`` to learn the value it replaces),
        then update the usage registry, then drop the replaced value's chunks. Returns how many Redis took
        (a value Redis refuses, e.g. OOM under ``noeviction``, or one over ``max_value_bytes``, is not stored).
        A key of another type at the manifest's name is replaced."""
        if not items:
            return 0
        too_large = sum(1 for _, value in items if len(value) > self.max_value_bytes)
        if too_large:
            log.warning("Redis tier %s: %d values over the %d-byte value limit not stored", self.name, too_large,
                        self.max_value_bytes)
            items = [(key, value) for key, value in items if len(value) <= self.max_value_bytes]
            if not items:
                return 0

        self._check_evictions()
        return self._run("put", lambda client: self._put(client, items))

    def _put(self, client: Client, items: Sequence[tuple[bytes, bytes]]) -> int:
        """``put_many`` on one connection: send, read the replies, replace keys of another type, then account and
        drop what is no longer named."""
        outcome = self._settle(self._send(client, items))
        if outcome.replace:
            self._replace_wrong_type(client, outcome)
        self._finish_put(client, outcome)
        return outcome.stored

    def _send(self, client: Client, items: Sequence[tuple[bytes, bytes]]) -> list[_Write]:
        """One pipeline: each value's chunks (a fresh generation), then its manifest with ``SET ... GET`` (last: the
        value is now visible). Each write comes back with its replies, errors included."""
        pipe = self._pipeline(client)
        writes: list[_Write] = []
        for key, value in items:
            size = len(value)
            if size <= self.chunk_bytes:
                manifest = _Manifest(_INLINE, os.urandom(8), 0, size)
                payload = manifest.pack() + value
                pipe.set(self._manifest_key(key), payload, get=True)
                writes.append(_Write(key, [], payload, manifest))
                continue
            count = -(-size // self.chunk_bytes)
            manifest = _Manifest(_CHUNKED, os.urandom(8), count, size)
            chunk_keys = list(self._chunk_keys(key, manifest))
            view = memoryview(value)
            for n, chunk_key in enumerate(chunk_keys):
                pipe.set(chunk_key, view[n * self.chunk_bytes:(n + 1) * self.chunk_bytes])
            payload = manifest.pack()
            pipe.set(self._manifest_key(key), payload, get=True)  # last: the value is now visible
            writes.append(_Write(key, chunk_keys, payload, manifest))
        results = iter(pipe.execute(raise_on_error=False))
        for write in writes:
            write.replies = [next(results) for _ in range(write.commands)]
        return writes

    def _settle(self, writes: Sequence[_Write]) -> _PutOutcome:
        """The outcome of each write from its replies: stored (counted in), refused (its own chunks dropped), or
        blocked by a key of another type at the manifest's name (to replace). A value it replaced is counted out and
        its chunks dropped. An "unreachable" reply is raised."""
        outcome = _PutOutcome()
        for write in writes:
            replies = write.replies
            errors = [r for r in replies if isinstance(r, BaseException)]
            for error in errors:
                if isinstance(error, _UNAVAILABLE):
                    raise error
            if errors and len(errors) == 1 and _is_data_error(replies[-1]):
                # SET ... GET on a key of another type sets nothing: replace that key below
                outcome.replace.append(write)
                continue
            if errors:
                outcome.refused = errors[0]
                outcome.dropped.extend(write.chunk_keys)  # this write's own generation: nobody else uses these keys
            old_raw = replies[-1]
            old = None if isinstance(old_raw, BaseException) else read_manifest(
                old_raw, self.max_value_bytes, whole=True)
            if isinstance(old, _Manifest):  # replaced (or, when a chunk was refused, broken): count it out
                outcome.ops.append(self._op("-", write.key, old))
                outcome.dropped.extend(self._chunk_keys(write.key, old))
            # else: nothing, or not a value of ours (nothing of it to drop or count out)
            if not errors:
                outcome.ops.append(self._op("+", write.key, write.manifest))
                outcome.stored += 1
        return outcome

    def _replace_wrong_type(self, client: Client, outcome: _PutOutcome) -> None:
        """The manifests whose name held a key of another type: that key deleted and the manifest set (a plain
        ``SET``: there is no value of ours to learn), each counted in, or refused (its chunks dropped)."""
        pipe = self._pipeline(client)
        for write in outcome.replace:
            pipe.delete(self._manifest_key(write.key))
            pipe.set(self._manifest_key(write.key), write.payload)
        replies = iter(pipe.execute(raise_on_error=False))
        for write in outcome.replace:
            _, reply = next(replies), next(replies)
            if isinstance(reply, _UNAVAILABLE):
                raise reply
            if isinstance(reply, BaseException):
                outcome.refused = reply
                outcome.dropped.extend(write.chunk_keys)
                continue
            log.warning("Redis tier %s: replaced a key of the wrong type at value %s", self.name, write.key.hex())
            outcome.ops.append(self._op("+", write.key, write.manifest))
            outcome.stored += 1

    def _finish_put(self, client: Client, outcome: _PutOutcome) -> None:
        """Warn of a refused write, apply the registry's changes, then remove the chunks no manifest names now."""
        if outcome.refused is not None:
            self._warn_refused(outcome.refused)
        self._account(client, outcome.ops)  # before the chunks go: a reconciliation never sees them gone uncounted
        self._execute(client, (lambda p, c=c: p.delete(c) for c in outcome.dropped))
