"""Fuzzed HTTP requests against the admin surfaces of a real ``kvshelf serve`` (``/metrics`` without a token, the
dashboard with one), over real sockets: every request head hypothesis makes (and byte-level mutations of real
ones) gets a 2xx/3xx/4xx answer or a clean close, never a 5xx, and the server answers an honest request after each.
The head parser alone runs through the same checks as the atheris target ``tests/support/fuzz_http.py``."""

from __future__ import annotations

import random

from dashboard_helpers import TOKEN, token_file, traffic
from fuzz_driver import mutate
from fuzz_http import SEEDS, check_head
from http_probe import raw_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import free_port

FUZZ = settings(max_examples=250, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_TEXT = st.text(st.characters(max_codepoint=0x17F), max_size=40)
GOOD_METHODS = st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"])
BAD_METHODS = st.sampled_from(["CONNECT", "G T", "", "get", "GET\x00"]) | _TEXT
GOOD_PATHS = st.sampled_from(["/", "/metrics", "/api/data", "/api/history", "/login", "/dashboard.js",
                              "/dashboard.css", "/favicon.ico", "/?name[]=kvshelf_tier_bytes", "/%2e%2e/etc/passwd",
                              "//x", "/%ff%00", "/api/data?x=%zz&&=&"])
BAD_PATHS = st.sampled_from(["*", "http://evil/", "", "/a b"]) | _TEXT.map(lambda t: "/" + t)
GOOD_VERSIONS = st.sampled_from(["HTTP/1.1", "HTTP/1.0"])
BAD_VERSIONS = st.sampled_from(["HTTP/2", "HTTP/1.1 x", "http/1.1", "", "HTTP/1.1\r\n", "HTTP/1.10"])
GOOD_HEADERS = st.sampled_from([
    ("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer"), ("Authorization", "Basic eDp5"),
    ("Cookie", f"kvshelf_admin={TOKEN}"), ("Cookie", f'a=b; kvshelf_admin="{TOKEN}"'),
    ("Cookie", 'kvshelf_admin="\\\\\\"'), ("Cookie", "a=b;;;=;kvshelf_admin"), ("Accept-Encoding", "gzip"),
    ("Accept-Encoding", "identity;q=0"), ("Accept", "application/openmetrics-text; version=1.0.0"),
    ("Accept", "text/plain;version=0.0.4"), ("Accept", "*/*;q=x"), ("Content-Length", "0"),
    ("Content-Length", "12"), ("Expect", "100-continue"), ("Connection", "keep-alive, upgrade"),
    ("Content-Type", "application/x-www-form-urlencoded"), ("X_Forwarded_For", "1.2.3.4"),
    ("User-Agent", "fuzz"), ("If-None-Match", "*"),
])
BAD_NAMES = st.sampled_from(["Host", "Transfer-Encoding", "Content-Length", " Host", "Host ", "", "X\x00"]) | _TEXT
BAD_VALUES = st.sampled_from(["-1", "99999999999999999999", "1x", "chunked", "\x00", "a\rb", "evil.example",
                              "localhost"]) | _TEXT


def _piece(draw: st.DrawFn, good: st.SearchStrategy[str], bad: st.SearchStrategy[str]) -> str:
    """Mostly a well-formed piece (so requests reach the applications), sometimes a bad one."""
    return draw(bad) if draw(st.integers(0, 7)) == 0 else draw(good)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A request head (mostly well formed, often not), a body, and sometimes byte-level damage on top."""
    lines = [f"{_piece(draw, GOOD_METHODS, BAD_METHODS)} {_piece(draw, GOOD_PATHS, BAD_PATHS)} "
             f"{_piece(draw, GOOD_VERSIONS, BAD_VERSIONS)}"]
    if draw(st.integers(0, 3)):
        lines.append("Host: {host}")  # the server's own name and port, filled in per surface
    for _ in range(draw(st.integers(0, 5))):
        name, value = draw(GOOD_HEADERS)
        if draw(st.integers(0, 7)) == 0:
            name, value = draw(st.sampled_from([name]) | BAD_NAMES), draw(st.sampled_from([value]) | BAD_VALUES)
        lines.append(f"{name}: {value}")
    body = draw(st.sampled_from([b"", b"token=" + TOKEN.encode(), b"token=wrong"]) | st.binary(max_size=64))
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body
    if draw(st.integers(0, 4)) == 0:
        raw = mutate(raw, random.Random(draw(st.integers(0, 2**32))))
    return raw


def _answer(port: int, raw: bytes) -> int | None:
    """The status of ``raw``'s answer (``None``: closed without one), the write side closed after ``raw``."""
    status, answer = raw_request(port, raw, close_write=True)
    assert not answer or answer.startswith(b"HTTP/1.1 "), answer[:200]
    return status


def _alive(port: int, path: str, token: str | None = None) -> None:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    raw = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}\r\n".encode()
    assert _answer(port, raw) == 200


def test_fuzzed_requests_get_4xx_or_2xx_never_5xx(serving, tmp_path):
    admin_port = free_port()
    running = serving(admin_port=admin_port, admin_token_file=str(token_file(tmp_path)))
    traffic(running.grpc, "tenant-a", 2)
    surfaces = ((running.metrics_port, "/metrics", None), (admin_port, "/api/data", TOKEN))

    @FUZZ
    @given(raw=requests())
    def run(raw: bytes) -> None:
        for port, path, token in surfaces:
            request = raw.replace(b"{host}", f"127.0.0.1:{port}".encode())
            status = _answer(port, request)
            assert status is None or 200 <= status < 500, (status, request[:300])
            _alive(port, path, token)

    run()


@FUZZ
@given(raw=st.sampled_from(SEEDS).flatmap(lambda seed: st.integers(0, 2**32).map(
    lambda n: mutate(seed, random.Random(n)))) | st.binary(max_size=300))
def test_head_parser_refuses_with_400_413_431_only(raw):
    check_head(raw)
