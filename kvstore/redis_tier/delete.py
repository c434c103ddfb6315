"""The delete path: ``delete`` (``GETDEL`` of manifests, then accounting, then ``UNLINK`` of chunks), ``delete_prefix``
(the server's Clear) and the SCAN-based key listings.

A namespace's values are found by a ``SCAN`` whose ``MATCH`` names the namespace tag's hex, ``clear_scan_count``
slots a call; each page found is removed at once. See docs/storage.md ("Redis tier", Clearing a namespace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import redis.cluster

from kvshelf.kvstore.redis_tier.connection import Client
from kvshelf.kvstore.redis_tier.layout import CLEAR_BATCH, _Damage, _glob_escape, _Manifest
from kvshelf.kvstore.redis_tier.usage import entry_field


class Delete:
    """``delete``, ``delete_prefix``, ``keys`` and ``keys_with_prefix`` (a mixin of ``RedisTier``)."""

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove manifests first (the values vanish at once), then their chunks; return how many existed
        (keys of another type at a manifest's name included: they are removed too).

        ``GETDEL`` removes each manifest and returns the one it removed in one atomic step, so a put racing the
        delete of the same key is wholly before or after it: its chunks and the usage counters stay right.
        """
        keys = list(keys)
        if not keys:
            return 0
        return len(self._run("delete", lambda client: self._delete_keys(client, keys)))

    def _delete_keys(self, client: Client, keys: Sequence[bytes]) -> list[tuple[bytes, _Manifest | None]]:
        """``delete`` on one connection: the keys that existed (their manifests removed, counted out, chunks
        unlinked), each with its manifest (``None``: damaged)."""
        pipe = self._pipeline(client)
        for key in keys:
            pipe.getdel(self._manifest_key(key))
        deleted = pipe.execute(raise_on_error=False)
        removed: list[tuple[bytes, _Manifest | None]] = []
        ops: list[tuple[str, str, int, int]] = []
        chunk_keys: list[Iterator[str]] = []
        damaged: list[tuple[bytes, _Damage]] = []
        for key, raw in zip(keys, deleted, strict=True):
            manifest = self._manifest(raw, whole=True)
            if manifest is None:
                continue
            removed.append((key, manifest if isinstance(manifest, _Manifest) else None))
            if isinstance(manifest, _Damage):
                if manifest.seen is None:  # GETDEL refused a key of another type: remove it so
                    damaged.append((key, manifest))
                continue
            ops.append(self._op("-", key, manifest))
            chunk_keys.append(self._chunk_keys(key, manifest))
        if damaged:
            self._heal(client, damaged)
        self._account(client, ops)  # before the chunks go: a reconciliation never sees them gone uncounted
        # UNLINK: Redis frees a large chunk in a background thread instead of blocking on it
        self._execute(client, (lambda p, c=c: p.unlink(c) for names in chunk_keys for c in names))
        return removed

    def delete_prefix(self, prefix: bytes, length: int | None = None) -> list[bytes]:
        """Remove every value whose key starts with ``prefix`` (the service's namespace tag) and is ``length`` bytes
        long when given, and whatever Redis left of such values; return the keys of the values removed.

        One ``SCAN`` whose ``MATCH`` names the prefix's hex (Redis filters: only the namespace's own keys come back,
        ``CLEAR_SCAN_COUNT`` slots a call, so no call blocks Redis for long), on every primary of a Cluster. Each page
        of manifests found is removed at once as ``delete`` does (``GETDEL``, accounting, ``UNLINK`` of chunks). Chunks
        no manifest of theirs names (Redis evicted the manifest; a writer died) are counted out if still counted,
        and unlinked. Redis still walks its whole keyspace (SCAN has no index): what grows with the other
        namespaces is Redis-side time only (measured by ``kvshelf bench clear``), no round trip of their keys or
        per-key work here. A value of the prefix written during the clear may survive it, or lose a chunk (a miss),
        as with any delete racing a put."""
        pattern = self._prefix_pattern(prefix, length, "*")

        def fn(client: Client) -> list[bytes]:
            removed: list[tuple[bytes, _Manifest | None]] = []
            page: list[bytes] = []
            chunks: dict[tuple[bytes, bytes], list[bytes]] = {}  # (key, generation) -> chunk names seen
            for key, suffix, name in self._parse_all(self._scan(client, pattern, count=self.clear_scan_count)):
                if not key.startswith(prefix) or (length is not None and len(key) != length):
                    continue
                if suffix == b"m":
                    page.append(key)
                    if len(page) >= CLEAR_BATCH:
                        removed += self._delete_keys(client, page)
                        page = []
                else:
                    generation = suffix.split(b":", 1)[0]
                    with contextlib.suppress(ValueError):
                        chunks.setdefault((key, bytes.fromhex(generation.decode("ascii", "replace"))), []).append(name)
            if page:
                removed += self._delete_keys(client, page)
            gone = {(key, m.generation) for key, m in removed if isinstance(m, _Manifest)}
            self._drop_orphans(client, {group: names for group, names in chunks.items() if group not in gone})
            return [key for key, _ in removed]

        return self._run("clear", fn)

    def _prefix_pattern(self, prefix: bytes, length: int | None, suffix: str) -> str:
        """The SCAN pattern of the Redis names of keys starting with ``prefix`` (of ``length`` bytes when given),
        ``suffix`` after the hash tag's ``}`` (``:m``: manifests; ``*``: manifests and chunks)."""
        rest = "*}" if length is None else "??" * (length - len(prefix)) + "}"
        return "{" + _glob_escape(self.prefix + prefix.hex()) + rest + suffix

    def keys_with_prefix(self, prefix: bytes, length: int | None = None) -> list[bytes]:
        """The keys with a manifest starting with ``prefix`` (``length`` bytes long when given): one SCAN matching
        the prefix's hex (Redis filters; on Cluster, every primary), ``clear_scan_count`` slots a call."""
        pattern = self._prefix_pattern(prefix, length, ":m")

        def fn(client: Client) -> list[bytes]:
            return [key for key in self._parse_names(self._scan(client, pattern, count=self.clear_scan_count))
                    if key.startswith(prefix) and (length is None or len(key) == length)]

        return self._run("keys", fn)

    def _drop_orphans(self, client: Client, groups: dict[tuple[bytes, bytes], list[bytes]]) -> None:
        """Chunks found by a clear whose value it did not remove: those whose manifest is absent or names another
        generation are counted out (``x``: only if still counted in) and unlinked; a value whose manifest is there
        (written while the clear ran) is left."""
        if not groups:
            return
        items = list(groups.items())
        headers = self._headers(client, [key for (key, _), _ in items])
        ops, names = [], []
        for ((key, generation), chunk_names), header in zip(items, headers, strict=True):
            if isinstance(header, _Manifest) and header.generation == generation:
                continue
            ops.append(("x", entry_field(key, generation), 0, 0))
            names += chunk_names
        self._account(client, ops)
        self._execute(client, (lambda p, c=c: p.unlink(c) for c in names))

    def _scan(self, client: Client, match: str, count: int = 1000) -> Iterator[bytes]:
        if isinstance(client, redis.cluster.RedisCluster):
            return client.scan_iter(match=match, count=count, target_nodes=redis.cluster.RedisCluster.PRIMARIES)
        return client.scan_iter(match=match, count=count)

    def _parse_all(self, names: Iterable[bytes]) -> Iterator[tuple[bytes, bytes, bytes]]:
        """``(key, suffix, name)`` of Redis key names ``{<prefix><hex>}:<suffix>`` (names not of this layout
        skipped): suffix ``m`` for a manifest, ``<generation hex>:<i>`` for a chunk."""
        start = 1 + len(self.prefix.encode())
        for name in names:
            end = name.find(b"}:", start)
            if end < 0:
                continue
            try:
                yield bytes.fromhex(name[start:end].decode("ascii", "replace")), name[end + 2:], name
            except ValueError:
                continue

    def _parse_names(self, names: Iterable[bytes]) -> Iterator[bytes]:
        """The keys of manifest names ``{<prefix><hex>}:m`` (names not of this tier's layout skipped: a prefix that
        is a prefix of another tier's)."""
        return (key for key, suffix, _ in self._parse_all(names) if suffix == b"m")

    def _keys(self, client: Client) -> list[bytes]:
        return list(self._parse_names(self._scan(client, "{" + _glob_escape(self.prefix) + "*}:m")))

    def keys(self) -> list[bytes]:
        """Every key with a manifest (SCAN by prefix; on Cluster, every primary). May be slow on large tiers."""
        return self._run("keys", self._keys)
