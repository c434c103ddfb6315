"""Fuzz target of the admin surfaces' request-head parser (``service/http_server.py``: ``/metrics`` and the
dashboard).

``check_head(raw)``: the server reads ``raw`` as a request (its head up to the first empty line) or refuses it with
``HttpRequestError`` of status 400, 413 or 431, never another exception; what it reads is a token method, a target
starting with ``/`` and HTTP/1.0 or 1.1.

The test suite runs this through hypothesis, and whole requests over real sockets against a real ``kvshelf
serve`` (``tests/service/test_http_fuzz.py``); for a long run with coverage guidance::

    pip install atheris
    python tests/support/fuzz_http.py -max_total_time=600

Without atheris the script runs a seeded random mutation loop instead (``python tests/support/fuzz_http.py
[rounds]``).
"""

from __future__ import annotations

import re

from fuzz_driver import fuzz_main

from kvshelf.service import http_server
from kvshelf.service.http_server import HttpLimits, HttpRequestError, parse_head

#: valid requests the fallback loop mutates (the atheris run starts from nothing and finds its own)
SEEDS: tuple[bytes, ...] = (
    b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9100\r\nAccept: application/openmetrics-text; version=1.0.0\r\n"
    b"Accept-Encoding: gzip\r\n\r\n",
    b"GET /api/data HTTP/1.1\r\nHost: localhost:8080\r\nAuthorization: Bearer s3cret-admin-token_0123456789\r\n\r\n",
    b"GET / HTTP/1.0\r\nCookie: a=b; kvshelf_admin=\"s3cret\"\r\n\r\n",
    b"POST /login HTTP/1.1\r\nHost: [::1]:8080\r\nContent-Type: application/x-www-form-urlencoded\r\n"
    b"Content-Length: 11\r\n\r\ntoken=s3cret",
    b"HEAD /dashboard.css?x=%00 HTTP/1.1\n\n",
)
_METHOD = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def check_head(raw: bytes) -> None:
    """``parse_head`` reads the head of ``raw`` or refuses it with ``HttpRequestError`` (400/413/431) only."""
    head_bytes = re.split(rb"\r?\n\r?\n", raw, maxsplit=1)[0]
    limits = HttpLimits()
    try:
        head = parse_head(head_bytes, limits.max_headers)
        head.content_length(limits.max_body_bytes)
    except HttpRequestError as exc:
        assert exc.status in (400, 413, 431), exc
        return
    assert _METHOD.fullmatch(head.method) and head.target.startswith("/"), head
    assert head.version in ("HTTP/1.0", "HTTP/1.1"), head
    assert all(name == name.lower() for name, _ in head.headers), head


def main() -> None:
    fuzz_main(check_head, SEEDS, http_server, "fuzz_http: {rounds} mutated request heads, no crash")


if __name__ == "__main__":
    main()
