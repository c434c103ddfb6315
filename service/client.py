"""``RemoteStore``: the store interface the adapters use, over a kvshelf gRPC server.

Blocks are encoded on the client (``encode_block`` with the chosen codec) and decoded and verified on the
client (a damaged or foreign value is a miss, never returned). The server only stores bytes.

Light to import: torch and the block format (``kvstore.block``, ``kvstore.encoding``, ``kvstore.store``) load only in
the methods that encode or decode blocks (``put_many``, ``get_many``, ``get_prepared_many``), so the admin and
event calls (``stats``, ``subscribe_events``; ``kvshelf stats`` and ``kvshelf events``) and the encoded-bytes ones
start without them (``tests/test_cli_imports.py``).

Errors: when the server cannot be reached (connection refused, DNS, TLS handshake, deadline), calls raise
``kvstore.errors.TierUnavailableError`` naming the address; any other refusal by the server (bad token,
another namespace, a quota, a bad input) raises ``RemoteStoreError`` carrying the gRPC status code.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

import grpc
import grpc.experimental

from kvshelf.kvstore.errors import ConfigError, KVShelfError, TierUnavailableError
from kvshelf.kvstore.keys import check_keys
from kvshelf.kvstore.limits import DEFAULT_MAX_DECODE_BYTES
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE, UNKNOWN_MODEL
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.proto import kvshelf_pb2_grpc as pb_grpc
from kvshelf.service.arena import DEFAULT_ARENA_BYTES, ArenaPool, ClientArena, shared_memory_supported
from kvshelf.service.bulk.client import DataPathClient, data_host
from kvshelf.service.bulk.transport import client_tls
from kvshelf.service.errors import ArenaUnavailable, DataPathUnavailable, RemoteStoreError, WireError
from kvshelf.service.fairness import RETRY_AFTER_METADATA
from kvshelf.service.limits import MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES
from kvshelf.service.wire import decode_response, encode_put_request

if TYPE_CHECKING:
    from kvshelf.kvstore.block import KVBlock, PreparedBlock

T = TypeVar("T")
log = logging.getLogger(__name__)
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_MAX_RETRY_PAUSE_S = 0.5
#: Fetched values at least this large are decoded on a few threads while the rest still arrive (``get_prepared_many``).
STREAM_DECODE_MIN_BYTES = 256 << 10
#: The largest value a get over the data path accepts (a bound against a server gone wrong, not a setting).
DATA_PATH_MAX_VALUE_BYTES = 1 << 32


#: per value, optional: ``(parent key, token ids)`` for its BlockStored events (``None`` parts: not sent)
Lineage = Sequence[tuple[bytes | None, Sequence[int] | None]]


#: Data in a PutBlocks call's first message: small, so a server that reads the first message before it admits the
#: call (dev mode: the message names the namespace) gets it at once, however large the first value is.
FIRST_MESSAGE_DATA_BYTES = 64 << 10


def put_requests(items: Iterable[tuple[bytes, bytes]], namespace: str, *, pin: bool = False,
                 lineage: Lineage | None = None, chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialised ``PutBlocks`` requests of encoded ``(key, value)`` pairs: each value in chunks of at most
    ``chunk_bytes`` (the call's first chunk at most ``FIRST_MESSAGE_DATA_BYTES``), its first chunk naming its key
    and total size (and its ``lineage`` entry, when given), the call's first message its namespace and ``pin``.
    One copy of the data (``service/wire.py``)."""
    first = True
    for i, (key, value) in enumerate(items):
        view, start = memoryview(value), 0
        while True:
            size = min(chunk_bytes, FIRST_MESSAGE_DATA_BYTES) if first else chunk_bytes
            data = view[start : start + size]
            last = start + size >= len(view)
            meta = pb.Chunk(last=last)
            if start == 0:
                meta.key, meta.total_size = key, len(value)
                if lineage is not None:
                    parent, tokens = lineage[i]
                    meta.parent_key = parent or b""
                    meta.token_ids.extend(tokens or ())
            head = pb.PutBlocksRequest(namespace=namespace, pin=pin) if first else None
            first = False
            yield encode_put_request(data, meta, head)
            start += size
            if last:
                break


def _retry_after_s(exc: grpc.RpcError) -> float | None:
    """Seconds the server asked a refused stream to wait before retrying; None when it is not such a refusal."""
    if not hasattr(exc, "code") or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_METADATA:
            try:
                return max(0.0, int(value) / 1000)
            except (TypeError, ValueError):
                return None
    return None


def is_local_address(address: str) -> bool:
    """Whether a gRPC target names this host: a Unix socket or a loopback address."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:").rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class RemoteStore:
    """A kvshelf server as a store: a ``kvstore.protocol.BlockStore``, like ``TieredStore``.

    Args:
        address: ``host:port`` of the server.
        token: bearer token (required when the server has a tokens file; it then fixes the namespace).
        namespace: the namespace sent in requests (dev mode servers use it; token servers check it), and what
            reads default to (``namespace=None``). Blocks are written, deleted and pinned in it only.
        codec: the codec blocks are encoded with before they are sent.
        tls_ca: PEM file (or bytes) of the CA that signed the server's certificate; enables TLS.
        timeout_s: deadline of every call.
        connect_timeout_s: how long the constructor waits for the server (0: do not wait).
        shared_memory: same-host fast path for gets (``service/arena.py``): the server writes values into a
            file this client owns in ``/dev/shm`` instead of sending them. ``None`` (default): on when the
            address is loopback or a Unix socket and ``/dev/shm`` is writable. The server falls back to the
            wire by itself when it cannot use the arena (another host, another user, turned off).
        arena_bytes: size of each arena (sparse; one per concurrent get); values that do not fit in what is
            left of it go over the wire.
        max_decode_bytes: a fetched block whose decoding may take more (``decode_cost_bytes``: its decoded size
            plus its codec's working memory, from its header) is a miss, refused before anything is allocated
            for it (default: the server's default max block size; match a server's ``--max-block``; None:
            only the block format's limits, ``kvstore.limits``).
        data_path: move the values of gets and puts over the server's bulk data path (``service/bulk/``: a raw
            TCP connection per call, TLS when ``tls_ca`` is given, values received straight into their buffers;
            gets then return ``bytearray`` values). Falls back to gRPC by itself when the server has no data path
            or its port cannot be reached. Same-host gets with ``shared_memory`` still use the arena. False: every
            byte over gRPC.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        codec: str = "raw",
        codec_params: dict[str, Any] | None = None,
        tls_ca: str | Path | bytes | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        shared_memory: bool | None = None,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        max_decode_bytes: int | None = DEFAULT_MAX_DECODE_BYTES,
        data_path: bool = True,
    ) -> None:
        if not namespace:
            raise ConfigError("namespace must be a non-empty string")
        if max_decode_bytes is not None and max_decode_bytes <= 0:
            raise ConfigError(f"max_decode_bytes must be > 0 (or None), got {max_decode_bytes}")
        self.max_decode_bytes = max_decode_bytes
        self.address = address
        self.namespace = namespace
        self.codec = codec
        self.codec_params = dict(codec_params or {})
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if shared_memory is None:
            shared_memory = is_local_address(address) and shared_memory_supported()
        self._arenas = ArenaPool(arena_bytes) if shared_memory else None
        self._finalizer = weakref.finalize(self, self._arenas.close) if self._arenas is not None else None
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   # server-streaming calls run in the caller's thread (no helper thread per call: ~1.5x faster)
                   (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
        ca = None
        if tls_ca is not None:
            ca = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = pb_grpc.KVShelfStub(self._channel)
        # the bulk messages skip the generated classes' copies (service/wire.py): GetBlocks responses are read as
        # raw bytes and parsed into views, PutBlocks requests are serialised with one copy of the data
        service = pb.DESCRIPTOR.services_by_name["KVShelf"].full_name
        self._get_blocks_raw = self._channel.unary_stream(
            f"/{service}/GetBlocks", request_serializer=pb.GetBlocksRequest.SerializeToString,
            response_deserializer=None,
        )
        self._put_blocks_raw = self._channel.stream_unary(
            f"/{service}/PutBlocks", request_serializer=None, response_deserializer=pb.PutBlocksResponse.FromString,
        )
        self._open_data_path_raw = self._channel.unary_stream(
            f"/{service}/OpenDataPath", request_serializer=pb.DataPathRequest.SerializeToString,
            response_deserializer=pb.DataPathResponse.FromString,
        )
        host = data_host(address) if data_path else None
        self._data_path = None if host is None else DataPathClient(
            host, self._open_data_path, timeout_s=timeout_s, tls=client_tls(ca) if ca is not None else None,
            max_value_bytes=DATA_PATH_MAX_VALUE_BYTES)
        self._data_path_retry_at = 0.0  # monotonic time before which calls use gRPC (the data path failed)
        if connect_timeout_s > 0:
            try:
                grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
            except grpc.FutureTimeoutError:
                self._channel.close()
                raise TierUnavailableError(
                    f"kvshelf server at {address} unreachable (no connection within {connect_timeout_s:g} s"
                    f"{'; TLS handshake failed?' if tls_ca is not None else ''})"
                ) from None

    # -- plumbing -------------------------------------------------------------------------------------

    def _error(self, exc: grpc.RpcError) -> KVShelfError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code in _UNREACHABLE:
            return TierUnavailableError(f"kvshelf server at {self.address} unavailable: {code.name}: {details}")
        return RemoteStoreError(code, details or "")

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, again after a jittered, growing pause while the server refuses it for want of a stream
        slot (RESOURCE_EXHAUSTED with the ``RETRY_AFTER_METADATA`` trailer: its tenant is at ``--tenant-streams``
        or every slot is taken), for at most ``timeout_s``. Other errors are raised at once."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while True:
            try:
                return attempt()
            except grpc.RpcError as exc:
                hint = _retry_after_s(exc)
                if hint is None:
                    raise
                pause = min(_MAX_RETRY_PAUSE_S, max(hint, 2 * pause))
                wait = pause * random.uniform(0.5, 1.5)  # jitter: refused clients must not come back in step
                if time.monotonic() + wait >= deadline:
                    raise
                time.sleep(wait)

    def _open_data_path(self, request: pb.DataPathRequest) -> tuple[Any, pb.DataPathResponse | None]:
        """An ``OpenDataPath`` call and its first response (retried while the server refuses it for want of a
        stream slot, as the other streams are)."""

        def attempt() -> tuple[Any, pb.DataPathResponse | None]:
            stream = self._open_data_path_raw(request, timeout=self.timeout_s, metadata=self._metadata)
            return stream, next(stream, None)

        return self._retrying(attempt)

    def _bulk(self) -> DataPathClient | None:
        """The data path when calls should use it now."""
        if self._data_path is None or time.monotonic() < self._data_path_retry_at:
            return None
        return self._data_path

    def _bulk_refused(self, exc: DataPathUnavailable) -> None:
        """The data path was refused: this call uses gRPC, and the next ones too for ``exc.retry_after_s`` (for
        good when the server has none)."""
        if exc.retry_after_s is None:
            log.info("kvshelf server at %s: %s; using gRPC", self.address, exc)
            if self._data_path is not None:
                self._data_path.close()
            self._data_path = None
        elif exc.retry_after_s > 0:
            log.warning("kvshelf server at %s: data path unusable (%s); using gRPC for %g s", self.address, exc,
                        exc.retry_after_s)
            self._data_path_retry_at = time.monotonic() + exc.retry_after_s
        else:
            log.info("kvshelf server at %s: %s; this call uses gRPC", self.address, exc)

    # -- writes ---------------------------------------------------------------------------------------

    def put_encoded_many(self, items: Sequence[tuple[bytes, bytes]], *, pin: bool = False) -> int:
        """Send already-encoded ``(key, value)`` pairs; return how many the server's first tier accepted.

        The blocks' BlockStored events (``subscribe_events``) carry the tokens their headers hold and the parent key
        their header's ``extra[PARENT_EXTRA]`` names (the generate adapter sets it): the signature stays the
        ``BlockStore`` protocol's. Other clients may send both in the first chunk (``put_requests(lineage=...)``)."""
        items = list(items)
        check_keys(k for k, _ in items)
        if not items:
            return 0
        bulk = self._bulk()
        if bulk is not None:
            try:
                return bulk.put(self.namespace, items, pin=pin)
            except DataPathUnavailable as exc:
                self._bulk_refused(exc)
            except grpc.RpcError as exc:
                raise self._error(exc) from None

        def attempt() -> pb.PutBlocksResponse:
            return self._put_blocks_raw(put_requests(items, self.namespace, pin=pin),
                                        timeout=self.timeout_s, metadata=self._metadata)

        try:
            return int(self._retrying(attempt).stored)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def put_many(self, entries: Sequence[tuple[bytes, KVBlock]], *, pin: bool = False) -> int:
        """Encode ``(key, block)`` pairs with this store's codec and send them."""
        from kvshelf.kvstore.encoding import encode_block  # torch: only where blocks are encoded

        entries = list(entries)
        check_keys(k for k, _ in entries)
        return self.put_encoded_many(
            [(key, encode_block(block, key, self.codec, self.codec_params)) for key, block in entries], pin=pin
        )

    # -- reads ----------------------------------------------------------------------------------------

    def get_encoded_many(
        self, keys: Sequence[bytes], *, fingerprint: str | None = None, namespace: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> list[bytes | None]:
        """Encoded values of ``keys`` as the server sent them (``None`` for misses): the server checked them
        (checksum, key, namespace, ``fingerprint`` when given); not checked again here.

        ``tokens``: tokens per key, so the server counts the retrieve hit rate in tokens too.
        """
        return self._fetch(keys, fingerprint=fingerprint, namespace=namespace, tokens=tokens)

    def _fetch(
        self, keys: Sequence[bytes], *, fingerprint: str | None, namespace: str | None,
        tokens: Sequence[int] | None, arrived: Callable[[int, bytes], None] | None = None,
    ) -> list[bytes | None]:
        """``get_encoded_many``; ``arrived(index, value)`` is called as each value is whole (in order)."""
        keys = check_keys(keys)
        out: list[bytes | None] = [None] * len(keys)
        if not keys:
            return out
        request = pb.GetBlocksRequest(namespace=namespace or self.namespace, keys=keys, fingerprint=fingerprint or "",
                                      tokens=list(tokens or []), max_chunk_bytes=MAX_CHUNK_BYTES)
        arena = self._take_arena()
        bulk = self._bulk() if arena is None else None
        if bulk is not None:
            try:
                return bulk.get(request.namespace, keys, fingerprint=request.fingerprint, tokens=request.tokens,
                                arrived=arrived)  # type: ignore[return-value]  # bytearray values: no copy
            except DataPathUnavailable as exc:
                self._bulk_refused(exc)
            except grpc.RpcError as exc:
                raise self._error(exc) from None
        if arena is not None:
            request.arena.name, request.arena.token = arena.name, arena.token
        try:
            self._receive(request, out, arena, arrived)
        except BaseException:
            if arena is not None:  # a server handler may still write into it: never reuse it
                arena.close()
            raise
        if arena is not None and self._arenas is not None:
            self._arenas.release(arena)
        return out

    def _take_arena(self) -> ClientArena | None:
        if self._arenas is None:
            return None
        try:
            return self._arenas.acquire()
        except OSError as exc:  # /dev/shm full or gone: the wire it is, from now on
            log.warning("shared-memory gets disabled: %s", exc)
            self._arenas = None
            return None

    def _receive(self, request: pb.GetBlocksRequest, out: list[bytes | None], arena: ClientArena | None,
                 arrived: Callable[[int, bytes], None] | None = None) -> None:
        parts: list[memoryview] = []
        try:
            for raw in self._get_stream(request):
                try:
                    msg = decode_response(raw)
                except WireError as exc:
                    raise RemoteStoreError(grpc.StatusCode.DATA_LOSS, f"malformed GetBlocks response: {exc}") from None
                if msg.miss:
                    continue
                if msg.in_arena:
                    if arena is None:
                        raise RemoteStoreError(grpc.StatusCode.DATA_LOSS, "server sent an arena offset unasked")
                    if msg.index < len(out):
                        out[msg.index] = value = arena.read(msg.arena_offset, msg.total_size)
                        if arrived is not None:
                            arrived(msg.index, value)
                    continue
                parts.append(msg.data)
                if msg.last:
                    if msg.index < len(out):
                        out[msg.index] = value = b"".join(parts)
                        if arrived is not None:
                            arrived(msg.index, value)
                    parts = []
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        except ArenaUnavailable as exc:
            raise RemoteStoreError(grpc.StatusCode.DATA_LOSS, f"bad shared-memory reply: {exc}") from None

    def _get_stream(self, request: pb.GetBlocksRequest) -> Iterator[bytes]:
        """The raw ``GetBlocks`` responses; a refused stream is retried (a refusal comes before any response)."""

        def attempt() -> tuple[bytes | None, Iterator[bytes]]:
            stream = self._get_blocks_raw(request, timeout=self.timeout_s, metadata=self._metadata)
            return next(stream, None), stream

        first, stream = self._retrying(attempt)
        if first is not None:
            yield first
            yield from stream

    def get_many(
        self, keys: Sequence[bytes], *, fingerprint: str, namespace: str | None = None, copy: bool = True,
        tokens: Sequence[int] | None = None,
    ) -> list[KVBlock | None]:
        """Blocks for ``keys`` (``None`` for misses), verified here: a damaged or foreign value is a miss."""
        from kvshelf.kvstore.encoding import decode_block  # torch: only where blocks are decoded

        return self._checked(keys, fingerprint, namespace, tokens,
                             functools.partial(decode_block, copy=copy))

    def get_prepared_many(
        self, keys: Sequence[bytes], *, fingerprint: str, namespace: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> list[PreparedBlock | None]:
        """Like ``get_many``, but checked and parsed only (see ``TieredStore.get_prepared_many``): the caller's
        ``cache_from_prepared`` decodes them straight into a cache."""
        from kvshelf.kvstore.encoding import prepare_block

        return self._checked(keys, fingerprint, namespace, tokens, prepare_block, parallel=True)

    def _checked(self, keys: Sequence[bytes], fingerprint: str, namespace: str | None,
                 tokens: Sequence[int] | None, read: Callable[..., T], *, parallel: bool = False) -> list[T | None]:
        """``read`` every fetched value (``parallel``: the entropy decoding of compressed blocks on a few threads,
        as ``TieredStore.get_prepared_many`` does); a damaged or foreign one is a miss."""
        from kvshelf.kvstore.tiered.decode import decode_all

        keys = list(keys)
        namespace = namespace or self.namespace

        def one(key: bytes, value: bytes) -> T:
            return read(value, expected_key=key, expected_fingerprint=fingerprint, expected_namespace=namespace,
                        max_decode_bytes=self.max_decode_bytes)

        if parallel and len(keys) > 1:
            outcomes = self._fetch_decoding(keys, namespace, fingerprint, tokens, one)
        else:
            values = self._fetch(keys, namespace=namespace, fingerprint=fingerprint, tokens=tokens)
            outcomes = decode_all(one, keys, values, parallel=False)
        out: list[T | None] = []
        for key, outcome in zip(keys, outcomes, strict=True):
            if isinstance(outcome, KVShelfError):
                log.warning("remote block %s rejected: %s", key.hex(), outcome)
                outcome = None
            elif isinstance(outcome, BaseException):
                raise outcome
            out.append(outcome)
        return out

    def _fetch_decoding(self, keys: list[bytes], namespace: str, fingerprint: str, tokens: Sequence[int] | None,
                        read: Callable[[bytes, bytes], T]) -> list[T | BaseException | None]:
        """Fetch ``keys`` and ``read`` each large value on a few threads as soon as it has arrived, so that its
        decoding overlaps the transfer of the ones after it (small values are read at the end, in this thread).
        Like ``decode_all``: each result, or the exception ``read`` raised, or None for a miss. The threads exit
        when the call ends (see ``decode_all`` on idle threads)."""

        def guarded(key: bytes, value: bytes) -> T | BaseException:
            try:
                return read(key, value)
            except Exception as exc:  # noqa: BLE001 - handed back to the caller, which sorts them out
                return exc

        pending: dict[int, Future[T | BaseException]] = {}
        pool: ThreadPoolExecutor | None = None

        def arrived(index: int, value: bytes) -> None:
            nonlocal pool
            if len(value) < STREAM_DECODE_MIN_BYTES:
                return
            if pool is None:
                pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kvshelf-decode")
            pending[index] = pool.submit(guarded, keys[index], value)

        try:
            values = self._fetch(keys, namespace=namespace, fingerprint=fingerprint, tokens=tokens, arrived=arrived)
            return [pending[i].result() if i in pending else None if value is None else guarded(key, value)
                    for i, (key, value) in enumerate(zip(keys, values, strict=True))]
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def lookup_prefix(
        self, keys: Sequence[bytes], *, namespace: str | None = None, model: str = UNKNOWN_MODEL,
        tokens: Sequence[int] | None = None,
    ) -> int:
        """How many of ``keys``, in order, the server holds (``tokens`` per key: hit rate in tokens too)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        request = pb.LookupPrefixRequest(namespace=namespace or self.namespace, keys=keys, model=model,
                                         tokens=list(tokens or []))
        return int(self._call("LookupPrefix", request).found)

    def held(self, keys: Iterable[bytes], *, namespace: str | None = None) -> list[bool]:
        """Per key: does the server hold it (in ``namespace``, default this store's). Not counted as a lookup."""
        keys = check_keys(keys)
        return list(self._call("Contains", pb.KeysRequest(namespace=namespace or self.namespace, keys=keys)).present)

    contains = held

    # -- management -----------------------------------------------------------------------------------

    def _keys_call(self, method: str, keys: Iterable[bytes]) -> int:
        keys = check_keys(keys)
        return int(self._call(method, pb.KeysRequest(namespace=self.namespace, keys=keys)).count)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys`` (and their pins); return how many distinct keys were held."""
        return self._keys_call("Delete", keys)

    def pin(self, keys: Iterable[bytes]) -> int:
        """Pin the held ones of ``keys`` (never evicted); return how many distinct keys were pinned."""
        return self._keys_call("Pin", keys)

    def unpin(self, keys: Iterable[bytes]) -> int:
        """Unpin ``keys``; return how many distinct keys were pinned."""
        return self._keys_call("Unpin", keys)

    def clear(self, namespace: str | None = None) -> int:
        """Remove every block of the namespace (only one's own); return how many keys were removed."""
        return int(self._call("Clear", pb.ClearRequest(namespace=namespace or self.namespace)).count)

    def subscribe_events(self, from_seq: int = 0, *, namespace: str | None = None) -> EventSubscription:
        """Open a ``SubscribeEvents`` stream of the namespace's KV events (``service/events.py``): live ones only
        (``from_seq`` 0), or every kept one from sequence ``from_seq`` on, then live. Iterate it for
        ``SubscribeEventsResponse`` messages; resume after a failure with ``from_seq=subscription.next_seq``."""
        if not isinstance(from_seq, int) or from_seq < 0:
            raise ConfigError(f"from_seq must be an integer >= 0, got {from_seq!r}")
        request = pb.SubscribeEventsRequest(namespace=namespace or self.namespace, from_seq=from_seq)
        return EventSubscription(self._stub.SubscribeEvents(request, metadata=self._metadata), self._error)

    def stats(self) -> dict[str, Any]:
        """The server's stats of this namespace (shaped like ``TieredStore.stats()``, plus usage and health)."""
        return json.loads(self._call("Stats", pb.StatsRequest(namespace=self.namespace)).json)

    def close(self) -> None:
        if self._data_path is not None:
            self._data_path.close()
        self._channel.close()
        if self._finalizer is not None:
            self._finalizer()  # removes this client's arenas from /dev/shm

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventSubscription:
    """An open ``SubscribeEvents`` stream (``RemoteStore.subscribe_events``): iterate it for the server's
    ``SubscribeEventsResponse`` messages (the first carries ``started``; ``lost`` says events are gone: resync).
    ``next_seq``: where to resume (every event of the namespace below it was read). Failures raise
    ``TierUnavailableError`` (server gone) or ``RemoteStoreError`` (RESOURCE_EXHAUSTED: too slow, resume);
    ``cancel()`` (from any thread) ends the iteration quietly."""

    def __init__(self, call: Any, error: Callable[[grpc.RpcError], KVShelfError]) -> None:
        self._call = call
        self._error = error
        self._cancelled = False
        self.started: pb.SubscriptionStarted | None = None
        self.next_seq = 0

    def __iter__(self) -> Iterator[pb.SubscribeEventsResponse]:
        try:
            for message in self._call:
                if message.HasField("started"):
                    self.started = message.started
                if message.next_seq:
                    self.next_seq = message.next_seq
                yield message
        except grpc.RpcError as exc:
            if self._cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise self._error(exc) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
