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

Damage. Redis is shared, so its keys may be damaged or planted by anything with access to it. A manifest is
checked before any chunk is read: the header must be ours and consistent (a chunked value of ``chunks`` chunks
and ``total`` bytes must have been cut by some chunk size in [``MIN_CHUNK_BYTES``, ``MAX_CHUNK_BYTES``], and
``total`` is at most ``max_value_bytes``), so a forged header costs one command, never a pipeline of millions
of GETs or a large allocation. Chunks are read in rounds of bounded size and a read stops at the first
missing chunk. A damaged value -- a key of the wrong type (``WRONGTYPE``) at a manifest or chunk name, a header
that contradicts itself, an inline value of the wrong length, chunks that do not add up to the total -- reads
as ``b""`` (present but empty: the store's verification counts it a ``corrupt`` miss) and is removed from Redis
then and there, by a script that deletes it only if it is still the damaged thing that was read. ``contains_many``
reports a damaged value absent (and removes it too), so Delete, Clear and the next put of the key all clear it;
a put replaces a key of any type. A damaged usage hash (wrong type, fields that are not integers) is rebuilt
with ``recount()`` and a warning. No data error of Redis ever escapes as anything but a miss or a
``TierUnavailableError``.

Eviction. Redis evicts by itself; kvshelf never does. Configure the Redis server with::

    maxmemory <bytes>
    maxmemory-policy allkeys-lfu      # or allkeys-lru

kvshelf sets no TTL on its keys, so the ``volatile-*`` policies (which only evict keys with an expiry) would
find nothing to evict and Redis would refuse writes with OOM errors once full (``noeviction`` does that too;
such a refused value is simply not stored: ``put_many`` counts it out, the store counts it ``rejected``, and a
warning says to change the policy). With ``allkeys-*`` an evicted chunk or manifest only makes its value a miss,
never wrong data; the read that finds a value partly evicted removes what is left of it.

Usage. ``usage()`` is cheap: ``blocks`` and ``bytes`` are counters in one Redis hash (``{<prefix>#usage}``),
kept by every put and delete together with a registry of the values they count, so that the values Redis evicts
on its own can be found and counted out (``kvstore.redis_usage`` tells how, and what it costs). Each value
found evicted is reported through the eviction callback (the store counts it in the tier's ``evictions``).
``capacity_bytes`` is Redis's ``maxmemory`` (summed over Cluster primaries; ``None`` when one is unlimited, or
INFO is refused). ``reconcile()`` looks for evictions now; ``recount()`` rebuilds everything with a SCAN.

Clearing a namespace. ``delete_prefix`` (the server's ``Clear``) and ``keys_with_prefix`` find a namespace's values
with a ``SCAN`` whose ``MATCH`` names the namespace tag's hex (keys are hex in the hash tag, so the tag is a prefix of
the name): Redis filters, only the namespace's names come back, and each page is removed at once (``GETDEL``, the
accounting, ``UNLINK`` of chunks; chunks whose manifest Redis evicted are counted out and unlinked too). Redis still
walks its whole keyspace, ``clear_scan_count`` slots a call (under 1 ms of Redis time a call at the default 1000):
on the 2-core dev machine, 10,000 values among 1,000,000 of other namespaces clear in ~1 s (0.7 s of it Redis's
SCAN), 3.5 s before (``kvshelf bench clear``). A per-namespace index would make it proportional to the namespace
alone, at the price of a round trip and ~60 bytes of Redis memory on every put: not done, Clear being rare and puts
not.

Availability. The client connects lazily: constructing the tier never fails because Redis is down. Every
command is bounded by ``socket_timeout`` (connect and each read; a timed-out command is not retried), and a
connection error or timeout raises ``TierUnavailableError``, which the ``TieredStore`` turns into a counted
miss (reads) or skip (writes). A circuit breaker keeps a hung or dead Redis from costing every call a timeout:
after a call fails so, the tier is *down* for a backoff (1 s, doubling up to 30 s) during which every call
raises ``TierUnavailableError`` at once without touching the socket; the first call after the backoff (one
call; the others still fail at once) tries again, and a success closes the breaker. ``healthy()`` is a PING
that always tries (it ignores the backoff) and opens or closes the breaker by its outcome.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
import redis.cluster
import redis.exceptions as rex
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from kvshelf.kvstore.errors import ConfigError, TierUnavailableError
from kvshelf.kvstore.redis_usage import (
    INIT_SCRIPT,
    LOST,
    RECONCILE_INTERVAL_S,
    RECONCILE_STEP,
    SCAN_BATCH,
    SETTLE_S,
    USAGE_SCRIPT,
    Entry,
    entry_field,
    unflagged,
)
from kvshelf.kvstore.tier import EvictionCallback, Tier, TierUsage

log = logging.getLogger(__name__)
T = TypeVar("T")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

Client = redis.Redis | redis.cluster.RedisCluster

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
#: the circuit breaker's backoff after a failure: first, and the most it doubles to
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0

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


def _is_data_error(reply: object) -> bool:
    """Whether ``reply`` is an error Redis gave because of what a key holds (not because it is down or refusing):
    a key of the wrong type, a counter that is not an integer or would overflow."""
    if not isinstance(reply, rex.ResponseError) or isinstance(reply, _UNAVAILABLE):
        return False
    text = str(reply)
    return text.startswith("WRONGTYPE") or "not an integer" in text or "overflow" in text


def _readable(reply: T) -> T:
    """A pipeline reply (``raise_on_error=False``) as data: data errors are returned for the caller to treat as
    damage; any other error (unreachable, refused) is raised."""
    if isinstance(reply, BaseException) and not _is_data_error(reply):
        raise reply
    return reply


def _fail_fast(call: Callable[..., T]) -> Callable[..., T]:
    """``call``, raising at once the first connection error or timeout it raised, once it has raised one."""
    failed: list[BaseException] = []

    def wrapper(*args: Any, **kwargs: Any) -> T:
        if failed:
            raise rex.TimeoutError(f"not sent: an earlier command of this call failed ({failed[0]})")
        try:
            return call(*args, **kwargs)
        except (rex.ConnectionError, rex.TimeoutError) as exc:
            failed.append(exc)
            raise

    return wrapper


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


class _Breaker:
    """Closed (calls go through) until a call finds Redis unreachable; then open for a backoff (doubling from
    ``first_s`` to ``max_s`` with each failure in a row), during which calls are refused at once. After the
    backoff one call (the trial) goes through; its success closes the breaker, its failure opens it again."""

    def __init__(self, name: str, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.name = name
        self.first_s, self.max_s = first_s, max_s
        self._lock = threading.Lock()
        self._backoff = 0.0  # 0: closed
        self._until = 0.0
        self._trial = False
        self._reason = ""

    def admit(self, *, probe: bool = False) -> str | None:
        """``None`` if a call may go ahead now, else why not."""
        with self._lock:
            if not self._backoff or probe:
                return None
            left = self._until - time.monotonic()
            if left > 0:
                return f"down for another {left:.1f} s after {self._reason}"
            if self._trial:
                return f"down (a retry is in flight) after {self._reason}"
            self._trial = True
            return None

    def succeeded(self) -> None:
        with self._lock:
            was_down = bool(self._backoff)
            self._backoff, self._trial = 0.0, False
        if was_down:
            log.warning("Redis tier %s is reachable again", self.name)

    def failed(self, reason: str) -> None:
        with self._lock:
            was_down = bool(self._backoff)
            self._backoff = min(max(2 * self._backoff, self.first_s), self.max_s)
            self._until = time.monotonic() + self._backoff
            self._trial = False
            self._reason = reason
            backoff = self._backoff
        if not was_down:
            log.warning("Redis tier %s is unreachable (%s): calls fail at once for %.1f s, then retry",
                        self.name, reason, backoff)

    def abandon(self) -> None:
        """A trial that ended without telling whether Redis is reachable."""
        with self._lock:
            self._trial = False

    @property
    def is_open(self) -> bool:
        with self._lock:
            return bool(self._backoff)


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


class RedisTier(Tier):
    """Encoded blocks in Redis (standalone or Cluster), chunked, under one hash tag per value.

    Build it with :meth:`from_url`; ``connect`` is any zero-argument function returning a redis-py client
    (``redis.Redis`` or ``redis.cluster.RedisCluster``, with ``decode_responses=False``, and bounded socket
    timeouts); it is called on first use, and again after a failed attempt. ``max_value_bytes``: the largest value
    stored (larger ones are not: ``put_many`` counts them out) and read (a manifest declaring more is damaged).
    """

    def __init__(
        self,
        connect: Callable[[], Client],
        *,
        name: str = "redis",
        prefix: str = "kvshelf:",
        chunk_bytes: int = 4 * MiB,
        where: str = "redis",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
    ) -> None:
        if isinstance(reconcile_interval_s, bool) or not isinstance(reconcile_interval_s, int | float) or not (
                reconcile_interval_s >= 0):
            raise ConfigError(f"Redis reconcile_interval_s must be a number of seconds >= 0, "
                              f"got {reconcile_interval_s!r}")
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
            raise ConfigError(f"Redis chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(f"Redis chunk_bytes must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES} bytes, "
                              f"got {chunk_bytes}")
        if not isinstance(max_value_bytes, int) or isinstance(max_value_bytes, bool) or max_value_bytes <= 0:
            raise ConfigError(f"Redis max_value_bytes must be a positive number of bytes, got {max_value_bytes!r}")
        if "{" in prefix or "}" in prefix:
            raise ConfigError(f"Redis key prefix must not contain '{{' or '}}' (they delimit hash tags): {prefix!r}")
        self.name = name
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes
        self.max_value_bytes = max_value_bytes
        self.where = where
        self._connect = connect
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._usage_key = f"{{{prefix}#usage}}"
        self._breaker = _Breaker(name)
        self.reconcile_interval_s = float(reconcile_interval_s)
        self._on_evict: EvictionCallback | None = None
        self._flagged = True  # whether Redis takes script flags (7+); cleared on the first refusal
        self._reconcile_lock = threading.Lock()
        self._cursor = 0  # the registry HSCAN cursor of a reconciliation pass in progress (0: none)
        self._seen_evicted: int | None = None  # Redis's evicted_keys when the last pass started
        self._next_check = 0.0  # monotonic time of the next check a put may make
        self._saw_registry = False  # whether this tier has seen its registry (a lost one is then worth a warning)
        self._stale = False  # an accounting change was refused: the next usage() recounts
        self._refused_since = 0  # writes Redis refused since the last warning
        self._next_refused_warning = 0.0
        self._next_blind = 0.0  # INFO unreadable: monotonic time of the next pass usage() may run
        self._pass_evicted: int | None = None  # evicted_keys when the pass under way began
        #: grows with each recount: values Redis evicted while the registry was lost (or before a recount) were
        #: never reported one by one, so a store holding pins checks them again (``TieredStore.stats``)
        self.loss_epoch = 0
        #: the COUNT hint of the SCANs that find a prefix's keys (a larger one: fewer calls, each blocking longer)
        self.clear_scan_count = CLEAR_SCAN_COUNT

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        name: str = "redis",
        prefix: str = "kvshelf:",
        chunk_bytes: int = 4 * MiB,
        socket_timeout: float = 1.0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
    ) -> RedisTier:
        """A tier on ``redis://[:password@]host:port/db`` (standalone) or ``redis+cluster://host:port`` (a seed
        node of a Redis Cluster). Nothing is connected until first use. ``socket_timeout``: seconds a connect or a
        read may take before Redis counts as unreachable (a timed-out command is not retried)."""
        if isinstance(socket_timeout, bool) or not isinstance(socket_timeout, int | float) or not socket_timeout > 0:
            raise ConfigError(f"Redis socket_timeout must be a positive number of seconds, got {socket_timeout!r}")
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
        }
        # a few quick retries of a dropped connection (milliseconds), never of a timeout: a hung server must cost
        # a call one timeout, not three
        backoff = ExponentialWithJitterBackoff(base=0.01, cap=0.1)
        where = f"{scheme}://{host}:{port}"
        if scheme.endswith("+cluster"):
            if parts.path.strip("/") not in ("", "0"):
                raise ConfigError(f"Redis Cluster has only database 0, got {url!r}")

            def connect() -> Client:
                # no cluster-level retry (each would cost a frozen node another timeout): a failed call opens the
                # breaker, and the call after the backoff finds the refreshed slot map (MOVED/ASK are still followed)
                return redis.cluster.RedisCluster(retry=Retry(backoff, retries=0), **options)

        else:
            db_text = parts.path.strip("/") or "0"
            if not db_text.isdigit():
                raise ConfigError(f"bad Redis database number {db_text!r} in {url!r}")
            where += f"/{db_text}"

            def connect() -> Client:
                retry = Retry(backoff, retries=2, supported_errors=(rex.ConnectionError,))
                return redis.Redis(db=int(db_text), health_check_interval=30, retry=retry, **options)

        return cls(connect, name=name, prefix=prefix, chunk_bytes=chunk_bytes, where=where,
                   max_value_bytes=max_value_bytes, reconcile_interval_s=reconcile_interval_s)

    # -- plumbing -------------------------------------------------------------------------------------

    def _unavailable(self, what: str, reason: str) -> TierUnavailableError:
        return TierUnavailableError(f"Redis tier {self.name!r} at {self.where} is unavailable ({what}): {reason}")

    def _run(self, what: str, fn: Callable[[Client], T], *, probe: bool = False) -> T:
        """``fn(client)`` through the circuit breaker, with every "cannot reach Redis" error turned into
        ``TierUnavailableError`` (and opening the breaker), and any other error Redis answers with (refused, no
        permission...) into ``TierUnavailableError`` too."""
        refused = self._breaker.admit(probe=probe)
        if refused is not None:
            raise self._unavailable(what, refused)
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
                client = self._client
            result = fn(client)
        except _UNAVAILABLE as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._breaker.failed(reason)
            raise self._unavailable(what, reason) from exc
        except rex.RedisError as exc:  # Redis answered, with an error no data of ours explains
            self._breaker.succeeded()
            raise self._unavailable(what, f"Redis refused: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._breaker.abandon()
            raise
        self._breaker.succeeded()
        return result

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

    def _manifest(self, raw: bytes | BaseException | None, *, whole: bool) -> _Manifest | _Damage | None:
        return read_manifest(_readable(raw), self.max_value_bytes, whole=whole)

    @staticmethod
    def _pipeline(client: Client) -> Any:
        pipe = client.pipeline(transaction=False)
        resend = getattr(pipe, "parent_execute_command", None)
        if isinstance(client, redis.cluster.RedisCluster) and resend is not None:
            # redis-py's cluster pipeline resends each command that failed with a connection error or timeout
            # one by one: against a hung node, one timeout per command. After the first, fail the rest at once.
            pipe.parent_execute_command = _fail_fast(resend)
        return pipe

    def _execute(self, client: Client, commands: Iterable[Callable[[Any], Any]], batch: int = 4096) -> list[Any]:
        """Run ``commands`` (each queues one command on a pipeline) in pipelines of at most ``batch``; the
        replies, errors included."""
        out: list[Any] = []
        pipe, queued = self._pipeline(client), 0
        for command in commands:
            command(pipe)
            queued += 1
            if queued == batch:
                out.extend(pipe.execute(raise_on_error=False))
                pipe, queued = self._pipeline(client), 0
        if queued:
            out.extend(pipe.execute(raise_on_error=False))
        return out

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

    # -- Tier -----------------------------------------------------------------------------------------

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

        def fn(client: Client) -> int:
            pipe = self._pipeline(client)
            # key, new chunk keys, commands, the manifest as written (bytes, and decoded)
            plan: list[tuple[bytes, list[str], int, bytes | memoryview, _Manifest]] = []
            for key, value in items:
                size = len(value)
                if size <= self.chunk_bytes:
                    manifest = _Manifest(_INLINE, os.urandom(8), 0, size)
                    payload = manifest.pack() + value
                    pipe.set(self._manifest_key(key), payload, get=True)
                    plan.append((key, [], 1, payload, manifest))
                    continue
                count = -(-size // self.chunk_bytes)
                manifest = _Manifest(_CHUNKED, os.urandom(8), count, size)
                chunk_keys = list(self._chunk_keys(key, manifest))
                view = memoryview(value)
                for n, chunk_key in enumerate(chunk_keys):
                    pipe.set(chunk_key, view[n * self.chunk_bytes:(n + 1) * self.chunk_bytes])
                payload = manifest.pack()
                pipe.set(self._manifest_key(key), payload, get=True)  # last: the value is now visible
                plan.append((key, chunk_keys, count + 1, payload, manifest))
            results = iter(pipe.execute(raise_on_error=False))

            stored = 0
            ops: list[tuple[str, str, int, int]] = []  # the usage registry's changes (kvstore.redis_usage)
            dropped: list[str] = []  # chunk keys to remove once the registry knows
            replace: list[tuple[bytes, list[str], bytes | memoryview, _Manifest]] = []
            refused: BaseException | None = None
            for key, chunk_keys, commands, payload, manifest in plan:
                replies = [next(results) for _ in range(commands)]
                errors = [r for r in replies if isinstance(r, BaseException)]
                for error in errors:
                    if isinstance(error, _UNAVAILABLE):
                        raise error
                if errors and len(errors) == 1 and _is_data_error(replies[-1]):
                    # SET ... GET on a key of another type sets nothing: replace that key below
                    replace.append((key, chunk_keys, payload, manifest))
                    continue
                if errors:
                    refused = errors[0]
                    dropped.extend(chunk_keys)  # this write's own generation: nobody else uses these keys
                old_raw = replies[-1]
                old = None if isinstance(old_raw, BaseException) else read_manifest(
                    old_raw, self.max_value_bytes, whole=True)
                if isinstance(old, _Manifest):  # replaced (or, when a chunk was refused, broken): count it out
                    ops.append(self._op("-", key, old))
                    dropped.extend(self._chunk_keys(key, old))
                # else: nothing, or not a value of ours (nothing of it to drop or count out)
                if not errors:
                    ops.append(self._op("+", key, manifest))
                    stored += 1
            if replace:
                pipe = self._pipeline(client)
                for key, _, payload, _ in replace:
                    pipe.delete(self._manifest_key(key))
                    pipe.set(self._manifest_key(key), payload)
                replies = iter(pipe.execute(raise_on_error=False))
                for key, chunk_keys, _, manifest in replace:
                    _, reply = next(replies), next(replies)
                    if isinstance(reply, _UNAVAILABLE):
                        raise reply
                    if isinstance(reply, BaseException):
                        refused = reply
                        dropped.extend(chunk_keys)
                        continue
                    log.warning("Redis tier %s: replaced a key of the wrong type at value %s", self.name, key.hex())
                    ops.append(self._op("+", key, manifest))
                    stored += 1
            if refused is not None:
                self._warn_refused(refused)
            self._account(client, ops)  # before the chunks go: a reconciliation never sees them gone uncounted
            self._execute(client, (lambda p, c=c: p.delete(c) for c in dropped))
            return stored

        return self._run("put", fn)

    def _headers(self, client: Client, keys: Sequence[bytes]) -> list[_Manifest | _Damage | None]:
        """The manifest headers of ``keys`` (``GETRANGE``: the inline data is not transferred)."""
        replies = self._execute(client, (lambda p, k=key: p.getrange(self._manifest_key(k), 0, _HEADER.size - 1)
                                         for key in keys))
        return [self._manifest(raw, whole=False) for raw in replies]

    def contains_many(self, keys: Sequence[bytes]) -> int:
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

    # -- usage: the registry and counters (kvstore.redis_usage) ------------------------------------------

    @staticmethod
    def _op(op: str, key: bytes, manifest: _Manifest) -> tuple[str, str, int, int]:
        return op, entry_field(key, manifest.generation), manifest.total, manifest.chunks

    def _script(self, client: Client, script: str, args: Sequence[Any]) -> Any:
        """One of the registry scripts on the usage hash (without its flags on a Redis older than 7)."""
        if self._flagged:
            try:
                return client.eval(script, 1, self._usage_key, *args)
            except rex.ResponseError as exc:
                if isinstance(exc, _UNAVAILABLE) or "near '#'" not in str(exc):
                    raise
                self._flagged = False
                log.warning("Redis tier %s: this Redis takes no script flags (it is older than 7.0): the usage "
                            "accounting of a full noeviction Redis may be refused", self.name)
        return client.eval(unflagged(script), 1, self._usage_key, *args)

    def _account(self, client: Client, ops: Sequence[tuple[str, str, int, int]]) -> list[int]:
        """Apply registry operations ``(op, field, size, chunks)``; for each, 1 if it changed something.

        A missing or damaged registry (a new tier, or Redis evicted it) is replaced by an empty one marked ``stale``
        and the operations applied to it (a removal of a value it does not know counts nothing there); the next
        ``usage()`` recounts."""
        out: list[int] = []
        for start in range(0, len(ops), 1024):
            batch = ops[start:start + 1024]
            reply = self._apply(client, batch)
            if reply == LOST:
                init = self._script(client, INIT_SCRIPT, ["0"])
                if init == 1:
                    log.info("Redis tier %s: created the usage registry at %s (a new tier, or Redis evicted it): the "
                             "next usage() recounts", self.name, self._usage_key)
                elif init == 2:
                    log.warning("Redis tier %s: the usage counters at %s were damaged: replaced by an empty registry; "
                                "the next usage() recounts", self.name, self._usage_key)
                if init in (0, 1, 2):  # nothing of the batch was applied: it all applies to the registry there now
                    reply = self._apply(client, batch)
            if isinstance(reply, list) and len(reply) == len(batch):
                out.extend(int(r) for r in reply)
            else:
                out.extend(0 for _ in batch)
        return out

    def _apply(self, client: Client, ops: Sequence[tuple[str, str, int, int]]) -> Any:
        """``USAGE_SCRIPT`` on ``ops``: its reply, or ``None`` when Redis refused it (the next ``usage()`` then
        recounts)."""
        if not ops:
            return []
        try:
            return self._script(client, USAGE_SCRIPT, [str(x) for op in ops for x in op])
        except rex.ResponseError as exc:
            if isinstance(exc, _UNAVAILABLE):
                raise
            log.warning("Redis tier %s: the usage accounting was refused (%s): the next usage() recounts",
                        self.name, exc)
            self._stale = True
            return None

    def _names(self, key: bytes, manifest: _Manifest) -> list[str]:
        return [self._manifest_key(key), *self._chunk_keys(key, manifest)]

    def _whole(self, client: Client, values: Sequence[tuple[bytes, _Manifest]], *, exact: bool = False) -> list[bool]:
        """Whether each value's manifest and chunks all exist (``EXISTS``, which leaves Redis's LRU/LFU clocks
        alone; at most 1024 keys a command). ``exact``: the manifest must also be this value's (same generation; a
        ``GETRANGE`` of its header, which does touch the clocks: only for a recount)."""
        commands: list[tuple[int, list[str]]] = []
        for i, (key, manifest) in enumerate(values):
            names = self._names(key, manifest)
            commands.extend((i, names[at:at + 1024]) for at in range(0, len(names), 1024))
        replies = self._execute(client, (lambda p, n=names: p.execute_command("EXISTS", *n) for _, names in commands))
        found = [0] * len(values)
        unsure: set[int] = set()
        for (i, _), reply in zip(commands, replies, strict=True):
            reply = _readable(reply)
            if isinstance(reply, BaseException):
                unsure.add(i)  # a data error EXISTS never gives: leave the value be
            else:
                found[i] += int(reply)
        whole = [i in unsure or found[i] == 1 + manifest.chunks for i, (_, manifest) in enumerate(values)]
        if exact and values:
            headers = self._headers(client, [key for key, _ in values])
            whole = [ok and (not isinstance(header, _Manifest) or header.generation == value[1].generation)
                     for ok, header, value in zip(whole, headers, values, strict=True)]
        return whole

    def _lost(self, client: Client, values: Sequence[tuple[bytes, _Manifest]]) -> list[bytes]:
        """Values found no longer whole (Redis evicted a chunk or the manifest): each is counted out (only if it was
        counted in, and by one finder only), then what Redis left of it is removed (the manifest only if it is still
        this value), so a read finds it absent at once. Returns the keys this call counted out: evictions to
        report."""
        if not values:
            return []
        results = self._account(client, [self._op("x", key, manifest) for key, manifest in values])
        for key, manifest in values:
            if manifest.kind != _CHUNKED:
                continue
            with contextlib.suppress(rex.ResponseError):  # nothing of ours there to remove
                client.eval(_DROP_DAMAGED, 1, self._manifest_key(key), "bytes", manifest.pack())
            # the chunks Redis left (at most _DROP_CHUNKS: a forged manifest costs one round; more are left for
            # Redis to evict, as nothing reads them)
            chunks = itertools.islice(self._chunk_keys(key, manifest), _DROP_CHUNKS)
            self._execute(client, (lambda p, c=c: p.delete(c) for c in chunks))
        return [key for (key, _), counted in zip(values, results, strict=True) if counted]

    def _warn_refused(self, refused: BaseException) -> None:
        """A warning that Redis refused writes: at most one per ``_WARN_EVERY_S``, with the count since the last."""
        now = time.monotonic()
        with self._lock:
            self._refused_since += 1
            if now < self._next_refused_warning:
                return
            count, self._refused_since = self._refused_since, 0
            self._next_refused_warning = now + _WARN_EVERY_S
        log.warning("Redis tier %s: Redis refused %d write(s) (%s): it is full and does not evict; set "
                    "maxmemory-policy allkeys-lfu or allkeys-lru", self.name, count, refused)

    def _report(self, keys: Sequence[bytes]) -> None:
        """Report values Redis evicted to the store (an empty value: the tier no longer has it)."""
        callback = self._on_evict
        if callback is not None:
            for key in keys:
                callback(key, b"")

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Called with ``(key, b"")`` for each value of this tier found evicted by Redis (the value is gone: the
        empty value says so); kvshelf itself never evicts from Redis."""
        self._on_evict = callback

    def _counters(self, client: Client, *, stale_ok: bool = False) -> tuple[int, int] | str:
        """``(blocks, bytes)`` from the usage hash, or why it cannot be used: ``missing``, ``stale`` (awaiting a
        recount; ``stale_ok``: its figures all the same), ``format...`` or ``damaged...``."""
        try:
            version, blocks, size, stale = client.hmget(self._usage_key, ["v", "blocks", "bytes", "stale"])
        except rex.ResponseError as exc:
            if not _is_data_error(exc):
                raise
            return f"damaged: {exc}"
        if version is None:
            return "missing" if blocks is None and size is None else "format: kept by an older kvshelf"
        if version != b"2":
            return f"format {version[:20]!r}"
        if stale is not None and not stale_ok:
            return "stale"
        values = []
        for field, raw in (("blocks", blocks), ("bytes", size)):
            try:
                value = int(raw if raw is not None else b"")
            except ValueError:
                return f"damaged: {field} is {(raw or b'')[:40]!r}, not an integer"
            if not -(1 << 63) <= value < 1 << 63:
                return f"damaged: {field} is out of range"
            values.append(max(value, 0))
        return values[0], values[1]

    def _recount(self, client: Client, *, force: bool) -> list[bytes]:
        """(Re)build the registry from what Redis holds: a fresh one (``force``: always; else only if the one there
        is missing or damaged), every whole value found by SCAN seeded into it (counted in unless already known),
        values found partly evicted removed; then (not ``force``) a whole reconciliation pass, and the ``stale``
        mark cleared. Returns the keys counted out: evictions to report."""
        self._script(client, INIT_SCRIPT, ["1" if force else "0"])
        self._stale = False
        self.loss_epoch += 1
        keys = self._keys(client)
        found: list[bytes] = []
        for start in range(0, len(keys), SCAN_BATCH):
            batch = keys[start:start + SCAN_BATCH]
            sound = [(key, m) for key, m in zip(batch, self._headers(client, batch), strict=True)
                     if isinstance(m, _Manifest)]
            whole = self._whole(client, sound)
            self._account(client, [self._op("s", key, m) for (key, m), ok in zip(sound, whole, strict=True) if ok])
            found += self._lost(client, [value for value, ok in zip(sound, whole, strict=True) if not ok])
        with self._reconcile_lock:
            self._cursor = 0
            if not force:  # a registry rebuilt while values came and went: each one's generation is checked
                while True:
                    found += self._reconcile_step(client, RECONCILE_STEP, exact=True)
                    if not self._cursor:
                        break
        client.hdel(self._usage_key, "stale")
        return found

    def _info(self, client: Client) -> tuple[int | None, int | None]:
        """Redis's ``maxmemory`` (summed over primaries; ``None`` when one is unlimited or it cannot be read) and
        ``evicted_keys`` since it started (summed; ``None`` when it cannot be read: INFO refused)."""
        try:
            if isinstance(client, redis.cluster.RedisCluster):
                primaries = redis.cluster.RedisCluster.PRIMARIES
                memory, stats = client.info("memory", target_nodes=primaries), client.info("stats",
                                                                                          target_nodes=primaries)
            else:
                memory, stats = client.info("memory"), client.info("stats")
        except rex.ResponseError as exc:  # no permission (a managed Redis), or INFO renamed away
            if isinstance(exc, _UNAVAILABLE):
                raise
            return None, None

        def nodes(info: dict[Any, Any]) -> list[dict[Any, Any]]:
            return [info] if "maxmemory" in info or "evicted_keys" in info else list(info.values())

        try:
            limits = [int(node.get("maxmemory", 0)) for node in nodes(memory)]
            evicted = sum(int(node.get("evicted_keys", 0)) for node in nodes(stats))
        except (TypeError, ValueError, AttributeError):
            return None, None
        capacity = sum(limits) if limits and all(limit > 0 for limit in limits) else None
        return capacity, evicted

    def _reconcile_step(self, client: Client, budget: int, *, exact: bool = False) -> list[bytes]:
        """Look at up to about ``budget`` registry entries from where the pass stands (``HSCAN``): values counted in
        that are no longer whole (``exact``: or whose manifest is another value's) are counted out and removed
        (``_lost``); ``-``/``x`` leftovers older than ``SETTLE_S`` are settled. Returns the keys counted out."""
        found: list[bytes] = []
        cursor, seen = self._cursor, 0
        while True:
            try:
                cursor, fields = client.hscan(self._usage_key, cursor, match="e:*", count=SCAN_BATCH)
            except rex.ResponseError as exc:
                if not _is_data_error(exc):
                    raise
                self._stale, cursor = True, 0  # a damaged registry: the next usage() rebuilds it
                break
            entries = [e for e in (Entry.parse(f, v) for f, v in fields.items()) if e is not None]
            counted = []
            for e in entries:
                manifest = _Manifest(_CHUNKED if e.chunks else _INLINE, e.generation, e.chunks, e.size)
                # an entry no writer could have made (damaged, or planted) is left alone: checking it could cost
                # a million EXISTS
                if e.state == "+" and e.chunks <= _DROP_CHUNKS and isinstance(
                        read_manifest(manifest.pack(), self.max_value_bytes, whole=False), _Manifest):
                    counted.append((e.key, manifest))
            whole = self._whole(client, counted, exact=exact)
            found += self._lost(client, [value for value, ok in zip(counted, whole, strict=True) if not ok])
            # leftovers ("-", "x") and fields that are no entry (planted, damaged: the script drops them)
            parsed = {e.field for e in entries}
            junk = [f.decode("ascii", "replace") if isinstance(f, bytes) else f for f in fields]
            self._account(client, [("settle", e.field, SETTLE_S, 0) for e in entries if e.state != "+"]
                          + [("settle", f, SETTLE_S, 0) for f in junk if f not in parsed])
            seen += len(fields)
            if not cursor or seen >= budget:
                break
        self._cursor = int(cursor)
        return found

    def _reconcile_if_due(self, client: Client, evicted: int | None) -> list[bytes]:
        """A reconciliation step when Redis has evicted keys since the last pass began (``evicted_keys`` grew), a
        pass is under way, or -- INFO unreadable -- once per ``reconcile_interval_s``. Skipped while another thread
        reconciles."""
        now = time.monotonic()
        if not self._cursor:
            if evicted is None:
                if now < self._next_blind:
                    return []
                self._next_blind = now + max(self.reconcile_interval_s, 1.0)
            elif evicted == self._seen_evicted or (self._seen_evicted is None and evicted == 0):
                self._seen_evicted = evicted
                return []
        if not self._reconcile_lock.acquire(blocking=False):
            return []
        try:
            if not self._cursor:
                self._pass_evicted = evicted
            found = self._reconcile_step(client, RECONCILE_STEP)
            if not self._cursor:
                self._seen_evicted = self._pass_evicted
            return found
        finally:
            self._reconcile_lock.release()

    def _check_evictions(self) -> None:
        """Before a put, at most every ``reconcile_interval_s``: Redis's ``evicted_keys``, and a reconciliation step
        if it grew (so a namespace quota counts what Redis holds). Never fails the put: an unreachable Redis is the
        put's own business."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.reconcile_interval_s
        try:
            found = self._run("reconcile", lambda client: self._reconcile_if_due(client, self._info(client)[1]))
        except TierUnavailableError:
            return
        self._report(found)

    def usage(self) -> TierUsage:
        """The counters (``HMGET`` of the usage hash), Redis's ``maxmemory`` and ``evicted_keys`` (``INFO``), and --
        when Redis evicted keys since the last look -- a reconciliation step first (see ``kvstore.redis_usage``),
        so the figures count what Redis holds now. A missing, damaged or old-format usage hash is rebuilt with a
        recount (a warning, unless this tier never saw one: a new tier)."""

        def fn(client: Client) -> tuple[TierUsage, list[bytes]]:
            found: list[bytes] = []
            problem = self._counters(client)
            if isinstance(problem, str) or self._stale:
                if isinstance(problem, str) and problem != "stale" and (problem != "missing" or self._saw_registry):
                    why = "gone (evicted by Redis?)" if problem == "missing" else problem
                    log.warning("Redis tier %s: the usage counters at %s are %s: rebuilding them with a recount",
                                self.name, self._usage_key, why)
                found += self._recount(client, force=False)
            capacity, evicted = self._info(client)
            found += self._reconcile_if_due(client, evicted)
            counters = self._counters(client, stale_ok=True)
            if isinstance(counters, str):  # lost again at once (a Redis evicting everything): nothing counted
                counters = (0, 0)
            else:
                self._saw_registry = True
            return TierUsage(blocks=counters[0], bytes=counters[1], capacity_bytes=capacity), found

        usage, found = self._run("usage", fn)
        self._report(found)
        return usage

    def recount(self) -> TierUsage:
        """Rebuild the usage registry and counters from scratch from what Redis holds now (a SCAN, one GETRANGE
        per value and one EXISTS per chunked value). Values being written or deleted meanwhile settle within
        ``SETTLE_S``."""
        found = self._run("recount", lambda client: self._recount(client, force=True))
        self._report(found)
        return self.usage()

    def reconcile(self) -> int:
        """A whole reconciliation pass now (every registry entry, an ``EXISTS`` each); returns how many values it
        found evicted by Redis (counted out and reported to the store as evictions)."""

        def fn(client: Client) -> list[bytes]:
            found: list[bytes] = []
            with self._reconcile_lock:
                self._cursor = 0
                while True:
                    found += self._reconcile_step(client, RECONCILE_STEP)
                    if not self._cursor:
                        return found

        found = self._run("reconcile", fn)
        self._report(found)
        return len(found)

    def healthy(self) -> bool:
        """Whether Redis answers a PING now (tried even while the breaker is open; its outcome opens or closes
        the breaker)."""
        try:
            return bool(self._run("ping", lambda client: client.ping(), probe=True))
        except TierUnavailableError:
            return False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_UNAVAILABLE):
                client.close()
