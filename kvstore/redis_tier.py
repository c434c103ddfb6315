"""Redis tier: the shared tier of several kvshelf processes or machines, on standalone Redis or Redis Cluster.

Layout. A value is stored under keys that share one hash tag, ``{<prefix><hex key>}``, so they all live in
one Cluster slot and no command ever spans slots:

* ``{<prefix><hex>}:m`` -- the manifest: a 25-byte header (magic, kind, a random 8-byte write generation,
  chunk count, total length). A value of at most ``chunk_bytes`` follows the header inline (one key, one
  round trip to read).
* ``{<prefix><hex>}:<generation hex>:<i>`` -- chunk ``i`` of a larger value, at most ``chunk_bytes`` each.

A write sends the chunks first and the manifest last (same slot, same connection: Redis applies them in
order), so a reader never sees a manifest before its chunks. Each write uses a fresh generation, so an
overwrite never mixes chunks of two values; the old generation's chunks are removed after the new manifest
is in place. A value whose chunks are missing (evicted by Redis, or a write cut short) reads as a miss and
``contains_many`` reports it absent; the next put of that key repairs it. Integrity of the bytes themselves
is the value's own checksum (``kvstore.encoding``), which the ``TieredStore`` verifies on every read.

Eviction. Redis evicts by itself; kvshelf never does. Configure the Redis server with::

    maxmemory <bytes>
    maxmemory-policy allkeys-lru

kvshelf sets no TTL on its keys, so the ``volatile-*`` policies (which only evict keys with an expiry) would
find nothing to evict and Redis would refuse writes with OOM errors once full (``noeviction`` does that too;
such a refused value is simply not stored: ``put_many`` counts it out). With ``allkeys-lru`` an evicted
chunk or manifest only makes its value a miss, never wrong data.

Usage. ``usage()`` is cheap: ``blocks`` and ``bytes`` are counters in one Redis hash
(``{<prefix>#usage}``), updated with ``HINCRBY`` by every put and delete of this tier; ``capacity_bytes`` is
Redis's ``maxmemory`` (summed over Cluster primaries; ``None`` when unlimited). Values Redis evicts on its
own are not subtracted, so under eviction the counters over-count; ``recount()`` rebuilds them with a SCAN.

Availability. The client connects lazily: constructing the tier never fails because Redis is down. Any
connection error or timeout raises ``TierUnavailableError``, which the ``TieredStore`` turns into a counted
miss (reads) or skip (writes). ``healthy()`` is a PING.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
import redis.cluster
import redis.exceptions as rex
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from kvshelf.kvstore.errors import ConfigError, TierUnavailableError
from kvshelf.kvstore.tier import Tier, TierUsage

log = logging.getLogger(__name__)
T = TypeVar("T")
MiB = 1 << 20

Client = redis.Redis | redis.cluster.RedisCluster

#: magic, kind, generation, chunk count, total length
_HEADER = struct.Struct("<4sB8sIQ")
_MAGIC = b"kvR1"
_INLINE, _CHUNKED = 0, 1

#: what "Redis cannot be reached now" looks like from redis-py (connection, timeout, cluster down/unroutable)
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterError,
    rex.ClusterDownError,
    rex.RedisClusterException,
    rex.TryAgainError,
    rex.ReadOnlyError,
    OSError,
)


class _Manifest:
    """The decoded manifest header of one value."""

    __slots__ = ("chunks", "generation", "kind", "total")

    def __init__(self, kind: int, generation: bytes, chunks: int, total: int) -> None:
        self.kind, self.generation, self.chunks, self.total = kind, generation, chunks, total

    @classmethod
    def parse(cls, raw: bytes | None) -> _Manifest | None:
        """The header of ``raw`` (a manifest or its first bytes), ``None`` if absent or not ours."""
        if raw is None or len(raw) < _HEADER.size:
            return None
        magic, kind, generation, chunks, total = _HEADER.unpack_from(raw)
        if magic != _MAGIC or kind not in (_INLINE, _CHUNKED):
            return None
        return cls(kind, generation, chunks, total)

    def pack(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.kind, self.generation, self.chunks, self.total)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisTier(Tier):
    """Encoded blocks in Redis (standalone or Cluster), chunked, under one hash tag per value.

    Build it with :meth:`from_url`; ``connect`` is any zero-argument function returning a redis-py client
    (``redis.Redis`` or ``redis.cluster.RedisCluster``, with ``decode_responses=False``); it is called on
    first use, and again after a failed attempt.
    """

    def __init__(
        self,
        connect: Callable[[], Client],
        *,
        name: str = "redis",
        prefix: str = "kvshelf:",
        chunk_bytes: int = 4 * MiB,
        where: str = "redis",
    ) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ConfigError(f"Redis chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
        if "{" in prefix or "}" in prefix:
            raise ConfigError(f"Redis key prefix must not contain '{{' or '}}' (they delimit hash tags): {prefix!r}")
        self.name = name
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes
        self.where = where
        self._connect = connect
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._usage_key = f"{{{prefix}#usage}}"

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        name: str = "redis",
        prefix: str = "kvshelf:",
        chunk_bytes: int = 4 * MiB,
        socket_timeout: float = 5.0,
    ) -> RedisTier:
        """A tier on ``redis://[:password@]host:port/db`` (standalone) or ``redis+cluster://host:port`` (a seed
        node of a Redis Cluster). Nothing is connected until first use."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
            raise ConfigError(
                f"unknown Redis URL scheme {parts.scheme!r} in {url!r}: use redis://host:port/db "
                "or redis+cluster://host:port"
            )
        try:
            host, port = parts.hostname or "localhost", parts.port or 6379
        except ValueError as exc:
            raise ConfigError(f"bad Redis URL {url!r}: {exc}") from exc
        options: dict[str, Any] = {
            "host": host,
            "port": port,
            "username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None,
            "ssl": scheme.startswith("rediss"),
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
            "decode_responses": False,
            # a few quick retries: a shared tier that is down must cost a request milliseconds, not seconds
            "retry": Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=2),
        }
        where = f"{scheme}://{host}:{port}"
        if scheme.endswith("+cluster"):
            if parts.path.strip("/") not in ("", "0"):
                raise ConfigError(f"Redis Cluster has only database 0, got {url!r}")

            def connect() -> Client:
                return redis.cluster.RedisCluster(**options)

        else:
            db_text = parts.path.strip("/") or "0"
            if not db_text.isdigit():
                raise ConfigError(f"bad Redis database number {db_text!r} in {url!r}")
            where += f"/{db_text}"

            def connect() -> Client:
                return redis.Redis(db=int(db_text), health_check_interval=30, **options)

        return cls(connect, name=name, prefix=prefix, chunk_bytes=chunk_bytes, where=where)

    # -- plumbing -------------------------------------------------------------------------------------

    def _run(self, what: str, fn: Callable[[Client], T]) -> T:
        """``fn(client)``, with every "cannot reach Redis" error turned into ``TierUnavailableError``."""
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
                client = self._client
            return fn(client)
        except _UNAVAILABLE as exc:
            raise TierUnavailableError(
                f"Redis tier {self.name!r} at {self.where} is unavailable ({what}): {type(exc).__name__}: {exc}"
            ) from exc

    def _tag(self, key: bytes) -> str:
        return f"{{{self.prefix}{key.hex()}}}"

    def _manifest_key(self, key: bytes) -> str:
        return self._tag(key) + ":m"

    def _chunk_keys(self, key: bytes, manifest: _Manifest) -> list[str]:
        if manifest.kind != _CHUNKED:
            return []
        base = f"{self._tag(key)}:{manifest.generation.hex()}:"
        return [base + str(i) for i in range(manifest.chunks)]

    @staticmethod
    def _pipeline(client: Client) -> Any:
        return client.pipeline(transaction=False)

    # -- Tier -----------------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []

        def fn(client: Client) -> list[bytes | None]:
            pipe = self._pipeline(client)
            for key in keys:
                pipe.get(self._manifest_key(key))
            raws = pipe.execute()
            out: list[bytes | None] = [None] * len(keys)
            wanted: list[tuple[int, _Manifest, list[str]]] = []
            for i, (key, raw) in enumerate(zip(keys, raws, strict=True)):
                manifest = _Manifest.parse(raw)
                if manifest is None:
                    continue
                if manifest.kind == _INLINE:
                    data = raw[_HEADER.size:]
                    out[i] = data if len(data) == manifest.total else None
                else:
                    wanted.append((i, manifest, self._chunk_keys(key, manifest)))
            if wanted:
                pipe = self._pipeline(client)
                for _, _, chunk_keys in wanted:
                    for chunk_key in chunk_keys:
                        pipe.get(chunk_key)
                chunks = iter(pipe.execute())
                for i, manifest, chunk_keys in wanted:
                    parts = [next(chunks) for _ in chunk_keys]
                    if any(part is None for part in parts):
                        continue  # a chunk was evicted or the write was cut short: a miss, never partial data
                    value = b"".join(parts)
                    out[i] = value if len(value) == manifest.total else None
            return out

        return self._run("get", fn)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Write each value's chunks, then its manifest (with ``SET ... GET`` to learn the value it replaces),
        then drop the replaced value's chunks and update the usage counters. Returns how many Redis took
        (a value Redis refuses, e.g. OOM under ``noeviction``, is not stored)."""
        if not items:
            return 0

        def fn(client: Client) -> int:
            pipe = self._pipeline(client)
            plan: list[tuple[bytes, int, list[str], int]] = []  # key, value size, new chunk keys, commands
            for key, value in items:
                size = len(value)
                if size <= self.chunk_bytes:
                    manifest = _Manifest(_INLINE, os.urandom(8), 0, size)
                    pipe.set(self._manifest_key(key), manifest.pack() + value, get=True)
                    plan.append((key, size, [], 1))
                    continue
                count = -(-size // self.chunk_bytes)
                manifest = _Manifest(_CHUNKED, os.urandom(8), count, size)
                chunk_keys = self._chunk_keys(key, manifest)
                view = memoryview(value)
                for n, chunk_key in enumerate(chunk_keys):
                    pipe.set(chunk_key, view[n * self.chunk_bytes:(n + 1) * self.chunk_bytes])
                pipe.set(self._manifest_key(key), manifest.pack(), get=True)  # last: the value is now visible
                plan.append((key, size, chunk_keys, count + 1))
            results = iter(pipe.execute(raise_on_error=False))

            stored, blocks_delta, bytes_delta = 0, 0, 0
            cleanup = self._pipeline(client)
            refused: BaseException | None = None
            for key, size, chunk_keys, commands in plan:
                replies = [next(results) for _ in range(commands)]
                errors = [r for r in replies if isinstance(r, BaseException)]
                for error in errors:
                    if isinstance(error, _UNAVAILABLE):
                        raise error
                    refused = error
                old_raw = replies[-1]
                old = None if isinstance(old_raw, BaseException) else _Manifest.parse(old_raw)
                if errors:
                    for chunk_key in chunk_keys:  # this write's own generation: nobody else uses these keys
                        cleanup.delete(chunk_key)
                    if old is None:
                        continue
                if old is not None:
                    for chunk_key in self._chunk_keys(key, old):
                        cleanup.delete(chunk_key)
                    if errors:  # the manifest survived; its chunks did not: count the old value out
                        blocks_delta -= 1
                        bytes_delta -= old.total
                        continue
                    bytes_delta += size - old.total
                else:
                    blocks_delta += 1
                    bytes_delta += size
                stored += 1
            if refused is not None:
                log.warning("Redis tier %s refused a write (set maxmemory-policy allkeys-lru): %s", self.name, refused)
            self._count(cleanup, blocks_delta, bytes_delta)
            cleanup.execute(raise_on_error=False)
            return stored

        return self._run("put", fn)

    def _count(self, pipe: Any, blocks: int, size: int) -> None:
        if blocks:
            pipe.hincrby(self._usage_key, "blocks", blocks)
        if size:
            pipe.hincrby(self._usage_key, "bytes", size)

    def _headers(self, client: Client, keys: Sequence[bytes]) -> list[_Manifest | None]:
        """The manifest headers of ``keys`` (``GETRANGE``: the inline data is not transferred)."""
        pipe = self._pipeline(client)
        for key in keys:
            pipe.getrange(self._manifest_key(key), 0, _HEADER.size - 1)
        return [_Manifest.parse(raw) for raw in pipe.execute()]

    def contains_many(self, keys: Sequence[bytes]) -> int:
        """The leading run of ``keys`` whose manifest is present and whose chunks add up to the value's length
        (``STRLEN`` of each chunk: no chunk data is transferred)."""
        if not keys:
            return 0

        def fn(client: Client) -> int:
            headers = self._headers(client, keys)
            run = next((i for i, m in enumerate(headers) if m is None), len(keys))
            pipe = self._pipeline(client)
            owners: list[int] = []
            for i in range(run):
                manifest = headers[i]
                assert manifest is not None
                for chunk_key in self._chunk_keys(keys[i], manifest):
                    pipe.strlen(chunk_key)
                    owners.append(i)
            if not owners:
                return run
            lengths: dict[int, int] = {}
            for i, length in zip(owners, pipe.execute(), strict=True):
                lengths[i] = lengths.get(i, 0) + int(length)
            for i in range(run):
                manifest = headers[i]
                assert manifest is not None
                if manifest.kind == _CHUNKED and lengths.get(i, 0) != manifest.total:
                    return i  # a chunk is missing (evicted, or a write cut short): the value is absent
            return run

        return self._run("contains", fn)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove manifests first (the values vanish at once), then their chunks; return how many existed.

        ``GETDEL`` removes each manifest and returns the one it removed in one atomic step, so a put racing the
        delete of the same key is wholly before or after it: its chunks and the usage counters stay right.
        """
        keys = list(keys)
        if not keys:
            return 0

        def fn(client: Client) -> int:
            pipe = self._pipeline(client)
            for key in keys:
                pipe.getdel(self._manifest_key(key))
            deleted = pipe.execute()
            pipe = self._pipeline(client)
            removed, removed_bytes = 0, 0
            for key, raw in zip(keys, deleted, strict=True):
                if raw is None:
                    continue
                removed += 1
                manifest = _Manifest.parse(raw)
                if manifest is not None:
                    removed_bytes += manifest.total
                    for chunk_key in self._chunk_keys(key, manifest):
                        pipe.delete(chunk_key)
            self._count(pipe, -removed, -removed_bytes)
            pipe.execute()
            return removed

        return self._run("delete", fn)

    def _scan(self, client: Client, match: str) -> Iterator[bytes]:
        if isinstance(client, redis.cluster.RedisCluster):
            return client.scan_iter(match=match, count=1000, target_nodes=redis.cluster.RedisCluster.PRIMARIES)
        return client.scan_iter(match=match, count=1000)

    def keys(self) -> list[bytes]:
        """Every key with a manifest (SCAN by prefix; on Cluster, every primary). May be slow on large tiers."""
        pattern = "{" + _glob_escape(self.prefix) + "*}:m"
        start = 1 + len(self.prefix.encode())

        def fn(client: Client) -> list[bytes]:
            out = []
            for name in self._scan(client, pattern):
                hex_key = name[start:-3].decode("ascii", "replace")
                try:
                    out.append(bytes.fromhex(hex_key))
                except ValueError:
                    continue  # not one of ours (a prefix that is a prefix of another tier's)
            return out

        return self._run("keys", fn)

    def usage(self) -> TierUsage:
        """Counters (``HGETALL`` of the usage hash) and ``maxmemory`` (``INFO memory``): two cheap commands."""

        def fn(client: Client) -> TierUsage:
            counters = client.hgetall(self._usage_key)
            info = client.info("memory", target_nodes=redis.cluster.RedisCluster.PRIMARIES) if isinstance(
                client, redis.cluster.RedisCluster) else client.info("memory")
            nodes = info.values() if isinstance(client, redis.cluster.RedisCluster) else [info]
            capacity = sum(int(node.get("maxmemory", 0)) for node in nodes)
            return TierUsage(
                blocks=max(int(counters.get(b"blocks", 0)), 0),
                bytes=max(int(counters.get(b"bytes", 0)), 0),
                capacity_bytes=capacity or None,
            )

        return self._run("usage", fn)

    def recount(self) -> TierUsage:
        """Rebuild the usage counters from what Redis holds now (a SCAN and one GETRANGE per value)."""

        def fn(client: Client) -> None:
            keys = self.keys()
            headers = self._headers(client, keys) if keys else []
            present = [m for m in headers if m is not None]
            pipe = self._pipeline(client)
            pipe.hset(self._usage_key, mapping={"blocks": len(present), "bytes": sum(m.total for m in present)})
            pipe.execute()

        self._run("recount", fn)
        return self.usage()

    def healthy(self) -> bool:
        """Whether Redis answers a PING now."""
        try:
            return bool(self._run("ping", lambda client: client.ping()))
        except TierUnavailableError:
            return False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_UNAVAILABLE):
                client.close()
