"""The vLLM-format KV events attacks of ``kvshelf bench abuse`` (``bench/abuser.py`` runs them in its process), against
the server's ZeroMQ endpoints (``--kv-events-endpoint``, an XPUB; ``--kv-events-replay-endpoint``, a ROUTER), which
have no token: every peer is a stranger. Raw TCP peers speak ZeroMQ's wire (ZMTP 3.0) by hand where libzmq would not
send what they send.

- subscriptions: ``SUB_PEERS`` raw SUB peers flood distinct subscriptions of 4,000 bytes, ``SUB_FLOOD_BYTES`` per
  connection (``events_subscriptions``: ``DROPPED`` when the publisher closed the connection first, ``SENT`` when it
  all went, ``STALLED`` when the publisher stopped reading for ``SEND_TIMEOUT_S``); each round, a subscription of
  ``BIG_SUBSCRIPTION_BYTES`` in one frame (``events_big_subscription``) and a frame announced as 1 GiB to the XPUB and
  to the replay ROUTER (``events_big_frame``): each must be ``DROPPED`` (or ``STALLED``) before ``FRAME_READ_LIMIT``
  bytes went, else ``READ``.
- replay: the abuser's own puts (``replay_fill``: blocks of ``FILL_TOKENS`` tokens, ~24 KiB of events each) fill the
  publisher's replay buffer; ``UNREAD_PEERS`` DEALER peers that never read send ``UNREAD_REQUESTS`` requests each for
  the whole buffer (``replay_unread``: ``NOT_READ``); ``BURST_PEERS`` peers at once (past the publisher's replay
  jobs) each ask for the last ``BURST_BACK`` batches, once the topic's last sequence number is known from its live
  batches or a replay (``replay_burst``: ``END`` with batches, ``END_ALONE`` refused); a request
  without a topic (``replay_no_topic``: ``END`` when one topic was published so far, else ``END_ALONE``) and
  malformed ones (``replay_malformed``: ``END_ALONE`` only); ``FLOOD_PEERS`` peers send ``FLOOD_REQUESTS`` requests
  each at once and read (``replay_flood``: ``END`` once its end marker came). Every reading peer's answer must end
  within ``REPLAY_WAIT_S`` (else ``NO_END``) unless the publisher closed its connection first (``DROPPED``: a socket
  reset or the memory guard; seen by a socket monitor).

After the run, ``listeners_alive`` (in the bench's process) checks what an honest router needs: a subscriber of the
honest tenant's topic gets a live event of its put, and a replay of that topic ends with its end marker.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

#: the events attacks, run only when named (``--attacks subscriptions,replay``)
EVENT_ATTACKS = ("subscriptions", "replay")
#: the bench server's ``--kv-events-buffer-bytes`` (payload bytes kept for replay; as much again may be pinned)
EVENTS_BUFFER = "16MiB"
SUB_PEERS = 4
SUB_FLOOD_BYTES = 4 << 20
SUBSCRIPTION_BYTES = 4000
BIG_SUBSCRIPTION_BYTES = 8 << 20
#: a frame announced as 1 GiB: at most this much may go before the publisher drops the peer
FRAME_READ_LIMIT = 64 << 20
SEND_TIMEOUT_S = 2.0
CONNECT_WAIT_S = 5.0
FILL_TOKENS = 4096
FILL_KEYS = 24
UNREAD_PEERS, UNREAD_REQUESTS = 6, 10
FLOOD_PEERS, FLOOD_REQUESTS = 2, 150
BURST_PEERS = 40
BURST_BACK = 20  # the burst's peers ask for the last this many batches of the abuser's topic
REPLAY_WAIT_S = 10.0
REPLAY_ROUND_S = 1.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: what a replay peer's socket monitor reports when the publisher ends one of its connections (or its handshake)
DROP_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
#: after a dropped connection, how long a peer still waits for an answer (ZeroMQ may reconnect and send the request)
DROP_GRACE_S = 1.0
#: what the server may answer each kind with (merged into ``bench.abuser.EXPECTED``)
EVENTS_EXPECTED: dict[str, frozenset[str]] = {
    "events_subscriptions": frozenset({"DROPPED", "SENT", "STALLED"}),
    "events_big_subscription": frozenset({"DROPPED", "STALLED"}),
    "events_big_frame": frozenset({"DROPPED", "STALLED"}),
    "replay_fill": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "replay_unread": frozenset({"NOT_READ"}),
    # DROPPED: the publisher closed the peer's connection before answering (a socket reset past its bounds, or its
    # memory guard while the subscriptions attack runs): the peer reconnects and asks again, as a router does
    "replay_flood": frozenset({"END", "DROPPED"}),
    "replay_burst": frozenset({"END", "END_ALONE", "DROPPED"}),
    "replay_no_topic": frozenset({"END", "END_ALONE", "DROPPED"}),
    "replay_malformed": frozenset({"END_ALONE", "DROPPED"}),
}


# -- the server's flags and ports ---------------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_args(attacks: Any) -> list[str]:
    """The ``kvshelf serve`` flags the events attacks among ``attacks`` need: the publisher and its replay endpoint
    bound on free ports, a replay buffer of ``EVENTS_BUFFER``."""
    if not set(attacks) & set(EVENT_ATTACKS):
        return []
    return ["--kv-events-endpoint", f"tcp://*:{free_port()}", "--kv-events-replay-endpoint",
            f"tcp://*:{free_port()}", "--kv-events-buffer-bytes", EVENTS_BUFFER]


def events_ports_of(args: list[str]) -> list[int]:
    """``[publisher port, replay port]`` of a ``kvshelf serve`` argument list (empty when it publishes no events)."""
    ports = []
    for flag in ("--kv-events-endpoint", "--kv-events-replay-endpoint"):
        if flag in args:
            ports.append(int(args[args.index(flag) + 1].rsplit(":", 1)[1]))
    return ports if len(ports) == 2 else []


# -- raw ZeroMQ peers ---------------------------------------------------------------------------------------------


def zmtp_frame(body: bytes) -> bytes:
    """One ZMTP 3.0 message frame (short or long size)."""
    if len(body) > 255:
        return b"\x02" + struct.pack(">Q", len(body)) + body
    return bytes([0, len(body)]) + body


def zmtp_peer(host: str, port: int, socket_type: bytes) -> socket.socket:
    """A raw TCP connection greeting as a ZMTP 3.0 peer of ``socket_type`` (NULL mechanism), READY sent."""
    raw = socket.create_connection((host, port), timeout=SEND_TIMEOUT_S)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    raw.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
    return raw


def connect_raw(host: str, port: int, socket_type: bytes, end: float) -> socket.socket | None:
    """A raw peer, retried while the publisher opens its socket again (a reset); None when none connects within
    ``CONNECT_WAIT_S`` (or by ``end``)."""
    deadline = min(end, time.monotonic() + CONNECT_WAIT_S)
    while True:
        try:
            return zmtp_peer(host, port, socket_type)
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)


def send_until_dropped(raw: socket.socket, chunks: Callable[[], bytes], total: int, end: float) -> tuple[str, int]:
    """Send ``chunks()`` until ``total`` bytes went (``SENT``), the publisher dropped the connection (``DROPPED``),
    stopped reading for ``SEND_TIMEOUT_S`` (``STALLED``) or ``end`` came (``SENT``); the code and the bytes sent."""
    sent = 0
    try:
        while sent < total and time.monotonic() < end:
            data = chunks()
            raw.sendall(data)
            sent += len(data)
    except TimeoutError:
        return "STALLED", sent
    except OSError:
        return "DROPPED", sent
    return "SENT", sent


# -- the subscriptions attack -------------------------------------------------------------------------------------


def _flood(abuser: Any, host: str, port: int, base: int, end: float) -> None:
    """Distinct subscriptions over raw connections, ``SUB_FLOOD_BYTES`` per connection, until ``end``."""
    number = base
    while time.monotonic() < end and not abuser.stop.is_set():
        raw = connect_raw(host, port, b"SUB", end)
        if raw is None:
            if time.monotonic() < end:
                abuser.tally.record("events_subscriptions", "CONNECT_FAILED")
            return

        def frames() -> bytes:
            nonlocal number
            number += 16
            return b"".join(zmtp_frame(b"\x01" + (number + k).to_bytes(4, "big") * (SUBSCRIPTION_BYTES // 4))
                            for k in range(16))

        code, _ = send_until_dropped(raw, frames, SUB_FLOOD_BYTES, end)
        raw.close()
        abuser.tally.record("events_subscriptions", code)


def _dropped_after(raw: socket.socket, code: str, timeout_s: float = SEND_TIMEOUT_S) -> str:
    """``code``, or when everything went (``SENT``: it may still wait in the kernel's buffers) ``DROPPED`` if the
    publisher closes the connection within ``timeout_s``, else ``READ`` (it took the frame in)."""
    if code != "SENT":
        return code
    raw.settimeout(timeout_s)
    try:
        while raw.recv(1 << 16):
            pass
    except TimeoutError:
        return "READ"
    except OSError:
        pass
    return "DROPPED"


def _big_frames(abuser: Any, host: str, ports: list[int], end: float) -> None:
    """One subscription of ``BIG_SUBSCRIPTION_BYTES`` to the XPUB and a frame announced as 1 GiB to each port."""
    raw = connect_raw(host, ports[0], b"SUB", end)
    if raw is None:
        return
    big = zmtp_frame(b"\x01" + b"s" * BIG_SUBSCRIPTION_BYTES)
    pieces = iter([big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)])
    code, sent = send_until_dropped(raw, lambda: next(pieces, b""), len(big), end)
    if sent >= len(big) or time.monotonic() < end:  # a send cut short by the end of the run is not counted
        abuser.tally.record("events_big_subscription", _dropped_after(raw, code))
    raw.close()
    for port, kind in zip(ports, (b"SUB", b"DEALER"), strict=True):
        raw = connect_raw(host, port, kind, end)
        if raw is None:
            return
        try:
            raw.sendall(b"\x02" + struct.pack(">Q", 1 << 30))
        except OSError:
            raw.close()
            abuser.tally.record("events_big_frame", "DROPPED")
            continue
        chunk = bytes(1 << 20)
        code, sent = send_until_dropped(raw, lambda chunk=chunk: chunk, FRAME_READ_LIMIT, end)
        if sent >= FRAME_READ_LIMIT or time.monotonic() < end:
            abuser.tally.record("events_big_frame", "READ" if sent >= FRAME_READ_LIMIT else code)
        raw.close()


def subscriptions(abuser: Any, end: float) -> list[threading.Thread]:
    """The subscriptions attack's threads, started, running until ``end``."""
    host, ports = _host(abuser), [int(p) for p in abuser.spec["events_ports"]]

    def frames_loop() -> None:
        while time.monotonic() < end and not abuser.stop.is_set():
            _big_frames(abuser, host, ports, end)
            abuser.stop.wait(0.5)

    threads = [threading.Thread(target=_flood, args=(abuser, host, ports[0], i << 24, end), daemon=True,
                                name=f"abuse-subscriptions-{i}") for i in range(SUB_PEERS)]
    threads.append(threading.Thread(target=frames_loop, name="abuse-big-frames", daemon=True))
    for thread in threads:
        thread.start()
    return threads


# -- the replay attack --------------------------------------------------------------------------------------------


def _host(abuser: Any) -> str:
    return str(abuser.spec["address"]).rsplit(":", 1)[0].strip("[]")


def _dealer(ctx: zmq.Context, host: str, port: int, *, reads: bool = True) -> zmq.Socket:
    """A DEALER replay peer; when it ``reads``, watched for the publisher dropping its connection (a socket monitor:
    ``read_to_end`` tells a dropped request from one never answered)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if not reads:  # a peer that never reads: the least it can take in
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.RCVBUF, 4096)
    else:
        dealer.get_monitor_socket(DROP_EVENTS)
    dealer.connect(f"tcp://{host}:{port}")
    return dealer


def _close(dealer: zmq.Socket) -> None:
    """Close ``dealer`` and its monitor, if any."""
    monitor = getattr(dealer, "_monitor_socket", None)
    if monitor is not None:
        with contextlib.suppress(zmq.ZMQError):
            dealer.disable_monitor()
        monitor.close(linger=0)
    dealer.close(linger=0)


def read_to_end(dealer: zmq.Socket, deadline: float) -> str:
    """Read a replay's answer: ``END`` (batches then the end marker), ``END_ALONE`` (the end marker alone),
    ``DROPPED`` (the publisher ended a connection of the peer and no answer came within ``DROP_GRACE_S``: a socket
    reset or its memory guard; ZeroMQ reconnects, the request is gone) or ``NO_END`` (none by ``deadline`` on a
    connection kept open)."""
    return read_answer(dealer, deadline)[0]


def read_answer(dealer: zmq.Socket, deadline: float) -> tuple[str, int, int]:
    """``read_to_end``'s code, the batches read before it and the last one's sequence number (-1: none)."""
    monitor = getattr(dealer, "_monitor_socket", None)
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    if monitor is not None:
        poller.register(monitor, zmq.POLLIN)
    batches, last, dropped = 0, -1, False
    while True:
        left = deadline - time.monotonic()
        ready = dict(poller.poll(int(left * 1000))) if left > 0 else {}
        if dealer in ready:
            frames = dealer.recv_multipart()
            if len(frames) >= 2 and frames[1] == END_SEQ:
                return ("END" if batches else "END_ALONE"), batches, last
            batches += 1
            if len(frames) >= 2 and len(frames[1]) == 8:
                last = max(last, int.from_bytes(frames[1], "big"))
        elif monitor is not None and monitor in ready:
            monitor.recv_multipart()
            if not dropped:
                dropped, deadline = True, min(deadline, time.monotonic() + DROP_GRACE_S)
        else:
            return ("DROPPED" if dropped else "NO_END"), batches, last


class Replay:
    """The replay attack's state: the live sequence of the abuser's topic (read by a subscriber), the peers that
    never read (kept open until the end)."""

    def __init__(self, abuser: Any, end: float) -> None:
        self.abuser, self.end = abuser, end
        self.host = _host(abuser)
        self.pub_port, self.port = (int(p) for p in abuser.spec["events_ports"])
        self.topic = (str(abuser.spec.get("events_topic", "")) + abuser.namespace).encode()
        self.ctx = zmq.Context()
        self.last_seq = -1
        self.unread: list[zmq.Socket] = []

    def fill(self) -> None:
        """Put blocks of ``FILL_TOKENS`` tokens into the abuser's namespace (overwriting ``FILL_KEYS`` keys): their
        events fill the replay buffer."""
        from kvshelf.bench.abuse_blocks import block_key, ones_block, put_messages
        from kvshelf.kvstore import KVBlock, encode_block

        template = ones_block((1, 1, FILL_TOKENS, 8), self.abuser.namespace)
        block = KVBlock(template.keys, template.values, tuple(range(60_000, 60_000 + FILL_TOKENS)), 0,
                        template.fingerprint, self.abuser.namespace)
        serial = 0
        while time.monotonic() < self.end and not self.abuser.stop.is_set():
            key = block_key(f"abuser:replay-fill:{serial % FILL_KEYS}")
            serial += 1
            self.abuser.call_put("replay_fill", put_messages([(key, encode_block(block, key))], self.abuser.namespace))
            self.abuser.stop.wait(0.05)

    def follow(self) -> None:
        """Track the abuser's topic's last sequence number (a subscriber of it; ZeroMQ reconnects it after a
        reset)."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(f"tcp://{self.host}:{self.pub_port}")
        try:
            while time.monotonic() < self.end and not self.abuser.stop.is_set():
                if sub.poll(100):
                    frames = sub.recv_multipart()
                    if len(frames) == 3 and frames[0] == self.topic:
                        self.last_seq = max(self.last_seq, int.from_bytes(frames[1], "big"))
        finally:
            sub.close(linger=0)

    def round(self) -> None:
        """One round: the unread peers' requests, the burst, the odd requests, the flood."""
        started = time.monotonic()
        request = [b"", (0).to_bytes(8, "big"), self.topic]
        if not self.unread:
            self.unread = [_dealer(self.ctx, self.host, self.port, reads=False) for _ in range(UNREAD_PEERS)]
        for dealer in self.unread:
            for _ in range(UNREAD_REQUESTS):
                with contextlib.suppress(zmq.Again):
                    dealer.send_multipart(request, flags=zmq.NOBLOCK)
                    self.abuser.tally.record("replay_unread", "NOT_READ")
        start = max(0, self.last_seq - BURST_BACK).to_bytes(8, "big")
        if self.last_seq >= 0:  # known (from the live topic or a flood's replay): the burst asks for recent batches
            burst = [_dealer(self.ctx, self.host, self.port) for _ in range(BURST_PEERS)]
            time.sleep(0.05)  # connected, so that the requests arrive together
            for dealer in burst:
                dealer.send_multipart([b"", start, self.topic])
            self._answers("replay_burst", burst, min(self.end, time.monotonic() + REPLAY_WAIT_S))
        odd = {"replay_no_topic": [[b"", start]],
               "replay_malformed": [[b"", b"xx"], [b"", start, self.topic, b"a", b"b", b"c"], [b"\x00" * 9],
                                    [b"", start, b"t" * 4000]]}
        for kind, requests in odd.items():
            for frames in requests:
                dealer = _dealer(self.ctx, self.host, self.port)
                dealer.send_multipart(frames)
                self._answers(kind, [dealer], min(self.end, time.monotonic() + REPLAY_WAIT_S), ours=False)
        flooders = [_dealer(self.ctx, self.host, self.port) for _ in range(FLOOD_PEERS)]
        for _ in range(FLOOD_REQUESTS):
            for dealer in flooders:
                dealer.send_multipart(request)
        self._answers("replay_flood", flooders, min(self.end, time.monotonic() + REPLAY_WAIT_S), until_last=True)
        self.abuser.stop.wait(max(0.0, started + REPLAY_ROUND_S - time.monotonic()))

    def _answers(self, kind: str, dealers: list[zmq.Socket], deadline: float, *, until_last: bool = False,
                 ours: bool = True) -> None:
        """Count each dealer's answer (``until_last``: the peer sent many requests; one end marker is its answer:
        the publisher runs one job per peer, a new request replacing the last) and close it; answers cut short by
        the end of the run are not counted."""
        for dealer in dealers:
            code, _, last = read_answer(dealer, deadline)
            if ours:  # a replay of the abuser's topic: its sequence numbers
                self.last_seq = max(self.last_seq, last)
            if until_last and code == "END_ALONE":
                code = "END"
            if code != "NO_END" or time.monotonic() < self.end:
                self.abuser.tally.record(kind, code)
            _close(dealer)

    def run(self) -> None:
        try:
            while time.monotonic() < self.end and not self.abuser.stop.is_set():
                self.round()
        finally:
            for dealer in self.unread:
                _close(dealer)
            self.ctx.destroy(linger=0)


def replay(abuser: Any, end: float) -> list[threading.Thread]:
    """The replay attack's threads (fill, follow, requests), started, running until ``end``."""
    state = Replay(abuser, end)
    threads = [threading.Thread(target=fn, name=f"abuse-replay-{name}", daemon=True)
               for name, fn in (("fill", state.fill), ("follow", state.follow), ("requests", state.run))]
    for thread in threads:
        thread.start()
    return threads


def start_event_attacks(abuser: Any, end: float) -> list[threading.Thread]:
    """The named events attacks of ``abuser``'s spec (its ``events_ports``: the publisher's and the replay port)
    on started daemon threads running until ``end``; a tally entry ``events_ports: NONE`` when the server has none."""
    attacks = set(abuser.spec.get("attacks", ())) & set(EVENT_ATTACKS)
    if not attacks:
        return []
    if len(abuser.spec.get("events_ports") or ()) != 2:
        abuser.tally.record("events_ports", "NONE")
        return []
    starts = {"subscriptions": subscriptions, "replay": replay}
    return [thread for name in sorted(attacks) for thread in starts[name](abuser, end)]


# -- the honest router after the attack (in the bench's process) --------------------------------------------------


def listeners_alive(put_one: Callable[[], object], ports: list[int], namespace: str, topic: str = "",
                    timeout_s: float = 10.0) -> dict[str, Any]:
    """What an honest router of ``namespace`` gets now: seconds until a subscriber of its topic receives the event of
    a put (``put_one``, repeated every 0.2 s while it connects; None: none within ``timeout_s``), and the answer of a
    replay of that topic from its start (``read_to_end``'s code) and the batches it brought."""
    host = "127.0.0.1"
    name = (topic + namespace).encode()
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, name)
        sub.connect(f"tcp://{host}:{ports[0]}")
        started = time.monotonic()
        live_s = None
        while time.monotonic() - started < timeout_s:
            put_one()
            if sub.poll(200):
                live_s = round(time.monotonic() - started, 3)
                break
        dealer = _dealer(ctx, host, ports[1])
        dealer.send_multipart([b"", (0).to_bytes(8, "big"), name])
        answer, batches, _ = read_answer(dealer, time.monotonic() + timeout_s)
        return {"live_event_s": live_s, "replay": answer, "replay_batches": batches}
    finally:
        ctx.destroy(linger=0)
