"""The admin surfaces' HTTP server (``/metrics`` and the dashboard, ``service/http_server.py``) under attack, over
real sockets against a real ``kvshelf serve``: silent connections hold a bounded number of threads and fds and are
closed after the read deadline while honest requests are answered; an oversized or quadratic Cookie is refused
at once; a token-less server answers only loopback ``Host`` names (no DNS rebinding); malformed heads get 4xx."""

from __future__ import annotations

import json
import resource
import threading

import pytest
from dashboard_helpers import TOKEN, token_file, traffic
from http_probe import get, open_silent, raw_request, threads_and_fds, wait_for
from service_helpers import ServeProcess, free_port

from kvshelf.service.http_server import HttpLimits

SILENT = 400  # per port: 800 in all, as in the issue
LIMITS = HttpLimits()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A ``kvshelf serve`` subprocess with /metrics (no token) and the dashboard (a token), shared by this module's
    tests: ``(server, metrics port, admin port)``."""
    tmp_path = tmp_path_factory.mktemp("served")
    metrics_port, admin_port = free_port(), free_port()
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--memory", "16MiB",
                          "--max-disk", "64MiB", "--metrics-port", str(metrics_port), "--admin-port", str(admin_port),
                          "--admin-token-file", str(token_file(tmp_path)))
    try:
        yield server, metrics_port, admin_port
    finally:
        server.stop()


def _honest(metrics_port: int, admin_port: int) -> None:
    status, answer = get(metrics_port, "/metrics")
    assert status == 200 and b"kvshelf_tier_bytes" in answer, answer[:300]
    status, answer = get(admin_port, "/api/data", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, answer[:300]
    assert "tenant-a" in json.dumps(json.loads(answer.split(b"\r\n\r\n", 1)[1]))


def test_silent_connections_hold_bounded_threads_and_fds_then_are_closed(served):
    server, metrics_port, admin_port = served
    pid = server.proc.pid
    traffic(server.address, "tenant-a", 2)
    _honest(metrics_port, admin_port)
    threads0, fds0 = threads_and_fds(pid)
    silent = open_silent(metrics_port, SILENT) + open_silent(admin_port, SILENT)
    try:
        peak = [0, 0]

        def sample() -> bool:
            threads, fds = threads_and_fds(pid)
            peak[0], peak[1] = max(peak[0], threads), max(peak[1], fds)
            return False

        wait_for(sample, 2.0)  # the server has accepted what it will of the 800 by now
        _honest(metrics_port, admin_port)  # answered while 800 silent connections are open
        sample()
        # no thread per connection: the two servers' threads were started before (workers and an I/O thread each)
        assert peak[0] <= threads0 + 4, (threads0, peak)
        # at most max_connections being read per server, and a few answered or closing
        assert peak[1] <= fds0 + 2 * LIMITS.max_connections + 16, (fds0, peak)
        # after the read deadline every silent connection is closed (the clients still hold theirs open)
        assert wait_for(lambda: threads_and_fds(pid)[1] <= fds0 + 4, LIMITS.read_deadline_s + 15), \
            (fds0, threads_and_fds(pid))
        _honest(metrics_port, admin_port)
        assert server.proc.poll() is None
    finally:
        for sock in silent:
            sock.close()


def test_slow_head_is_closed_at_the_deadline(served):
    """A client that sends part of a head and then nothing is closed after the read deadline (408 or a close)."""
    _, metrics_port, _ = served
    status, answer = raw_request(metrics_port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                                 timeout=LIMITS.read_deadline_s + 10)
    assert status is None and answer == b""


def test_quadratic_cookie_is_refused_at_once_and_honest_get_unaffected(served):
    """CVE-2024-7592: ``http.cookies`` takes seconds on a 60 KiB cookie of backslashes (Python < 3.11.10); four at
    once must each get a 4xx within a liveness bound, while a request with the token is answered."""
    server, metrics_port, admin_port = served
    traffic(server.address, "tenant-a", 1)
    cookie = 'kvshelf_admin="' + "\\" * (60 << 10) + '"'
    head = f"GET /api/data HTTP/1.1\r\nHost: 127.0.0.1:{admin_port}\r\nCookie: {cookie}\r\n\r\n".encode()
    answers: list[int | None] = []

    def attack() -> None:
        answers.append(raw_request(admin_port, head, timeout=8)[0])

    attackers = [threading.Thread(target=attack) for _ in range(4)]
    for thread in attackers:
        thread.start()
    _honest(metrics_port, admin_port)
    for thread in attackers:
        thread.join(20)
    assert len(answers) == 4 and all(a is not None and 400 <= a < 500 for a in answers), answers
    # a cookie under the head cap but over the cookie cap is no login either (401), at once
    long_cookie = f"x={'a' * 6000}; kvshelf_admin={TOKEN}"
    assert get(admin_port, "/api/data", headers={"Cookie": long_cookie}, timeout=8)[0] == 401
    assert get(admin_port, "/api/data", headers={"Cookie": f"a=b; kvshelf_admin={TOKEN}"})[0] == 200
    assert get(admin_port, "/api/data", headers={"Cookie": f'kvshelf_admin="{TOKEN}"'})[0] == 200


@pytest.mark.parametrize(("head", "status"), [
    (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (LIMITS.max_head_bytes + 10) + b"\r\n\r\n", 431),
    (b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * (LIMITS.max_headers + 1) + b"\r\n", 431),
    (b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999\r\n\r\n", 413),
    (b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil\r\n\r\n", 400),
    (b"GET /metrics HTTP/2.0\r\n\r\n", 400),
    (b"GET http://evil/metrics HTTP/1.1\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\n folded\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),  # a TLS hello: answered at once
])
def test_malformed_heads_get_4xx_and_the_server_serves_on(served, head, status):
    _, metrics_port, admin_port = served
    for port in (metrics_port, admin_port):
        got, answer = raw_request(port, head)
        assert got == status, answer[:200]
    _honest_metrics(metrics_port)


def _honest_metrics(port: int) -> None:
    assert get(port, "/metrics")[0] == 200


@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1:{port}", True), ("localhost:{port}", True), ("[::1]:{port}", True), ("127.0.0.1", True),
    ("LOCALHOST:{port}", True), ("evil.example:{port}", False), ("evil.example", False),
    ("127.0.0.1:1", False), ("localhost.evil.example:{port}", False), ("[::1", False), ("10.0.0.1:{port}", False),
])
def test_token_less_surfaces_answer_loopback_hosts_only(served, host, allowed):
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 sends ``Host: evil.example``."""
    _, metrics_port, _ = served
    status, _ = get(metrics_port, "/metrics", host=host.format(port=metrics_port))
    assert status == (200 if allowed else 421)


def test_token_less_dashboard_answers_loopback_hosts_only(tmp_path):
    port = free_port()
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--memory", "16MiB",
                          "--max-disk", "64MiB", "--admin-port", str(port))
    try:
        traffic(server.address, "tenant-a", 1)
        status, answer = get(port, "/api/data", host=f"rebound.example:{port}")
        assert status == 421 and b"tenant-a" not in answer
        assert get(port, "/", host=f"rebound.example:{port}")[0] == 421
        assert get(port, "/api/data", host=f"localhost:{port}")[0] == 200
    finally:
        server.stop()


def test_a_token_makes_any_host_name_fine(served):
    """With a token (the dashboard here), the token protects: a name other than loopback is answered."""
    _, _, admin_port = served
    assert get(admin_port, "/api/data", host="kvshelf.internal", headers={"Authorization": f"Bearer {TOKEN}"})[0] \
        == 200
    assert get(admin_port, "/api/data", host="kvshelf.internal")[0] == 401


def test_under_a_low_fd_limit_silent_connections_leave_room_for_honest_calls(tmp_path):
    """Under a small fd limit, silent HTTP connections must not take the fds an honest call needs: when accept
    fails for want of fds the server closes the oldest connection it reads; scrapes and gRPC calls still work."""
    metrics_port = free_port()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # the server inherits it: ~20 fds of its own, so accept fails (EMFILE) before 128 connections are read
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
    try:
        server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--memory", "16MiB",
                              "--max-disk", "64MiB", "--metrics-port", str(metrics_port))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    silent: list = []
    try:
        silent = open_silent(metrics_port, 600)
        wait_for(lambda: False, 1.0)
        for _ in range(3):
            assert get(metrics_port, "/metrics")[0] == 200
        traffic(server.address, "tenant-a", 2)  # gRPC put, get and lookup: fds for its connection were left
        assert server.proc.poll() is None
    finally:
        for sock in silent:
            sock.close()
        server.stop()
