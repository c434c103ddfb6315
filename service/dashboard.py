"""The admin dashboard: a web page of live charts over a JSON data endpoint, on a small HTTP server.

Routes: ``/`` (the page), ``/dashboard.js`` and ``/dashboard.css`` (its code and style, shipped in the package as
``service/dashboard_assets``: nothing is fetched from elsewhere), ``/api/data`` (one snapshot, JSON, from
``service.dashboard_data``), ``/api/history`` (the server's kept history, JSON: ``{"points": [...]}``, which the
page draws first) and ``POST /login`` (a form that turns the token into a cookie). The page polls
``/api/data`` every second and draws the rates from the differences of the snapshots it kept.

Access, as for ``/metrics``: the server binds 127.0.0.1 by default; an address other than loopback needs a token
(``check_dashboard_access``: a ``ConfigError`` otherwise), and then every request needs it, as
``Authorization: Bearer <token>`` or as the ``kvshelf_admin`` cookie the login form sets (``HttpOnly``,
``SameSite=Strict``; only that cookie is looked for, in a header of at most ``MAX_COOKIE_CHARS``); others get 401
(the page's 401 carries the login form). Without a token, only requests whose ``Host`` is ``localhost`` or a
loopback address are answered (421 otherwise: no DNS rebinding). Served by the bounded server of
``service.http_server`` (a fixed pool of workers, a read deadline, capped request heads).
"""

from __future__ import annotations

import hmac
import json
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from kvshelf.kvstore.errors import ConfigError, KVShelfError
from kvshelf.service.http_server import HttpServer
from kvshelf.service.metrics import is_loopback, start_wsgi

COOKIE = "kvshelf_admin"
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
          "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
#: every response: no framing, no sniffing, and the page may load only its own code and style
HEADERS = [("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; "
            "connect-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'"),
           ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"),
           ("Cache-Control", "no-store")]
LOGIN_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>kvshelf admin: token needed</title>
<link rel="stylesheet" href="/dashboard.css"></head><body><main class="login"><h1>kvshelf admin</h1>
<p>This dashboard needs its token (the file given to <code>--admin-token-file</code>).</p>
<form method="post" action="/login"><input type="password" name="token" autocomplete="current-password"
placeholder="token" autofocus> <button type="submit">open</button></form></main></body></html>
"""
_MAX_FORM_BYTES = 4096
#: the longest Cookie header looked into (a longer one is no login: the token comes with a bearer header then)
MAX_COOKIE_CHARS = 4096


def cookie_value(header: str, name: str) -> str | None:
    """The value of cookie ``name`` in a ``Cookie`` header (surrounding double quotes removed); ``None`` when
    absent or when the header is longer than ``MAX_COOKIE_CHARS``. One split: linear in the header's length."""
    if len(header) > MAX_COOKIE_CHARS:
        return None
    for part in header.split(";"):
        key, eq, value = part.partition("=")
        if eq and key.strip() == name:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            return value
    return None


def check_dashboard_access(addr: str, token: str | None, flag: str = "--admin-addr") -> None:
    """Refuse a dashboard without a token on an address other than loopback (it shows every tenant)."""
    if token is None and not is_loopback(addr):
        raise ConfigError(
            f"{flag} {addr!r} is not a loopback address and the dashboard names every tenant's namespace, model and "
            "most reused prefixes: set --admin-token-file or bind to 127.0.0.1"
        )


def load_asset(name: str) -> bytes:
    """One file of the page (``service/dashboard_assets/NAME``), as the installed package holds it."""
    return resources.files("kvshelf.service").joinpath("dashboard_assets", name).read_bytes()


class DashboardApp:
    """The WSGI application: the page, its assets, ``/api/data`` from ``source``, the token check."""

    def __init__(self, source: Callable[[], dict[str, Any]], *, token: str | None = None, title: str = "",
                 history: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.source = source
        self.history = history
        self.token = token.encode() if token is not None else None
        self.assets = {path: (load_asset(name), kind) for path, (name, kind) in ASSETS.items()}
        self.title = title

    def _authorized(self, environ: dict[str, Any]) -> bool:
        if self.token is None:
            return True
        scheme, _, given = str(environ.get("HTTP_AUTHORIZATION", "")).strip().partition(" ")
        if scheme.lower() == "bearer" and self._matches(given.strip()):
            return True
        value = cookie_value(str(environ.get("HTTP_COOKIE", "")), COOKIE)
        return value is not None and self._matches(value)

    def _matches(self, given: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(given.encode("utf-8", "replace"), self.token)

    def data(self) -> bytes:
        """The body of ``/api/data``: one snapshot, with the dashboard's title."""
        return json.dumps({**self.source(), "title": self.title}, separators=(",", ":")).encode()

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", "/"), environ.get("REQUEST_METHOD", "GET")

        def reply(status: str, body: bytes, kind: str, extra: list[tuple[str, str]] | None = None) -> list[bytes]:
            start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body))), *HEADERS,
                                    *(extra or [])])
            return [body] if method != "HEAD" else []

        if path == "/login" and method == "POST":
            return self._login(environ, reply)
        if path == "/dashboard.css" and method in ("GET", "HEAD"):  # the login form's style: no data in it
            return reply("200 OK", *self.assets[path])
        if not self._authorized(environ):
            challenge = [("WWW-Authenticate", 'Bearer realm="kvshelf admin"')]
            if path == "/":
                return reply("401 Unauthorized", LOGIN_PAGE.encode(), "text/html; charset=utf-8", challenge)
            return reply("401 Unauthorized", b"401: the kvshelf dashboard needs its token "
                         b"(Authorization: Bearer <token>)\n", "text/plain; charset=utf-8", challenge)
        if method not in ("GET", "HEAD"):
            return reply("405 Method Not Allowed", b"405\n", "text/plain; charset=utf-8", [("Allow", "GET, HEAD")])
        if path in ("/api/data", "/api/history"):
            try:
                body = self.data() if path == "/api/data" else json.dumps(
                    {"points": self.history() if self.history is not None else []}, separators=(",", ":")).encode()
                return reply("200 OK", body, "application/json")
            except KVShelfError as exc:  # a remote server gone or refusing: say so, keep serving
                return reply("503 Service Unavailable", f"503: {exc}\n".encode(), "text/plain; charset=utf-8")
        if path in self.assets:
            return reply("200 OK", *self.assets[path])
        return reply("404 Not Found", b"404\n", "text/plain; charset=utf-8")

    def _login(self, environ: dict[str, Any], reply: Callable[..., list[bytes]]) -> list[bytes]:
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_FORM_BYTES:
            return reply("400 Bad Request", b"400: a login form of at most 4 KiB\n", "text/plain; charset=utf-8")
        form = urllib.parse.parse_qs(environ["wsgi.input"].read(length).decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0].strip()
        if self.token is None or not self._matches(given):
            return reply("401 Unauthorized", LOGIN_PAGE.encode(), "text/html; charset=utf-8")
        cookie = f"{COOKIE}={given}; HttpOnly; SameSite=Strict; Path=/"
        return reply("303 See Other", b"", "text/plain; charset=utf-8", [("Location", "/"), ("Set-Cookie", cookie)])


@dataclass
class DashboardEndpoint:
    """A started dashboard: ``url`` to open, ``close`` to stop it."""

    host: str
    port: int
    token_required: bool
    _server: HttpServer | None = field(repr=False, default=None)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def describe(self) -> str:
        """``http://127.0.0.1:8080/ (bearer token)`` for the start-up line."""
        return f"{self.url} ({'bearer token' if self.token_required else 'no token: loopback only'})"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def serve_dashboard(source: Callable[[], dict[str, Any]], port: int, addr: str = "127.0.0.1", *,
                    token: str | None = None, title: str = "",
                    history: Callable[[], list[dict[str, Any]]] | None = None) -> DashboardEndpoint:
    """Start the dashboard on ``addr:port`` (port 0: a free one) in a daemon thread; ``source()`` gives each
    ``/api/data`` answer, ``history()`` the ``/api/history`` points. A non-loopback ``addr`` without a token is a
    ``ConfigError``."""
    check_dashboard_access(addr, token)
    app = DashboardApp(source, token=token, title=title, history=history)
    server, host, bound_port = start_wsgi(app, addr, port, flag="--admin-port", thread_name="kvshelf-dashboard",
                                          loopback_hosts=token is None)
    return DashboardEndpoint(host, bound_port, token is not None, server)
