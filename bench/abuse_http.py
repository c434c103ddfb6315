"""The HTTP attacks of ``kvshelf bench abuse`` (``bench/abuser.py`` runs them in its process): against the server's
``/metrics`` and admin dashboard ports, and against its metric labels.

- slowhttp: keeps ``SLOW_HTTP`` connections open to the two HTTP ports (half each) that send nothing, or a
  request head one byte per second (slowloris), reopening those the server closes; each is counted by what the
  server did (``slow_http``: ``CLOSED`` at the read deadline, ``HTTP_408``/``HTTP_431``/``HTTP_503``, or ``HELD``
  when still open at the end). Meanwhile a scrape of ``/metrics`` and a ``GET /api/data`` every half second must
  answer 200 within ``SCRAPE_TIMEOUT_S`` (``slow_http_scrape``: ``OK``, else ``TIMEOUT`` or ``HTTP_<status>``),
  and the server's threads and fds (``/proc``) must stay within ``MAX_EXTRA_THREADS`` and ``MAX_EXTRA_FDS`` of
  what it had before (``slow_http_server``: ``OK`` per sample, else ``THREADS_UNBOUNDED``/``FDS_UNBOUNDED``).
- labels: ``LookupPrefix`` calls naming ``LABELS_PER_ROUND`` made-up models each round, one per ``pace_s``
  (``labels``: ``OK``), one naming a model of 2 MiB (``labels_long``: must be ``INVALID_ARGUMENT``), then a scrape
  of ``/metrics`` whose model labels of the abuser's namespace must stay within the server's bound
  (``labels_scrape``: ``OK``, else ``UNBOUNDED``).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import threading
import time
from typing import Any

import grpc

from kvshelf.kvstore.stats import MAX_LABEL_CHARS, MAX_MODELS_PER_NAMESPACE
from kvshelf.proto import kvshelf_pb2 as pb

#: silent or slow connections the slowhttp attack keeps open (800: the issue's figure), half per port
SLOW_HTTP = 800
#: the slowhttp attack's pace: every tick it reopens at most this many connections
SLOW_HTTP_REOPEN = 200
SLOW_HTTP_TICK_S = 0.25
SCRAPE_TIMEOUT_S = 5.0
#: the server may start a few threads and hold a few fds more than before the attack: its HTTP servers' threads
#: were started with it, but its gRPC pool starts its workers (32 by default) as calls come; an fd per connection
#: being read, up to the HTTP servers' cap of 128 each
MAX_EXTRA_THREADS = 32 + 16
MAX_EXTRA_FDS = 2 * 128 + 64
#: made-up model names per round of the labels attack, one call per ``pace_s`` (as the other attacks pace theirs:
#: cardinality, not a flood of calls, is its point)
LABELS_PER_ROUND = 50
LONG_MODEL_CHARS = 2 << 20
#: what the server may answer each kind with (merged into ``bench.abuser.EXPECTED``)
HTTP_EXPECTED: dict[str, frozenset[str]] = {
    "slow_http": frozenset({"CLOSED", "HTTP_408", "HTTP_431", "HTTP_503", "HELD"}),
    "slow_http_scrape": frozenset({"OK"}),
    "slow_http_server": frozenset({"OK"}),
    "labels": frozenset({"OK", "RESOURCE_EXHAUSTED"}),
    "labels_long": frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "labels_scrape": frozenset({"OK"}),
}
_MODEL_LABEL = re.compile(r'model="((?:[^"\\]|\\.)*)",namespace="((?:[^"\\]|\\.)*)"')


def http_get(host: str, port: int, path: str, timeout: float = SCRAPE_TIMEOUT_S) -> tuple[str, bytes]:
    """``("OK", body)`` for a 200 answer within ``timeout``; else ``("HTTP_<status>" or "TIMEOUT" or "CLOSED",
    b"")``."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            chunks = []
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
    except TimeoutError:
        return "TIMEOUT", b""
    except OSError:
        return "CLOSED", b""
    answer = b"".join(chunks)
    if not answer.startswith(b"HTTP/1."):
        return "CLOSED", b""
    status = answer[9:12].decode("ascii", "replace")
    return ("OK" if status == "200" else f"HTTP_{status}"), answer.split(b"\r\n\r\n", 1)[-1]


def server_threads_and_fds(pid: int) -> tuple[int, int] | None:
    """The server's thread and fd counts now (``None`` when it is gone or not readable)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _ended(sock: socket.socket) -> str:
    """What the server did to a connection it made readable: its status (``HTTP_408``...) or ``CLOSED``."""
    try:
        head = sock.recv(64)
    except OSError:
        return "CLOSED"
    match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    return f"HTTP_{match.group(1).decode()}" if match else "CLOSED"


def slow_http(abuser: Any, end: float) -> None:
    """The slowhttp attack until ``end`` (``abuser``: a ``bench.abuser.Abuser``; its spec names ``http_ports``,
    the metrics and dashboard ports, and ``server_pid``)."""
    ports = [int(p) for p in abuser.spec.get("http_ports", ())]
    if not ports:
        abuser.tally.record("slow_http", "NO_HTTP_PORT")
        return
    host = abuser.spec["address"].rsplit(":", 1)[0].strip("[]")
    want = int(abuser.spec.get("slow_http", SLOW_HTTP))
    pid = abuser.spec.get("server_pid")
    before = server_threads_and_fds(int(pid)) if pid else None
    socks: dict[int, tuple[socket.socket, bool]] = {}  # fd -> (socket, sends a head a byte at a time)
    poller = select.poll()
    serial, next_check = 0, 0.0
    trickle = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096
    sent: dict[int, int] = {}
    while time.monotonic() < end and not abuser.stop.is_set():
        tick_end = time.monotonic() + SLOW_HTTP_TICK_S
        for _ in range(min(want - len(socks), SLOW_HTTP_REOPEN)):
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            sock.setblocking(False)
            serial += 1
            if sock.connect_ex((host, ports[serial % len(ports)])) not in (0, 115):  # 115: EINPROGRESS
                sock.close()
                abuser.tally.record("slow_http", "CONNECT_FAILED")
                break
            socks[sock.fileno()] = (sock, serial % 4 == 0)
            sent[sock.fileno()] = 0
            poller.register(sock, select.POLLIN)
        for fd, (sock, slow) in list(socks.items()):
            if slow and sent[fd] < len(trickle):
                with contextlib.suppress(OSError):
                    sent[fd] += sock.send(trickle[sent[fd] : sent[fd] + 1])
        for fd, _ in poller.poll(0):
            sock, _ = socks.pop(fd)
            sent.pop(fd, None)
            poller.unregister(fd)
            sock.setblocking(True)
            sock.settimeout(1.0)
            abuser.tally.record("slow_http", _ended(sock))
            sock.close()
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + 0.5
            for port, path in zip(ports, ("/metrics", "/api/data"), strict=False):
                abuser.tally.record("slow_http_scrape", http_get(host, port, path)[0])
            now = server_threads_and_fds(int(pid)) if pid else None
            if before is not None and now is not None:
                code = ("THREADS_UNBOUNDED" if now[0] > before[0] + MAX_EXTRA_THREADS else
                        "FDS_UNBOUNDED" if now[1] > before[1] + MAX_EXTRA_FDS else "OK")
                abuser.tally.record("slow_http_server", code)
        abuser.stop.wait(max(0.0, tick_end - time.monotonic()))
    for sock, _ in socks.values():
        abuser.tally.record("slow_http", "HELD")
        sock.close()


def labels_round(abuser: Any) -> None:
    """One round of the labels attack (``abuser``: a ``bench.abuser.Abuser``)."""
    pace = float(abuser.spec.get("pace_s", 0.02))
    lookup = abuser.channel.unary_unary("/kvshelf.v1.KVShelf/LookupPrefix",
                                        request_serializer=pb.LookupPrefixRequest.SerializeToString,
                                        response_deserializer=pb.LookupPrefixResponse.FromString)
    key = abuser._key("labels")
    base = next(abuser.serial)
    for i in range(LABELS_PER_ROUND):
        if abuser.stop.wait(pace):
            return
        try:
            lookup(pb.LookupPrefixRequest(namespace=abuser.namespace, keys=[key], model=f"made-up-{base}-{i}"),
                   metadata=abuser.metadata, timeout=10)
            abuser.tally.record("labels", "OK")
        except grpc.RpcError as exc:
            abuser.tally.failed("labels", exc)
    try:
        lookup(pb.LookupPrefixRequest(namespace=abuser.namespace, keys=[key], model="m" * LONG_MODEL_CHARS),
               metadata=abuser.metadata, timeout=10)
        abuser.tally.record("labels_long", "OK")
    except grpc.RpcError as exc:
        abuser.tally.failed("labels_long", exc)
    ports = abuser.spec.get("http_ports") or ()
    if ports:
        host = abuser.spec["address"].rsplit(":", 1)[0].strip("[]")
        code, body = http_get(host, int(ports[0]), "/metrics")
        if code == "OK":
            labels = {m for m, ns in _MODEL_LABEL.findall(body.decode("utf-8", "replace"))
                      if ns == abuser.namespace}
            bounded = len(labels) <= MAX_MODELS_PER_NAMESPACE + 1 and max(map(len, labels), default=0) <= \
                MAX_LABEL_CHARS
            code = "OK" if bounded else "UNBOUNDED"
        abuser.tally.record("labels_scrape", code)
    abuser.stop.wait(pace)


#: the HTTP attacks, run only when named (``--attacks slowhttp,labels``)
HTTP_ATTACKS = ("slowhttp", "labels")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for the server's ``--metrics-port`` and ``--admin-port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_args(attacks: Any) -> list[str]:
    """The ``kvshelf serve`` flags the HTTP attacks among ``attacks`` need: /metrics and the dashboard on."""
    if not set(attacks) & set(HTTP_ATTACKS):
        return []
    return ["--metrics-port", str(free_port()), "--admin-port", str(free_port())]


def http_ports_of(line: str) -> list[int]:
    """The /metrics and dashboard ports a ``kvshelf serve`` start-up line names, in that order (absent: left out)."""
    ports = []
    for what in ("metrics on ", "dashboard on "):
        match = re.search(re.escape(what) + r"http://(?:\[[^\]]*\]|[^:/\s]+):(\d+)/", line)
        if match:
            ports.append(int(match.group(1)))
    return ports


def start_http_attacks(abuser: Any, end: float) -> list[threading.Thread]:
    """The named HTTP attacks of ``abuser``'s spec, each on a started daemon thread running until ``end``."""
    attacks = set(abuser.spec.get("attacks", ())) & set(HTTP_ATTACKS)

    def labels() -> None:
        while time.monotonic() < end and not abuser.stop.is_set():
            labels_round(abuser)

    targets = {"slowhttp": lambda: slow_http(abuser, end), "labels": labels}
    threads = [threading.Thread(target=targets[name], name=f"abuse-{name}", daemon=True) for name in sorted(attacks)]
    for thread in threads:
        thread.start()
    return threads
