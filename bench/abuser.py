"""The abusive tenant of ``kvshelf bench abuse``: one process (``python -m kvshelf.bench.abuser SPEC_JSON``).

Protocol over its pipes (JSON, no pickle), like ``bench/store_worker.py``: it connects and builds its payloads,
prints ``ready``, waits for one line on stdin (the common start), attacks for ``spec["seconds"]`` and prints one
JSON object (``Tally.report``). Every call has a deadline, every stream is ended by the window it belongs to and
calls still running when the time is up are cancelled (and not counted), so the process ends on time whatever
the server does.

Two threads of calls, plus one holding streams (the abuse the issue lists; ``spec["attacks"]`` may pick some):

- holder: windows of ``hold_s`` seconds (``gap_s`` apart) during which it keeps ``idle_streams`` PutBlocks
  streams open that send one chunk and then nothing (``idle_stream``; more than the per-tenant stream cap), and
  ``slow_streams`` uploads trickling 1 KiB every 0.25 s (``slowloris``). A refused stream is reopened 0.2 s
  later; a stream still open when its window ends is cancelled and counted ``HELD`` (the server let it live).
- bad input: blocks declaring more than ``--max-block`` (``oversized_declared``), larger undeclared ones
  (``oversized_undeclared``), one call carrying more than ``--max-call`` (``oversized_call``), one gRPC message
  over the message limit (``oversized_message``), a tiny ``sparse`` block declaring a 64 MiB shape (``bomb``),
  garbage and truncated protobuf (``malformed``), keys of the wrong length (``wrong_key``), a block header of
  100,000 nested JSON arrays (``nested_header``) and a raw block whose payload does not match its shape
  (``bad_payload``).
- memory: calls that would make the server hold memory past its limits (issue findings H1 and H2): 60 PutBlocks
  messages of 8 MiB padding each (an unknown field, ``padded_unknown``; or token ids, ``padded_token_ids``) with
  empty data, then one small value; a valid block sent 1 KiB at a time in messages padded to 200 KiB
  (``padded_chunks``: stored, holding its data only); a 20 KB ``cachegen`` block whose header says ``rotate`` at
  ``head_dim`` 8192 (``hadamard_bomb``, a dense Walsh-Hadamard matrix of 512 MiB for a naive decoder: past the
  header limits, so refused), and a real rotated block at the largest head dim the limits admit (``hadamard_max``,
  accepted), read back and decoded here as a client does (``hadamard_read``; this process's peak RSS growth while
  decoding is reported as ``client_decode_growth``).
- quota: every ``REFILL_S`` seconds clears its namespace, puts new blocks until the quota refuses them
  (``over_quota``), one large put while over quota (``over_quota_big``), then holds tiny blocks and overwrites
  them with large ones (``overwrite_quota``); in between, while at its quota, keeps sending all three kinds,
  which must be refused; it reads its usage from Stats after each round (``max_held_bytes``).

- dupkeys (only when asked for): one large block of its own (``dupkeys_put``) read with its key named many times:
  GetBlocks of it x 64 (``dupkeys_grpc``) and a data-path get of it x 16 (``dupkeys_datapath``), each value
  compared with what was put (``WRONG`` when it differs; ``MISS`` when the quota attack cleared it meanwhile), and
  two ``OpenDataPath`` gets of it x 16 at once whose tickets are taken and never presented
  (``dupkeys_unclaimed``: they must end when the ticket expires, having read nothing).
- silentdata (only when asked for): keeps ``silent_data`` (48) connections open to the data port that send nothing,
  or only the 4 bytes of a hello's magic, reopening those the server closes (a quarter of them per 0.2 s at most);
  each is counted by the status frame it got (``silent_data``: the handshake deadline, or refused for the per-host
  cap) or ``CLOSED`` without one.

- cpu (a control, only when asked for): burns ``cpu_share`` of one core and calls nothing.

- slowhttp and labels (only when asked for; ``bench/abuse_http.py``): silent and slow connections to ``/metrics``
  and the dashboard while both must answer, and made-up model names as metric labels.
- subscriptions and replay (only when asked for; ``bench/abuse_events.py``): raw ZeroMQ peers flooding the KV events
  publisher with distinct and oversized subscriptions and frames, and its replay endpoint with requests never read,
  floods of requests, bursts past its replay jobs, requests without a topic and malformed ones.

Each call is counted by kind and by the status code the server ended it with (``OK`` when accepted).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvshelf.bench.abuse_blocks import (
    bad_payload_block,
    block_key,
    bomb_block,
    first_chunk,
    hadamard_block,
    largest_hadamard_block,
    nested_header_block,
    ones_block,
    padded_message,
    put_messages,
)
from kvshelf.bench.abuse_events import EVENT_ATTACKS, EVENTS_EXPECTED, start_event_attacks
from kvshelf.bench.abuse_http import HTTP_ATTACKS, HTTP_EXPECTED, start_http_attacks
from kvshelf.bench.common import PeakRss
from kvshelf.kvstore import encode_block
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.server import CHUNK_BYTES, MAX_MESSAGE_BYTES

KiB, MiB = 1 << 10, 1 << 20
METHOD = "/kvshelf.v1.KVShelf/"
CALL_TIMEOUT_S = 10.0
#: Codes a stream the abuser holds open (idle or slow) may end with: the stream cap, the idle timeout, the
#: minimum upload rate. ``HELD``: still open when its window ended (cancelled by the abuser).
STREAM_CODES = frozenset({"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "ABORTED", "HELD"})
#: What the server may answer each kind of abuse with. PutBlocks kinds may also meet the per-tenant stream cap
#: (RESOURCE_EXHAUSTED) while the holder's streams fill it.
EXPECTED: dict[str, frozenset[str]] = {
    "idle_stream": STREAM_CODES,
    "slowloris": STREAM_CODES,
    "oversized_declared": frozenset({"RESOURCE_EXHAUSTED"}),
    "oversized_undeclared": frozenset({"RESOURCE_EXHAUSTED"}),
    # its values are garbage: the server checks each value as it completes, so the first one may end the call
    "oversized_call": frozenset({"RESOURCE_EXHAUSTED", "DATA_LOSS"}),
    "oversized_message": frozenset({"RESOURCE_EXHAUSTED"}),
    "bomb": frozenset({"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}),
    "malformed": frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "wrong_key": frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "nested_header": frozenset({"DATA_LOSS", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "bad_payload": frozenset({"DATA_LOSS", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "padded_unknown": frozenset({"RESOURCE_EXHAUSTED"}),
    "padded_token_ids": frozenset({"RESOURCE_EXHAUSTED"}),
    # within every limit once the padding is dropped: stored (or refused at the tenant's quota)
    "padded_chunks": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    # a head dim past the header limits: refused as a damaged block (no writer makes one)
    "hadamard_bomb": frozenset({"DATA_LOSS", "RESOURCE_EXHAUSTED"}),
    # the largest rotated block the limits admit: valid, served within the limits (or over the quota)
    "hadamard_max": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "hadamard_read": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "over_quota": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "over_quota_big": frozenset({"RESOURCE_EXHAUSTED"}),
    "overwrite_quota": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "clear": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "stats": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    # duplicate keys: served, each value right (a MISS when the quota attack cleared the block meanwhile)
    "dupkeys_put": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "dupkeys_grpc": frozenset({"OK", "MISS", "RESOURCE_EXHAUSTED"}),
    "dupkeys_datapath": frozenset({"OK", "MISS", "RESOURCE_EXHAUSTED"}),
    # tickets never presented: the call ends when the ticket expires (or is refused for the stream cap)
    "dupkeys_unclaimed": frozenset({"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}),
    # silent data connections: the hello's deadline, the listener's caps, or closed (a kept place given up)
    "silent_data": frozenset({"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CLOSED", "HELD"}),
}
#: Seconds between two clear-and-refill cycles of the quota attack.
REFILL_S = 5.0
#: The abuser's threads: held streams, bad input, quota abuse (``--attacks`` picks some); duplicate keys in gets,
#: silent data connections (the bulk data path's), the HTTP attacks (``bench/abuse_http.py``) and the KV events attacks
#: (``bench/abuse_events.py``) run only when named.
ATTACKS = ("streams", "bad", "memory", "quota", "dupkeys", "silentdata", *HTTP_ATTACKS, *EVENT_ATTACKS)
#: The attacks a run makes unless told which.
DEFAULT_ATTACKS = ("streams", "bad", "memory", "quota")
#: Data connections the ``silentdata`` attack keeps open (the server's --data-handshakes is 64, 32 per host).
SILENT_DATA = 48
#: The silentdata attack's pace: every tick it reopens at most a quarter of its connections.
SILENT_TICK_S = 0.2
#: A control, not an attack (never in the default): ``cpu`` burns ``spec["cpu_share"]`` of one core in the abuser
#: process and calls nothing, to tell what the honest tenant loses to two cores shared with a busy process from
#: what it loses to the server.
CONTROLS = ("cpu",)
#: The default share of one core the ``cpu`` control burns: about what the four attacks together cost the abuser
#: process (178 s of CPU in 300 s of ``kvshelf bench abuse --seconds 600``).
CPU_SHARE = 0.6
#: One duty cycle of the ``cpu`` control: it spins ``cpu_share`` of it and sleeps the rest.
CPU_PERIOD_S = 0.01
EXPECTED.update(HTTP_EXPECTED)  # what the server may answer the HTTP attacks with
EXPECTED.update(EVENTS_EXPECTED)  # and the KV events attacks
#: Kinds that must never be accepted (``OK``): the abuse itself.
MUST_REFUSE = frozenset(k for k, codes in EXPECTED.items() if "OK" not in codes)
#: A RESOURCE_EXHAUSTED refusal at admission (the tenant's stream cap, or no stream slot left), before the
#: server looked at what the call carries: counted apart, so a bomb refused only for the cap is told apart.
ADMISSION = re.compile(r"stream slots|streaming calls open|tenant-streams|too many of its calls failed", re.IGNORECASE)


@dataclass
class Tally:
    """Calls per kind and status code, and the most bytes the abuser's namespace was seen holding."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    kinds: dict[str, Counter[str]] = field(default_factory=dict)
    admission: Counter[str] = field(default_factory=Counter)
    max_held_bytes: int = 0
    client_decode_growth: int = 0  # the most this process's RSS grew while decoding a fetched hostile block

    def record(self, kind: str, code: str, details: str = "") -> None:
        with self.lock:
            self.kinds.setdefault(kind, Counter())[code] += 1
            if code == "RESOURCE_EXHAUSTED" and ADMISSION.search(details):
                self.admission[kind] += 1

    def failed(self, kind: str, exc: grpc.RpcError) -> str:
        """Count a refused call; return its code."""
        code = code_of(exc)
        details = exc.details() if hasattr(exc, "details") else ""
        self.record(kind, code, details if isinstance(details, str) else "")
        return code

    def decode_growth(self, nbytes: int) -> None:
        with self.lock:
            self.client_decode_growth = max(self.client_decode_growth, nbytes)

    def held(self, nbytes: int) -> None:
        with self.lock:
            self.max_held_bytes = max(self.max_held_bytes, nbytes)

    def report(self, seconds: float) -> dict[str, Any]:
        with self.lock:
            kinds = {k: dict(sorted(c.items())) for k, c in sorted(self.kinds.items())}
            admission = dict(sorted(self.admission.items()))
        calls = sum(n for codes in kinds.values() for code, n in codes.items() if code != "HELD")
        return {"seconds": round(seconds, 3), "calls": calls, "calls_per_s": round(calls / max(seconds, 1e-9), 1),
                "kinds": kinds, "refused_at_admission": admission, "max_held_bytes": self.max_held_bytes,
                "client_decode_growth": self.client_decode_growth}


def code_of(exc: grpc.RpcError) -> str:
    """The status code's name (``NO_CODE`` for an error that carries none: never mistaken for the server's)."""
    code = exc.code() if hasattr(exc, "code") else None
    return code.name if isinstance(code, grpc.StatusCode) else "NO_CODE"


def _compare(got: list[Any], value: bytes) -> str:
    """``OK`` when every answer is ``value``; ``WRONG`` when one is another value; else ``MISS``."""
    if any(v is not None and bytes(v) != value for v in got):
        return "WRONG"
    return "OK" if all(v is not None for v in got) else "MISS"


class Abuser:
    """The abusive tenant's calls over one raw channel (requests and responses as bytes)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.namespace: str = spec["namespace"]
        self.max_block: int = spec["max_block"]
        self.max_call: int = spec["max_call"]
        self.quota: int = spec["quota"]
        self.metadata = (("authorization", f"Bearer {spec['token']}"),)
        self.channel = grpc.insecure_channel(spec["address"], options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        grpc.channel_ready_future(self.channel).result(timeout=10)
        self.put = self.channel.stream_unary(f"{METHOD}PutBlocks", request_serializer=None, response_deserializer=None)
        self.get = self.channel.unary_stream(f"{METHOD}GetBlocks", request_serializer=None, response_deserializer=None)
        self.unary = {name: self.channel.unary_unary(f"{METHOD}{name}", request_serializer=None,
                                                     response_deserializer=None)
                      for name in ("Contains", "Stats", "Clear")}
        self.tally = Tally()
        self.stop = threading.Event()
        self._calls: set[Any] = set()
        self._calls_lock = threading.Lock()
        self.serial = itertools.count()
        self._next_fill = 0.0  # when quota_round next clears and refills the quota
        # payloads built once: a large block's tensors (only the key changes per put) and the fixed attacks
        self.big_shape = (4, 2, max(1, (self.max_block * 7 // 8) // (4 * 2 * 128 * 2 * 2)), 128)
        self.big_template = ones_block(self.big_shape, self.namespace)
        self.tiny_template = ones_block((1, 1, 1, 8), self.namespace)
        self.garbage = bytes(range(256)) * (CHUNK_BYTES // 256)
        self.open_data_path = self.channel.unary_stream(f"{METHOD}OpenDataPath", request_serializer=None,
                                                        response_deserializer=pb.DataPathResponse.FromString)
        self._dup: tuple[bytes, bytes] | None = None  # the dupkeys attack's block
        self._remote: Any = None  # its RemoteStore (the data path), made on first use

    def _key(self, label: str) -> bytes:
        return block_key(f"abuser:{label}:{next(self.serial)}:{os.getpid()}")

    def _big(self, key: bytes) -> bytes:
        return encode_block(self.big_template, key)

    # -- calls ----------------------------------------------------------------------------------------

    def _tracked(self, call: Any) -> Any:
        """Register a call in flight: ``run`` cancels those still running when the time is up."""
        with self._calls_lock:
            self._calls.add(call)
        if self.stop.is_set():
            call.cancel()
        return call

    def _done(self, call: Any) -> None:
        with self._calls_lock:
            self._calls.discard(call)

    def _outcome(self, kind: str, wait: Callable[[], Any], call: Any) -> tuple[str, Any]:
        """Wait for ``call``; count its code, except for a call cancelled by the end of the run (not counted)."""
        try:
            result = wait()
        except grpc.FutureCancelledError:
            return "CANCELLED", None
        except grpc.RpcError as exc:
            if self.stop.is_set() and code_of(exc) == "CANCELLED":
                return "CANCELLED", None
            return self.tally.failed(kind, exc), None
        finally:
            self._done(call)
        self.tally.record(kind, "OK")
        return "OK", result

    def call_put(self, kind: str, messages: Iterable[bytes]) -> str:
        future = self._tracked(self.put.future(iter(messages), timeout=CALL_TIMEOUT_S, metadata=self.metadata))
        return self._outcome(kind, future.result, future)[0]

    def call_unary(self, kind: str, method: str, request: bytes) -> tuple[str, bytes | None]:
        future = self._tracked(self.unary[method].future(request, timeout=CALL_TIMEOUT_S, metadata=self.metadata))
        return self._outcome(kind, future.result, future)

    def call_get(self, kind: str, request: bytes) -> str:
        call = self._tracked(self.get(request, timeout=CALL_TIMEOUT_S, metadata=self.metadata))
        return self._outcome(kind, lambda: sum(1 for _ in call), call)[0]

    # -- bad input ------------------------------------------------------------------------------------

    def bad_input_round(self) -> None:
        ns, pace = self.namespace, self.spec["pace_s"]
        key = self._key("bad")
        truncated = first_chunk(ns, key, b"x" * 1024)
        attacks: list[Callable[[], object]] = [
            lambda: self.call_put("oversized_declared", [first_chunk(ns, key, b"x" * KiB, self.max_block + 1)]),
            lambda: self.call_put("malformed", [b"\xff" * 64]),
            lambda: self.call_put("malformed", [truncated[: len(truncated) // 2]]),
            lambda: self.call_put("malformed", [b"\x0a\xff\xff\xff\x0f"]),
            lambda: self.call_unary("malformed", "Contains", b"\xff" * 64),
            lambda: self.call_put("oversized_undeclared", self._undeclared(key)),
            lambda: self.call_put("wrong_key", [first_chunk(ns, b"short", b"x", 0)]),
            lambda: self.call_unary("wrong_key", "Contains",
                                    pb.KeysRequest(namespace=ns, keys=[b"abc"]).SerializeToString()),
            lambda: self.call_get("wrong_key", pb.GetBlocksRequest(namespace=ns, keys=[b"k" * 20]).SerializeToString()),
            lambda: self.call_put("bomb", put_messages([(key, bomb_block(key, ns))], ns)),
            lambda: self.call_put("nested_header", put_messages([(key, nested_header_block(key, ns))], ns)),
            lambda: self.call_put("bad_payload", put_messages([(key, bad_payload_block(key, ns))], ns)),
            lambda: self.call_put("oversized_message", [first_chunk(ns, key, self.garbage * 2)]),
            lambda: self.call_put("oversized_call", self._over_call()),
        ]
        for attack in attacks:
            if self.stop.is_set():
                return
            attack()
            time.sleep(pace)

    def _undeclared(self, key: bytes) -> Iterator[bytes]:
        """One value of max_block + 1 MiB, no total_size: the server can only tell by counting."""
        sent, first = 0, True
        while sent <= self.max_block:
            chunk = pb.Chunk(data=self.garbage[: MiB], last=False)
            if first:
                chunk.key = key
            yield pb.PutBlocksRequest(namespace=self.namespace if first else "", chunk=chunk).SerializeToString()
            sent, first = sent + MiB, False

    def _over_call(self) -> Iterator[bytes]:
        """Values under max_block each, more than max_call in all (garbage: refused before any verification)."""
        size = min(self.max_block - KiB, CHUNK_BYTES)
        for n in range(self.max_call // size + 2):
            chunk = pb.Chunk(key=self._key("call"), data=self.garbage[:size], last=True, total_size=size)
            yield pb.PutBlocksRequest(namespace=self.namespace if n == 0 else "", chunk=chunk).SerializeToString()

    # -- memory (H1, H2) --------------------------------------------------------------------------------

    def memory_round(self) -> None:
        ns, pace = self.namespace, self.spec["pace_s"]
        for padding in ("unknown", "token_ids"):
            if self.stop.is_set():
                return
            self.call_put(f"padded_{padding}", self._padded(padding))
            time.sleep(pace)
        key = self._key("padded-chunks")
        self.call_put("padded_chunks", self._padded_chunks(key, encode_block(self.tiny_template, key)))
        time.sleep(pace)
        key = self._key("hadamard")
        if self.call_put("hadamard_bomb", put_messages([(key, hadamard_block(key, ns))], ns)) == "OK":
            self._read_hadamard(key)
        time.sleep(pace)
        key = self._key("hadamard-max")
        if self.call_put("hadamard_max", put_messages([(key, largest_hadamard_block(key, ns))], ns)) == "OK":
            self._read_hadamard(key)
        time.sleep(pace)

    def _padded(self, padding: str) -> Iterator[bytes]:
        """60 messages of 8 MiB padding with empty data (the first names a small value), then the value."""
        key = self._key("padded")
        value = encode_block(self.tiny_template, key)
        for n in range(60):
            if self.stop.is_set():
                return
            chunk = pb.Chunk(key=key, total_size=len(value)) if n == 0 else pb.Chunk()
            yield padded_message(self.namespace if n == 0 else "", chunk, padding, 8 * MiB)
        yield pb.PutBlocksRequest(chunk=pb.Chunk(data=value, last=True)).SerializeToString()

    def _padded_chunks(self, key: bytes, value: bytes) -> Iterator[bytes]:
        """``value`` 1 KiB at a time, each message padded with 200 KiB of an unknown field."""
        for n, start in enumerate(range(0, len(value), KiB)):
            chunk = pb.Chunk(data=value[start : start + KiB], last=start + KiB >= len(value))
            if n == 0:
                chunk.key, chunk.total_size = key, len(value)
            yield padded_message(self.namespace if n == 0 else "", chunk, "unknown", 200 * KiB)

    def _read_hadamard(self, key: bytes) -> None:
        """Get the stored Hadamard block back and decode it as a client does; record the decode's RSS growth."""
        from kvshelf.kvstore import decode_block
        from kvshelf.kvstore.errors import KVShelfError

        chunks: list[bytes] = []

        def fetch() -> int:
            for raw in self.get(pb.GetBlocksRequest(namespace=self.namespace, keys=[key]).SerializeToString(),
                                timeout=CALL_TIMEOUT_S, metadata=self.metadata):
                chunks.append(raw)
            return len(chunks)

        code, _ = self._outcome("hadamard_read", fetch, None)
        if code != "OK":
            return
        value = b"".join(bytes(pb.GetBlocksResponse.FromString(raw).chunk.data) for raw in chunks)

        def decode() -> None:
            with contextlib.suppress(KVShelfError):
                decode_block(value, expected_key=key)

        with PeakRss() as peak:
            decode()
        self.tally.decode_growth(peak.growth)

    # -- quota ----------------------------------------------------------------------------------------

    def _held_bytes(self) -> None:
        code, raw = self.call_unary("stats", "Stats", pb.StatsRequest(namespace=self.namespace).SerializeToString())
        if code == "OK" and raw is not None:
            usage = json.loads(pb.StatsResponse.FromString(raw).json).get("usage", {})
            self.tally.held(int(usage.get("bytes", 0)))

    def quota_round(self) -> None:
        """Every ``REFILL_S`` seconds: clear, fill the quota and hold it (``_fill_quota``); in between, while at
        the quota, the puts that go past it: new blocks, one call as large as allowed, held blocks overwritten
        with larger ones. Each of those must be refused (a tenant rewriting within its quota is a heavy user,
        not an abuser: its cost is the filling, every few seconds, not every round)."""
        if time.monotonic() >= self._next_fill:
            self._fill_quota()
            self._next_fill = time.monotonic() + REFILL_S
            return
        ns, pace = self.namespace, self.spec["pace_s"]
        per_call = max(1, min(self.max_call, self.quota) * 2 // 3 // (self.max_block * 7 // 8))
        values = [(k, self._big(k)) for k in (self._key("quota") for _ in range(per_call))]
        self.call_put("over_quota", put_messages(values, ns))
        time.sleep(pace)
        count = max(1, (self.max_call - MiB) // (self.max_block * 7 // 8))
        self.call_put("over_quota_big", put_messages([(k, self._big(k)) for k in
                                                      (self._key("big") for _ in range(count))], ns))
        time.sleep(pace)
        keys = self._overwrite_keys()
        self.call_put("overwrite_quota", put_messages([(k, self._big(k)) for k in keys[-2:]], ns))
        time.sleep(pace)
        self._held_bytes()

    def _overwrite_keys(self) -> list[bytes]:
        count = max(2, 2 * self.quota // (self.max_block * 7 // 8))
        return [block_key(f"abuser:overwrite:{i}") for i in range(count)]

    def _fill_quota(self) -> None:
        ns, pace = self.namespace, self.spec["pace_s"]
        per_call = max(1, min(self.max_call, self.quota) * 2 // 3 // (self.max_block * 7 // 8))
        self.call_unary("clear", "Clear", pb.ClearRequest(namespace=ns).SerializeToString())
        refused = False
        for _ in range(4):
            if self.stop.is_set():
                return
            values = [(k, self._big(k)) for k in (self._key("quota") for _ in range(per_call))]
            refused = self.call_put("over_quota", put_messages(values, ns)) != "OK"
            time.sleep(pace)
            if refused:
                break
        self._held_bytes()
        if refused and not self.stop.is_set():  # over quota: one call as large as allowed, still refused
            count = max(1, (self.max_call - MiB) // (self.max_block * 7 // 8))
            self.call_put("over_quota_big", put_messages([(k, self._big(k)) for k in
                                                          (self._key("big") for _ in range(count))], ns))
        # overwrite attack: hold small blocks, then replace them with large ones (must count at their new size)
        self.call_unary("clear", "Clear", pb.ClearRequest(namespace=ns).SerializeToString())
        keys = self._overwrite_keys()
        self.call_put("overwrite_quota", put_messages([(k, encode_block(self.tiny_template, k)) for k in keys], ns))
        for start in range(0, len(keys), 2):
            if self.stop.is_set():
                return
            self.call_put("overwrite_quota", put_messages([(k, self._big(k)) for k in keys[start : start + 2]], ns))
            time.sleep(pace)
        self._held_bytes()

    # -- held streams ---------------------------------------------------------------------------------

    def _open(self, kind: str, requests: Callable[[threading.Event], Iterator[bytes]]
              ) -> tuple[str, grpc.Future, threading.Event]:
        release = threading.Event()
        future = self.put.future(requests(release), timeout=CALL_TIMEOUT_S + self.spec["hold_s"],
                                 metadata=self.metadata)
        future.add_done_callback(lambda _f: release.set())
        return kind, future, release

    def _idle(self, release: threading.Event) -> Iterator[bytes]:
        yield first_chunk(self.namespace, self._key("idle"), b"i" * KiB, 4 * KiB)
        release.wait()

    def _slow(self, release: threading.Event) -> Iterator[bytes]:
        yield first_chunk(self.namespace, self._key("slow"), b"s" * KiB, 2 * MiB)
        while not release.wait(0.25):
            yield pb.PutBlocksRequest(chunk=pb.Chunk(data=b"s" * KiB)).SerializeToString()

    def _finish(self, kind: str, future: grpc.Future) -> None:
        try:
            future.result(timeout=0)
            self.tally.record(kind, "OK")
        except grpc.RpcError as exc:
            self.tally.failed(kind, exc)
        except Exception:  # noqa: BLE001 - a future that cannot say: count it, never crash the abuser
            self.tally.record(kind, "CLIENT_ERROR")

    def hold_window(self, end: float) -> None:
        """Keep the idle and slow streams open until ``end``: reopen those the server ends, 0.2 s later."""
        # slow streams first: they take stream slots before the idle ones fill the tenant's cap
        wanted = {"slowloris": (self.spec["slow_streams"], self._slow),
                  "idle_stream": (self.spec["idle_streams"], self._idle)}
        active: list[tuple[str, grpc.Future, threading.Event]] = []
        while time.monotonic() < end and not self.stop.is_set():
            for kind, (count, requests) in wanted.items():
                for _ in range(count - sum(1 for k, _, _ in active if k == kind)):
                    active.append(self._open(kind, requests))
            time.sleep(0.2)
            for entry in [e for e in active if e[1].done()]:
                active.remove(entry)
                self._finish(entry[0], entry[1])
        for kind, future, release in active:
            if future.cancel():
                self.tally.record(kind, "HELD")
            else:
                self._finish(kind, future)
            release.set()

    # -- the bulk data path: duplicate keys, silent connections ----------------------------------------

    def _open_data_path(self, keys: list[bytes]) -> Any:
        """A tracked ``OpenDataPath`` GET of ``keys`` (the call; its first response is its ticket)."""
        request = pb.DataPathRequest(namespace=self.namespace, op=pb.DataPathRequest.GET, keys=keys)
        return self._tracked(self.open_data_path(request.SerializeToString(), timeout=CALL_TIMEOUT_S,
                                                 metadata=self.metadata))

    def _dup_value(self) -> tuple[bytes, bytes] | None:
        """The block the dupkeys attack reads (put again when the quota attack cleared it); None when refused."""
        if self._dup is None:
            key = self._key("dup")
            self._dup = (key, self._big(key))
        key, value = self._dup
        held = self.call_unary("dupkeys_put", "Contains",
                               pb.KeysRequest(namespace=self.namespace, keys=[key]).SerializeToString())
        if held[0] == "OK" and held[1] is not None and pb.ContainsResponse.FromString(held[1]).prefix == 1:
            return self._dup
        return self._dup if self.call_put("dupkeys_put", put_messages([(key, value)], self.namespace)) == "OK" else None

    def _dup_grpc(self, key: bytes, value: bytes, count: int) -> None:
        """GetBlocks of ``key`` x ``count``: every answer ``value``."""
        parts: dict[int, list[bytes]] = {}

        def fetch() -> int:
            call = self.get(pb.GetBlocksRequest(namespace=self.namespace, keys=[key] * count).SerializeToString(),
                            timeout=CALL_TIMEOUT_S, metadata=self.metadata)
            for raw in call:
                response = pb.GetBlocksResponse.FromString(raw)
                if response.HasField("chunk"):
                    parts.setdefault(response.index, []).append(bytes(response.chunk.data))
            return len(parts)

        try:
            fetch()
        except grpc.RpcError as exc:
            self.tally.failed("dupkeys_grpc", exc)
            return
        got = [b"".join(parts[i]) if i in parts else None for i in range(count)]
        self.tally.record("dupkeys_grpc", _compare(got, value))

    def _dup_datapath(self, key: bytes, value: bytes, count: int) -> None:
        """A data-path get of ``key`` x ``count`` through ``RemoteStore``: every answer ``value``."""
        from kvshelf.kvstore.errors import TierUnavailableError
        from kvshelf.service.errors import RemoteStoreError

        try:
            got = self.remote().get_encoded_many([key] * count)
        except RemoteStoreError as exc:
            self.tally.record("dupkeys_datapath", exc.code.name)
            return
        except TierUnavailableError:
            self.tally.record("dupkeys_datapath", "UNAVAILABLE")
            return
        self.tally.record("dupkeys_datapath", _compare(got, value))

    def _dup_unclaimed(self, key: bytes, count: int, calls: int = 2) -> None:
        """``calls`` OpenDataPath gets of ``key`` x ``count`` at once, their tickets taken and never presented."""
        opened = []
        for _ in range(calls):
            call = self._open_data_path([key] * count)
            try:
                next(call)
            except grpc.RpcError as exc:
                self._done(call)
                if not (self.stop.is_set() and code_of(exc) == "CANCELLED"):
                    self.tally.failed("dupkeys_unclaimed", exc)
                continue
            opened.append(call)
        for call in opened:  # each ends when its ticket expires
            self._outcome("dupkeys_unclaimed", lambda c=call: sum(1 for _ in c), call)

    def remote(self) -> Any:
        """A ``RemoteStore`` of the abuser's tenant (the data path on, no shared memory), made once."""
        if self._remote is None:
            from kvshelf.service.client import RemoteStore

            self._remote = RemoteStore(self.spec["address"], token=self.spec["token"], namespace=self.namespace,
                                       timeout_s=CALL_TIMEOUT_S, shared_memory=False)
        return self._remote

    def dupkeys_round(self) -> None:
        pace = self.spec["pace_s"]
        dup = self._dup_value()
        if dup is None:
            time.sleep(pace)
            return
        key, value = dup
        for attack in (lambda: self._dup_grpc(key, value, 64), lambda: self._dup_datapath(key, value, 16),
                       lambda: self._dup_unclaimed(key, 16)):
            if self.stop.is_set():
                return
            attack()
            time.sleep(pace)

    def _data_port(self) -> int | None:
        """The data port, from the ticket of one OpenDataPath call (cancelled at once)."""
        call = self._open_data_path([self._key("port")])
        try:
            return int(next(call).ticket.port) or None
        except (grpc.RpcError, StopIteration):
            return None
        finally:
            call.cancel()
            self._done(call)

    def silent_data(self, end: float) -> None:
        """Keep ``silent_data`` connections to the data port that send nothing (or a hello's magic alone) until
        ``end``; count each the server ends by the status frame it sent."""
        import select
        import socket

        from kvshelf.service.bulk.framing import HELLO_MAGIC, REFUSED, REPLY_HEAD, STATUS, status_code
        from kvshelf.service.errors import FramingError

        port = None
        while port is None and time.monotonic() < end and not self.stop.is_set():
            port = self._data_port()
            if port is None:
                self.stop.wait(0.5)
        host = self.spec["address"].rsplit(":", 1)[0].strip("[]")
        want = int(self.spec.get("silent_data", SILENT_DATA))
        open_socks: dict[int, socket.socket] = {}
        poller = select.poll()
        serial = 0
        while port is not None and time.monotonic() < end and not self.stop.is_set():
            tick_end = time.monotonic() + SILENT_TICK_S
            for _ in range(min(want - len(open_socks), max(1, want // 4))):  # reopened a quarter per tick at most
                try:
                    sock = socket.create_connection((host, port), timeout=2)
                except OSError:
                    self.tally.record("silent_data", "CONNECT_FAILED")
                    break
                serial += 1
                if serial % 2:
                    with contextlib.suppress(OSError):
                        sock.sendall(HELLO_MAGIC)  # a hello begun, never finished
                open_socks[sock.fileno()] = sock
                poller.register(sock, select.POLLIN)
            for fd, _ in poller.poll(SILENT_TICK_S * 1000):
                sock = open_socks.pop(fd)
                poller.unregister(fd)
                try:
                    head = sock.recv(REPLY_HEAD.size, socket.MSG_WAITALL)
                    kind, code = (head[:1], REPLY_HEAD.unpack(head)[1]) if len(head) == REPLY_HEAD.size else (b"", 0)
                    self.tally.record("silent_data", status_code(code).name if kind in (STATUS, REFUSED)
                                      else "CLOSED")
                except (OSError, ValueError, FramingError):
                    self.tally.record("silent_data", "CLOSED")
                finally:
                    sock.close()
            self.stop.wait(max(0.0, tick_end - time.monotonic()))
        for sock in open_socks.values():
            self.tally.record("silent_data", "HELD")
            sock.close()

    # -- run ------------------------------------------------------------------------------------------

    def run(self, seconds: float) -> dict[str, Any]:
        started, cpu_started = time.monotonic(), time.process_time()
        end = started + seconds

        def loop(round_fn: Callable[[], None]) -> None:
            while time.monotonic() < end and not self.stop.is_set():
                round_fn()

        def holder() -> None:
            while time.monotonic() < end and not self.stop.is_set():
                self.hold_window(min(end, time.monotonic() + self.spec["hold_s"]))
                self.stop.wait(min(self.spec["gap_s"], max(0.0, end - time.monotonic())))

        def burn() -> None:
            share = float(self.spec.get("cpu_share", CPU_SHARE))
            while time.monotonic() < end and not self.stop.is_set():
                spin_until = time.perf_counter() + share * CPU_PERIOD_S
                while time.perf_counter() < spin_until:
                    pass
                self.stop.wait((1.0 - share) * CPU_PERIOD_S)

        groups: dict[str, Callable[[], None]] = {"streams": holder, "bad": lambda: loop(self.bad_input_round),
                                                 "memory": lambda: loop(self.memory_round),
                                                 "quota": lambda: loop(self.quota_round), "cpu": burn,
                                                 "dupkeys": lambda: loop(self.dupkeys_round),
                                                 "silentdata": lambda: self.silent_data(end)}
        threads = [threading.Thread(target=fn, daemon=True) for name, fn in groups.items()
                   if name in self.spec.get("attacks", DEFAULT_ATTACKS)]
        for t in threads:
            t.start()
        threads += start_http_attacks(self, end)
        threads += start_event_attacks(self, end)
        self.stop.wait(max(0.0, end - time.monotonic()))
        self.stop.set()
        with self._calls_lock:
            in_flight = list(self._calls)
        for call in in_flight:  # time is up: nothing waits on a slow server
            call.cancel()
        deadline = time.monotonic() + 5.0
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        report = {**self.tally.report(time.monotonic() - started), "cpu_s": round(time.process_time() - cpu_started, 3)}
        if self._remote is not None:
            self._remote.close()
        self.channel.close()
        return report


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    try:
        abuser = Abuser(spec)
    except grpc.FutureTimeoutError:
        print(f"error: no connection to the server at {spec['address']} within 10 s", file=sys.stderr)
        return 2
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(abuser.run(spec["seconds"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
