"""The HTTP server of the admin surfaces (``/metrics``, the dashboard): a WSGI application served with bounded
threads, connections, bytes and time.

One I/O thread accepts connections and reads each request head (and a small body) without blocking; a fixed pool
of worker threads runs the application and writes its answer. What a connection can hold:

- time: a request head (and its body) must arrive within ``read_deadline_s`` of the connection; then it is closed;
- bytes: a head over ``max_head_bytes`` or ``max_headers`` lines is answered 431, a body over ``max_body_bytes``
  413, a malformed head 400 (``parse_head``); ``Transfer-Encoding`` is refused (400: bodies need Content-Length);
- connections: at most ``max_connections`` are read at once; one more closes the oldest still being read (a
  client that sends its request at once is served however many silent connections others hold);
- threads: ``workers`` threads run requests, from a queue of ``queue`` complete requests; past that, 503.

Every answer ends its connection (``Connection: close``). ``loopback_hosts``: only requests whose ``Host`` is a
loopback address or ``localhost`` (``allowed_loopback_host``) reach the application, others get 421 (a page of
another site that a DNS name rebinding points at this server cannot read it).
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import logging
import queue
import re
import selectors
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvshelf.kvstore.errors import KVShelfError

log = logging.getLogger(__name__)

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: a method or a header name
_VERSION = re.compile(r"HTTP/1\.[01]")
_REASONS = {200: "OK", 400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
            421: "Misdirected Request", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


@dataclass(frozen=True)
class HttpLimits:
    """What one server may hold: worker threads, connections being read, complete requests waiting, seconds to
    send a request, seconds a worker waits for a slow reader, and the bytes of a head and a body."""

    workers: int = 4
    max_connections: int = 128
    queue: int = 32
    read_deadline_s: float = 5.0
    write_timeout_s: float = 10.0
    max_head_bytes: int = 16 << 10
    max_headers: int = 100
    max_body_bytes: int = 64 << 10
    backlog: int = 128


class HttpRequestError(KVShelfError):
    """A request this server refuses before the application sees it: ``status`` and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class RequestHead:
    """A parsed request head: method, target, version and the header lines (names lower-cased, in order)."""

    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        """The value of the one header called ``name`` (lower case); ``None`` when absent."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def content_length(self, limit: int) -> int:
        """The body's length (0 without a Content-Length); a ``HttpRequestError`` when malformed or over ``limit``."""
        if self.header("transfer-encoding") is not None:
            raise HttpRequestError(400, "Transfer-Encoding is not accepted: send a Content-Length")
        value = self.header("content-length")
        if value is None:
            return 0
        if not value.isdigit() or len(value) > 12:
            raise HttpRequestError(400, f"Content-Length {value[:40]!r} is not a number of bytes")
        length = int(value)
        if length > limit:
            raise HttpRequestError(413, f"a body of {length} bytes: the limit is {limit}")
        return length


def parse_head(raw: bytes, max_headers: int = HttpLimits.max_headers) -> RequestHead:
    """The request head ``raw`` (the bytes before the empty line; lines end in CRLF or LF), checked: a request
    line ``METHOD /target HTTP/1.x`` and ``Name: value`` lines; a ``HttpRequestError`` (400, or 431 past
    ``max_headers`` lines) naming the first fault. One linear pass; values are Latin-1 (as WSGI has them)."""
    lines = raw.decode("latin-1").split("\n")
    if len(lines) > max_headers + 1:
        raise HttpRequestError(431, f"more than {max_headers} header lines")
    parts = lines[0].removesuffix("\r").split(" ")
    if len(parts) != 3:
        raise HttpRequestError(400, "the request line is not METHOD TARGET HTTP/1.x")
    method, target, version = parts
    if _TOKEN.fullmatch(method) is None:
        raise HttpRequestError(400, "the method is not a token")
    if not target.startswith("/") or any(c <= " " or c == "\x7f" for c in target):
        raise HttpRequestError(400, "the target is not an absolute path")
    if _VERSION.fullmatch(version) is None:
        raise HttpRequestError(400, "the version is not HTTP/1.0 or HTTP/1.1")
    headers = []
    seen: set[str] = set()
    for line in lines[1:]:
        line = line.removesuffix("\r")
        name, colon, value = line.partition(":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise HttpRequestError(400, "a header line is not Name: value")
        if "\r" in value or "\x00" in value:
            raise HttpRequestError(400, f"header {name[:40]} holds a control character")
        name = name.lower()
        if name in seen and name in ("host", "authorization", "content-length", "cookie"):
            raise HttpRequestError(400, f"header {name} given twice")
        seen.add(name)
        headers.append((name, value.strip(" \t")))
    return RequestHead(method, target, version, tuple(headers))


def allowed_loopback_host(host: str | None, port: int) -> bool:
    """Whether a ``Host`` header names this loopback server: ``localhost`` or a loopback address (IPv6 in
    brackets), with ``port`` or no port. No ``Host`` (HTTP/1.0) is allowed: browsers always send one."""
    if host is None:
        return True
    name, given_port = host, None
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return False
        given_port = rest[1:] if rest else None
    elif ":" in host:
        name, _, given_port = host.rpartition(":")
    if given_port is not None and given_port != str(port):
        return False
    if name.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # another name: maybe one rebound to 127.0.0.1 by a site the browser shows


def plain_response(status: int, text: str) -> bytes:
    """A whole ``Connection: close`` answer of ``status`` with a one-line text body."""
    body = f"{status}: {text}\n".encode()
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


@dataclass
class _Conn:
    sock: socket.socket
    peer: tuple[Any, ...]
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    head: RequestHead | None = None
    body_at: int = 0
    body_length: int = 0
    draining: bool = False  # answered by the I/O thread: reading (and dropping) what the client still sends


class HttpServer:
    """``app`` (WSGI) on ``addr:port`` (port 0: a free one) with the bounds of ``limits``; ``start`` runs it on
    daemon threads named after ``name``, ``close`` stops them and closes every connection."""

    def __init__(self, app: Callable, addr: str, port: int, *, name: str, limits: HttpLimits = HttpLimits(),
                 loopback_hosts: bool = False) -> None:
        self.app = app
        self.name = name
        self.limits = limits
        self.loopback_hosts = loopback_hosts
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((addr.strip("[]"), port))
            self.listener.listen(limits.backlog)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.host, self.port = self.listener.getsockname()[:2]
        self._conns: dict[socket.socket, _Conn] = {}  # in accept order: the first is the oldest
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._ready: queue.Queue[tuple[_Conn, bytes] | None] = queue.Queue(limits.queue)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._quiet_until = 0.0  # no accept-failure warning before this (one per 10 s)

    @property
    def server_address(self) -> tuple[str, int]:
        return self.host, self.port

    def start(self) -> HttpServer:
        """Start the I/O thread and the workers (daemon threads)."""
        self._threads.append(threading.Thread(target=self._io_loop, name=self.name, daemon=True))
        for i in range(self.limits.workers):
            self._threads.append(threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop the threads and close the listener and every connection (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        for _ in range(self.limits.workers):
            try:
                self._ready.put(None, timeout=1)
            except queue.Full:
                break
        for thread in self._threads:
            thread.join(5)
        while True:  # requests no worker took
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _close(item[0].sock)
        self._selector.close()
        for sock in (self.listener, self._wake_r, self._wake_w, *self._conns):
            _close(sock)
        self._conns.clear()

    # the I/O thread ---------------------------------------------------------------------------------------------

    def _io_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._io_round()
            except Exception:  # noqa: BLE001 (one bad round must not stop the listener)
                log.exception("%s: I/O round failed; serving on", self.name)
                time.sleep(0.05)

    def _io_round(self) -> None:
        now = time.monotonic()
        timeout = 0.5
        if self._conns:
            timeout = min(timeout, max(0.0, next(iter(self._conns.values())).deadline - now))
        for key, _ in self._selector.select(timeout):
            sock = key.fileobj
            if sock is self.listener:
                self._accept()
            elif sock is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            elif sock in self._conns:
                conn = self._conns[sock]
                try:
                    self._readable(conn)
                except Exception:  # noqa: BLE001 (a fault of ours on one connection: that one is closed)
                    log.exception("%s: request from %s failed", self.name, conn.peer)
                    self._drop(conn)
        self._expire(time.monotonic())

    def _accept(self) -> None:
        for _ in range(64):  # at most this many per round: the others wait in the backlog
            try:
                sock, peer = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of fds (EMFILE...): make room (or wait a little), try again next round
                now = time.monotonic()
                if now >= self._quiet_until:
                    log.warning("%s: accept failed: %s (the oldest connection being read is closed)", self.name, exc)
                    self._quiet_until = now + 10.0
                if self._conns:
                    self._evict_oldest()
                else:
                    time.sleep(0.05)
                return
            if len(self._conns) >= self.limits.max_connections:
                self._evict_oldest()
            sock.setblocking(False)
            conn = _Conn(sock, peer, time.monotonic() + self.limits.read_deadline_s)
            self._conns[sock] = conn
            try:
                self._selector.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                self._drop(conn)

    def _evict_oldest(self) -> None:
        self._drop(next(iter(self._conns.values())))

    def _expire(self, now: float) -> None:
        while self._conns:
            conn = next(iter(self._conns.values()))
            if conn.deadline > now:
                return
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        _close(conn.sock)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        if conn.draining:
            return
        conn.buf += data
        try:
            if conn.head is None:
                self._read_head(conn)
            if conn.head is not None and len(conn.buf) - conn.body_at >= conn.body_length:
                self._dispatch(conn)
        except HttpRequestError as exc:
            self._answer_here(conn, exc.status, exc.reason)

    def _read_head(self, conn: _Conn) -> None:
        limit = self.limits.max_head_bytes
        end = _HEAD_END.search(conn.buf, 0, limit + 4)
        if end is None:
            if len(conn.buf) > limit:
                raise HttpRequestError(431, f"a request head over {limit} bytes")
            if conn.buf.lstrip(b"\r\n") and not conn.buf[:16].lstrip(b"\r\n")[:1].isalpha():
                raise HttpRequestError(400, "this is not an HTTP request")  # TLS or another protocol: at once
            return
        raw = bytes(conn.buf[: end.start()]).lstrip(b"\r\n")  # a few empty lines before a request are allowed
        head = parse_head(raw, self.limits.max_headers)
        if self.loopback_hosts and not allowed_loopback_host(head.header("host"), self.port):
            raise HttpRequestError(421, "this server answers requests for localhost / a loopback address only")
        conn.body_length = head.content_length(self.limits.max_body_bytes)
        conn.head, conn.body_at = head, end.end()

    def _dispatch(self, conn: _Conn) -> None:
        assert conn.head is not None
        body = bytes(conn.buf[conn.body_at : conn.body_at + conn.body_length])
        self._conns.pop(conn.sock, None)
        self._selector.unregister(conn.sock)
        try:
            self._ready.put_nowait((conn, body))
        except queue.Full:
            self._conns[conn.sock] = conn
            self._selector.register(conn.sock, selectors.EVENT_READ)
            self._answer_here(conn, 503, "busy: try again")

    def _answer_here(self, conn: _Conn, status: int, reason: str) -> None:
        """A short error answer from the I/O thread; then the connection drains what the client still sends
        (so the answer is not lost to a reset) until it closes or a second passes."""
        try:
            conn.sock.send(plain_response(status, reason))
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn)
            return
        conn.draining = True
        conn.buf = bytearray()
        self._conns.pop(conn.sock, None)
        conn.deadline = time.monotonic() + 1.0
        self._conns[conn.sock] = conn  # at the end: deadlines stay in order

    # the workers ------------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._ready.get()
            if item is None or self._stop.is_set():
                if item is not None:
                    _close(item[0].sock)
                return
            conn, body = item
            try:
                conn.sock.settimeout(self.limits.write_timeout_s)
                conn.sock.sendall(self._run_app(conn, body))
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the client went away or did not read within the write timeout
            except Exception:  # noqa: BLE001 (the worker serves on)
                log.exception("%s: answering %s failed", self.name, conn.peer)
            finally:
                _close(conn.sock)

    def _run_app(self, conn: _Conn, body: bytes) -> bytes:
        """The application's whole answer to ``conn``'s request (500 when it raises)."""
        head = conn.head
        assert head is not None
        status_line: list[str] = []
        headers: list[tuple[str, str]] = []

        def start_response(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            status_line[:] = [status]
            headers[:] = response_headers
            return lambda data: None  # write(): not used by these applications

        try:
            result = self.app(self._environ(conn, head, body), start_response)
            try:
                chunks = [bytes(chunk) for chunk in result]
            finally:
                if hasattr(result, "close"):
                    result.close()
        except Exception:  # noqa: BLE001 (a fault of the application, not the client's)
            log.exception("%s: the application failed on %s %s", self.name, head.method, head.target[:200])
            return plain_response(500, "the server failed on this request (see its log)")
        payload = b"".join(chunks) if head.method != "HEAD" else b""
        names = {name.lower() for name, _ in headers}
        out = [f"HTTP/1.1 {status_line[0] if status_line else '500 Internal Server Error'}"]
        out += [f"{name}: {value}" for name, value in headers if name.lower() != "connection"]
        if "content-length" not in names:
            out.append(f"Content-Length: {sum(map(len, chunks))}")
        out.append("Connection: close")
        return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + payload

    def _environ(self, conn: _Conn, head: RequestHead, body: bytes) -> dict[str, Any]:
        path, _, query = head.target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": head.method, "SCRIPT_NAME": "", "PATH_INFO": urllib.parse.unquote(path, "latin-1"),
            "QUERY_STRING": query, "SERVER_NAME": str(self.host), "SERVER_PORT": str(self.port),
            "SERVER_PROTOCOL": head.version, "REMOTE_ADDR": str(conn.peer[0]) if conn.peer else "",
            "CONTENT_LENGTH": str(len(body)) if body else "", "wsgi.version": (1, 0), "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr, "wsgi.multithread": True,
            "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        for name, value in head.headers:
            if "_" in name:
                continue  # HTTP_X_Y would read the same as x-y: dropped, as wsgiref does
            key = "CONTENT_TYPE" if name == "content-type" else "HTTP_" + name.upper().replace("-", "_")
            if key in ("HTTP_CONTENT_LENGTH",):
                continue
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def serve_wsgi(app: Callable[[dict[str, Any], Callable], Iterable[bytes]], addr: str, port: int, *, name: str,
               limits: HttpLimits = HttpLimits(), loopback_hosts: bool = False) -> HttpServer:
    """An ``HttpServer`` of ``app`` on ``addr:port``, started."""
    return HttpServer(app, addr, port, name=name, limits=limits, loopback_hosts=loopback_hosts).start()
