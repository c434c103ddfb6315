"""The vLLM-format KV event publisher (kvstore/vllm_events.py, its process kvstore/vllm_events_worker.py) attacked from
outside: raw TCP speaking ZeroMQ's wire by hand, raw SUB / DEALER / REQ peers that send and never read. What a peer
can make the publisher process hold is measured as that process's resident memory (/proc/PID/status VmRSS); live
events must keep arriving (bounded waits for liveness, no speed asserts)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import vllm_schema
import zmq
from fuzz_driver import mutate
from fuzz_replay import SEEDS, check_request, encode_frames
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import free_port
from vllm_schema import DECODER, END_SEQ, receive, subscriber

from kvshelf.kvstore.vllm_events import KVEventsSettings, VLLMEventPublisher
from kvshelf.kvstore.vllm_events_replay import REPLAY_STALL_S, parse_replay_request
from kvshelf.kvstore.vllm_events_worker import GUARD_MARGIN_BYTES, GUARD_SETTLE_S

ctx = vllm_schema.ctx
MiB = 1 << 20


# -- measuring and raw peers ---------------------------------------------------------------------------------------


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class PeakRSS:
    """Samples a process's resident memory every 20 ms in a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))
        return self.peak


def zmtp_frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    """One ZMTP 3.0 frame: flags (MORE 1, LONG 2, COMMAND 4), size (1 or 8 bytes), body."""
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_peer(port: int, socket_type: bytes, host: str = "127.0.0.1") -> socket.socket:
    """A raw TCP connection that greets as a ZMTP 3.0 peer of ``socket_type`` (NULL mechanism) and sends READY."""
    raw = socket.create_connection((host, port), timeout=5)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    raw.sendall(greeting + zmtp_frame(ready, command=True))
    return raw


def send_until_dropped(raw: socket.socket, data: bytes, total: int) -> int:
    """Send ``data`` repeatedly until ``total`` bytes went or the peer dropped the connection; the bytes sent."""
    sent = 0
    try:
        while sent < total:
            raw.sendall(data)
            sent += len(data)
    except OSError:  # reset, broken pipe or a send that no longer moves (the peer stopped reading)
        pass
    return sent


def settings_for(ports: tuple[int, int], **kw: Any) -> KVEventsSettings:
    return KVEventsSettings(endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}", **kw)


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@contextmanager
def publishing(ctx: zmq.Context, ports: tuple[int, int], **kw: Any) -> Iterator[VLLMEventPublisher]:
    with VLLMEventPublisher(settings_for(ports, **kw), context=ctx) as pub:
        yield pub


def replay_all(ctx: zmq.Context, port: int, start: int, *topic: bytes, timeout_s: float = 10.0) -> list[int]:
    """The sequence numbers a DEALER replay client reads up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big"), *topic])
        seqs = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), f"no end marker after {len(seqs)} batches"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return seqs
            seqs.append(int.from_bytes(seq, "big"))
            assert DECODER.decode(payload).events
    finally:
        dealer.close(linger=0)


def big_batches(pub: VLLMEventPublisher, count: int, tokens: int, namespace: str = "default") -> None:
    """``count`` batches of one ``BlockStored`` of ``tokens`` tokens each (3 bytes a token: ~``3 * tokens`` bytes)."""
    ids = (65535,) * tokens
    for i in range(count):
        pub.stored(namespace, i.to_bytes(16, "big"), b"", ids, "CPU")
        assert pub.flush(30)


def live_event_arrives(ctx: zmq.Context, pub: VLLMEventPublisher, port: int, timeout_s: float = 10.0) -> float:
    """Seconds until a fresh subscriber gets a live event (published again every 0.1 s while it reconnects)."""
    sub = subscriber(ctx, port)
    try:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            pub.cleared("probe")
            if sub.poll(100):
                return time.monotonic() - start
        raise AssertionError(f"no live event within {timeout_s} s")
    finally:
        sub.close(linger=0)


# -- frames and subscriptions (findings: a 1 GiB frame, subscriptions amplify memory ~48x) --------------------------


def test_a_frame_announced_as_1_gib_drops_the_peer_before_it_is_read(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with publishing(ctx, ports) as pub:
        before = rss(pub.pid)
        for port in ports:  # the XPUB (a SUB peer) and the replay ROUTER (a DEALER peer)
            raw = zmtp_peer(port, b"SUB" if port == ports[0] else b"DEALER")
            raw.sendall(b"\x02" + struct.pack(">Q", 1 << 30))  # a LONG frame of 1 GiB, its first 256 MiB follow
            sent = send_until_dropped(raw, bytes(MiB), 256 * MiB)
            raw.close()
            assert sent < 64 * MiB, f"the publisher read {sent / MiB:.0f} MiB of a frame announced as 1 GiB"
        assert rss(pub.pid) - before < 32 * MiB
        assert live_event_arrives(ctx, pub, ports[0]) < 10


def test_subscriptions_are_bounded_in_count_and_bytes(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    """2 x 8 MiB subscriptions (the finding's), then 16 MiB of distinct 4 KiB ones: the publisher keeps at most
    ``MAX_SUBSCRIPTION_BYTES`` of them (then resets its XPUB), or its memory guard drops the peer (libzmq takes in
    subscriptions before the publisher sees them); an honest subscriber gets live events after."""
    with publishing(ctx, ports, buffer_bytes=MiB) as pub:
        honest = subscriber(ctx, ports[0], b"default")
        time.sleep(0.2)
        before = rss(pub.pid)
        peak = PeakRSS(pub.pid)
        for i in range(2):  # each on a connection of its own: the first frame past ZMQ_MAXMSGSIZE drops it
            raw = zmtp_peer(ports[0], b"SUB")
            sent = send_until_dropped(raw, zmtp_frame(b"\x01" + bytes([i]) * (8 * MiB)), 8 * MiB)
            raw.close()
            assert sent < 8 * MiB, "the publisher read a subscription of 8 MiB"
        flood_subscriptions(ports[0], 16 * MiB, 0, per_send=64, repeat=1024)
        growth = peak.stop() - before
        # the guard's ceiling (1 MiB buffered, the margin) and at most 128 MiB past it while the guard reacts
        assert growth < MiB + GUARD_MARGIN_BYTES + 128 * MiB, f"16 MiB of subscriptions: +{growth / MiB:.0f} MiB"
        assert pub.stats()["socket_resets"] + pub.stats()["guard_drops"] >= 1
        deadline = time.monotonic() + 10  # the honest subscriber reconnected on its own
        while not honest.poll(100):
            assert time.monotonic() < deadline, "the honest subscriber got no live event after the flood"
            pub.cleared("default")
        honest.close(linger=0)


def flood_subscriptions(port: int, total: int, base: int, per_send: int = 16, repeat: int = 1000) -> None:
    """``total`` bytes of distinct subscriptions (4 x ``repeat`` bytes each, ``per_send`` a send) over raw
    connections, a new one whenever the publisher drops the last."""
    raw, sent, number = None, 0, base
    while sent < total:
        if raw is None:
            try:
                raw = zmtp_peer(port, b"SUB")
            except OSError:  # the XPUB is being opened again
                time.sleep(0.01)
                continue
        frames = b"".join(zmtp_frame(b"\x01" + (number + k).to_bytes(4, "big") * repeat) for k in range(per_send))
        number += per_send
        try:
            raw.sendall(frames)
            sent += len(frames)
        except OSError:
            raw.close()
            raw = None
    if raw is not None:
        raw.close()


def test_subscriptions_from_many_peers_at_once_are_bounded_by_the_guard(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    """8 peers flooding distinct subscriptions at once keep libzmq adding them within one call of the publisher's
    loop: its memory guard drops the connections with bytes waiting, and the honest subscriber stays."""
    with publishing(ctx, ports, buffer_bytes=MiB) as pub:
        honest = subscriber(ctx, ports[0], b"default")
        time.sleep(0.2)
        before = rss(pub.pid)
        peak = PeakRSS(pub.pid)
        floods = [threading.Thread(target=flood_subscriptions, args=(ports[0], 4 * MiB, i << 24)) for i in range(8)]
        for flood in floods:
            flood.start()
        for flood in floods:
            flood.join()
        growth = peak.stop() - before
        time.sleep(GUARD_SETTLE_S + 0.5)
        kept = rss(pub.pid) - before
        assert growth < MiB + GUARD_MARGIN_BYTES + 128 * MiB, f"32 MiB from 8 peers: +{growth / MiB:.0f} MiB"
        assert kept < GUARD_MARGIN_BYTES + 32 * MiB, f"the publisher kept {kept / MiB:.0f} MiB after the flood"
        assert pub._proc.poll() is None
        deadline = time.monotonic() + 10
        while not honest.poll(100):
            assert time.monotonic() < deadline, "the honest subscriber got no live event after the flood"
            pub.cleared("default")
        honest.close(linger=0)


def test_silent_connections_are_closed_after_the_handshake_interval(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with publishing(ctx, ports, handshake_s=0.5) as pub:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for port in ports for _ in range(40)]
        time.sleep(0.5)
        deadline = time.monotonic() + 5
        for raw in silent:  # each gets the publisher's greeting, then its end when the handshake times out
            raw.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while raw.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                raise AssertionError("a silent connection was still open 5 s past the handshake interval") from None
            raw.close()
        assert live_event_arrives(ctx, pub, ports[0]) < 10


# -- replay (findings: a request never read copies the buffer; replays stall live events) ---------------------------


def test_replay_requests_that_are_never_read_hold_a_few_messages_each(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    """120 batches of ~0.5 MiB buffered; 6 peers x 10 requests that never read: the publisher's memory does not
    grow by what it replays (the finding's: 133 MiB a request)."""
    with publishing(ctx, ports, buffer_bytes=128 * MiB) as pub:
        big_batches(pub, 120, 170_000)
        before = rss(pub.pid)
        peak = PeakRSS(pub.pid)
        peers = []
        for _ in range(6):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 4096)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
            peers.append(dealer)
        for dealer in peers:
            for _ in range(10):
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(2)
        growth = peak.stop() - before
        assert growth < 32 * MiB, f"replays nobody reads grew the publisher by {growth / MiB:.0f} MiB"
        assert pub.stats()["replays"] >= 6
        assert len(replay_all(ctx, ports[1], 0)) == 120  # an honest client still gets everything
        for dealer in peers:
            dealer.close(linger=0)


def test_a_peer_that_never_reads_cannot_hold_a_replay_job_by_asking_again(
        ctx: zmq.Context, ports: tuple[int, int]) -> None:
    """A peer whose replay was given up for not reading (``REPLAY_STALL_S``) and that keeps asking gets end markers
    only: asking again neither restarts its stalled job's clock nor starts another (16 such peers held every job)."""
    with publishing(ctx, ports, buffer_bytes=128 * MiB) as pub:
        big_batches(pub, 120, 170_000)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
        end = time.monotonic() + REPLAY_STALL_S + 4
        while time.monotonic() < end:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            time.sleep(0.5)
        assert pub.stats()["replays_refused"] >= 1  # one peer, so not the job limit: refused as stalled
        assert len(replay_all(ctx, ports[1], 0)) == 120  # another peer is served
        dealer.close(linger=0)


def test_a_live_event_arrives_while_replay_requests_flood(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with publishing(ctx, ports) as pub:
        for i in range(2000):
            pub.removed("default", i.to_bytes(16, "big"), "CPU")
            assert pub.flush()
        sub = subscriber(ctx, ports[0], b"live")
        time.sleep(0.3)
        flooders = []
        for _ in range(4):  # 600 requests of the whole buffer; half the peers read, half never do
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
            flooders.append(dealer)
        for _ in range(150):
            for dealer in flooders:
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        stop = threading.Event()

        def drain(dealer: zmq.Socket) -> None:
            while not stop.is_set():
                if dealer.poll(50):
                    dealer.recv_multipart()

        readers = [threading.Thread(target=drain, args=(d,), daemon=True) for d in flooders[:2]]
        for reader in readers:
            reader.start()
        time.sleep(0.2)  # the flood is under way
        start = time.monotonic()
        pub.cleared("live")
        assert sub.poll(2000), "a live event waited more than 2 s behind replay requests"
        waited = time.monotonic() - start
        stop.set()
        for reader in readers:
            reader.join()
        for dealer in flooders:
            dealer.close(linger=0)
        sub.close(linger=0)
        assert waited < 2


def test_a_replay_request_burst_past_the_job_limit_gets_end_markers(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    """More peers than replay jobs at once: each still gets an answer that ends (batches or the end marker alone)."""
    with publishing(ctx, ports) as pub:
        big_batches(pub, 20, 1000)
        clients = []
        for _ in range(40):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
            clients.append(dealer)
        time.sleep(0.3)
        for dealer in clients:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        for dealer in clients:
            count = 0
            while True:
                assert dealer.poll(10_000), "a replay request got no end marker"
                _, seq, _ = dealer.recv_multipart()
                if seq == END_SEQ:
                    break
                count += 1
            got.append(count)
            dealer.close(linger=0)
        assert set(got) <= {0, 20} and 20 in got
        stats = pub.stats()
        assert stats["replays"] + stats["replays_refused"] == 40 and stats["replays"] == got.count(20)


# -- sequences per namespace (finding: one counter for every namespace) ----------------------------------------------


def test_each_topic_has_its_own_sequence_and_replay(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with publishing(ctx, ports, topic="kv.") as pub:
        sub_a = subscriber(ctx, ports[0], b"kv.tenant-a")
        time.sleep(0.2)
        for i in range(30):  # interleaved: one batch of each tenant per flush
            pub.removed("tenant-a", i.to_bytes(16, "big"), "CPU")
            pub.removed("tenant-b", i.to_bytes(16, "big"), "DISK")
            assert pub.flush()
        got = receive(sub_a, 30)
        assert [seq for _, seq, _ in got] == list(range(30))  # no gap
        assert {topic for topic, _, _ in got} == {b"kv.tenant-a"}
        assert {e.medium for _, _, batch in got for e in batch.events} == {"CPU"}
        assert replay_all(ctx, ports[1], 10, b"kv.tenant-a") == list(range(10, 30))
        assert replay_all(ctx, ports[1], 25, b"kv.tenant-b") == list(range(25, 30))
        assert replay_all(ctx, ports[1], 0, b"kv.tenant-c") == []
        bad = pub.stats()["bad_replay_requests"]
        assert replay_all(ctx, ports[1], 0) == []  # two topics and none named: ambiguous, the end marker alone
        assert pub.stats()["bad_replay_requests"] == bad + 1
        sub_a.close(linger=0)


def test_a_request_without_topic_replays_the_only_namespace(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with publishing(ctx, ports, namespaces=frozenset({"tenant-a"})) as pub:
        for i in range(5):
            pub.removed("tenant-b", i.to_bytes(16, "big"), "CPU")
            pub.removed("tenant-a", i.to_bytes(16, "big"), "CPU")
            assert pub.flush()
        assert replay_all(ctx, ports[1], 0) == list(range(5))  # vLLM's request (no topic): tenant-a's batches


# -- the buffer in bytes; a subscriber that never reads (finding: bounded in batches, not bytes) --------------------


def test_the_replay_buffer_is_bounded_in_bytes(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    with publishing(ctx, ports, buffer_bytes=2 * MiB) as pub:
        big_batches(pub, 40, 100_000)  # ~300 KiB each, 12 MiB in all
        kept = replay_all(ctx, ports[1], 0)
        assert kept == list(range(40 - len(kept), 40)) and 4 <= len(kept) <= 7
        assert pub.stats()["buffer_bytes"] <= 2 * MiB


def test_a_subscriber_that_never_reads_cannot_grow_the_publisher(ctx: zmq.Context, ports: tuple[int, int]) -> None:
    """300 batches of ~1 MiB (the finding's 300 overwrites) with a subscriber that never reads: the publisher holds
    at most its buffer and as much again of payloads queued for that subscriber."""
    limit = 16 * MiB
    with publishing(ctx, ports, buffer_bytes=limit) as pub:
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.connect(f"tcp://127.0.0.1:{ports[0]}")
        time.sleep(0.3)
        before = rss(pub.pid)
        peak = PeakRSS(pub.pid)
        big_batches(pub, 300, 350_000)
        time.sleep(1.5)
        growth = peak.stop() - before
        assert growth < 2 * limit + 64 * MiB, f"the publisher grew by {growth / MiB:.0f} MiB"
        stats = pub.stats()
        assert stats["buffer_bytes"] <= limit and stats["pinned_bytes"] <= 2 * limit
        stuck.close(linger=0)
        assert live_event_arrives(ctx, pub, ports[0]) < 10


# -- IPv6 endpoints (finding: documented as binding, they fail with "No such device") -------------------------------


@pytest.mark.skipif(not socket.has_ipv6 or not Path("/proc/net/if_inet6").exists(), reason="no IPv6")
@pytest.mark.parametrize("host", ["[::1]", "[::]"])
def test_ipv6_endpoints_bind(ctx: zmq.Context, host: str) -> None:
    port, replay_port = free_port(), free_port()
    settings = KVEventsSettings(endpoint=f"tcp://{host}:{port}", replay_endpoint=f"tcp://{host}:{replay_port}")
    with VLLMEventPublisher(settings, context=ctx) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://[::1]:{port}")
        time.sleep(0.3)
        pub.cleared("default")
        assert pub.flush()
        (topic, seq, _), = receive(sub, 1)
        assert (topic, seq) == (b"default", 0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://[::1]:{replay_port}")
        dealer.send_multipart([b"", bytes(8)])
        assert dealer.poll(5000)
        assert dealer.recv_multipart()[1] == bytes(8)
        sub.close(linger=0)
        dealer.close(linger=0)


# -- the replay request parser, fuzzed (pure, then on the wire) -----------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
frames_strategy = st.lists(st.one_of(st.binary(max_size=24), st.binary(min_size=8, max_size=8),
                                     st.sampled_from([b"", b"default", bytes(8), END_SEQ])), max_size=5)


@FUZZ
@given(frames_strategy)
def test_parse_replay_request_reads_or_refuses_any_frames(frames: list[bytes]) -> None:
    check_request(encode_frames(frames))


@FUZZ
@given(st.sampled_from(SEEDS), st.randoms(use_true_random=False))
def test_parse_replay_request_reads_or_refuses_mutated_requests(seed: bytes, rng: Any) -> None:
    check_request(mutate(seed, rng))


@pytest.fixture(scope="module")
def fuzzed_publisher() -> Iterator[tuple[VLLMEventPublisher, int, zmq.Socket]]:
    context = zmq.Context()
    ports = (free_port(), free_port())
    pub = VLLMEventPublisher(settings_for(ports), context=context)
    for i in range(3):
        pub.removed("default", i.to_bytes(16, "big"), "CPU")
        assert pub.flush()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
    yield pub, ports[1], dealer
    dealer.close(linger=0)
    pub.close()
    context.destroy(linger=0)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=24), st.binary(min_size=8, max_size=8),
                          st.sampled_from([b"", b"default", b"other", bytes(8), END_SEQ])), min_size=1, max_size=6))
def test_random_replay_requests_get_an_answer_that_ends_and_the_publisher_lives(
        fuzzed_publisher: tuple[VLLMEventPublisher, int, zmq.Socket], frames: list[bytes]) -> None:
    pub, _, dealer = fuzzed_publisher
    dealer.send_multipart(frames)
    replies = []
    while True:
        assert dealer.poll(5000), f"no end marker for {frames!r}"
        reply = dealer.recv_multipart()
        assert len(reply) == 3 and reply[0] == b""
        if reply[1] == END_SEQ:
            assert reply[2] == b""
            break
        replies.append(int.from_bytes(reply[1], "big"))
    parsed = parse_replay_request(frames)
    expected = [] if parsed is None or parsed[1] not in (None, b"default") else list(range(min(parsed[0], 3), 3))
    assert replies == expected
    assert pub._proc.poll() is None

