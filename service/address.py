"""Network addresses as the command line and ``kvshelf serve`` take them: checked before anything starts, and a
server that cannot be reached told apart by cause (a bad address, an unknown host, a refused or unanswered
connection).

Forms: ``HOST:PORT`` with ``HOST`` a host name, an IPv4 address or an IPv6 address in brackets (``[::1]:50051``);
gRPC targets may also be ``unix:PATH`` / ``unix-abstract:NAME`` or carry a ``dns:///``, ``ipv4:`` or ``ipv6:``
scheme. Light: the standard library and ``kvstore.errors`` only.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from typing import Any

from kvshelf.kvstore.errors import ConfigError, TierUnavailableError

MAX_PORT = 65535
_UNIX = ("unix:", "unix-abstract:")
_SCHEMES = ("dns:///", "ipv4:", "ipv6:")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_EXAMPLE = "e.g. 127.0.0.1:50051 or [::1]:50051"


def _error(flag: str, text: str) -> ConfigError:
    return ConfigError(f"{flag}: {text}" if flag else text)


def check_host(host: str, flag: str) -> str:
    """``host`` (a host name, an IPv4 address, or an IPv6 address, bare or in brackets) without brackets; a
    ``ConfigError`` starting with ``flag`` that names what is wrong."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare:
        raise _error(flag, f"no host in {host!r}")
    if ":" in bare or bare != host:
        try:
            return str(ipaddress.IPv6Address(bare))
        except ValueError:
            raise _error(flag, f"{host!r} is not an IPv6 address") from None
    if re.fullmatch(r"[0-9.]+", bare):
        try:
            return str(ipaddress.IPv4Address(bare))
        except ValueError:
            raise _error(flag, f"{host!r} is not an IPv4 address") from None
    name = bare.removesuffix(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise _error(flag, f"{host!r} is not a host name or IP address")
    return bare


def split_host_port(address: str, flag: str, *, allow_port_zero: bool) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (IPv6 in brackets), the port in ``[0 or 1, 65535]``; a ``ConfigError``
    starting with ``flag`` that names what is wrong (no port, a port out of range, a bare IPv6 address...)."""
    text = address.strip()
    least = 0 if allow_port_zero else 1
    if text.startswith("["):
        host, bracket, rest = text.partition("]")
        if not bracket:
            raise _error(flag, f"{address!r} has no closing bracket ({_EXAMPLE})")
        host += "]"
        if not rest.startswith(":"):
            raise _error(flag, f"{address!r} has no port; give HOST:PORT ({_EXAMPLE})")
        port_text = rest[1:]
    else:
        if ":" not in text:
            raise _error(flag, f"{address!r} has no port; give HOST:PORT ({_EXAMPLE})")
        host, _, port_text = text.rpartition(":")
        if ":" in host:
            raise _error(flag, f"{address!r}: put an IPv6 address in brackets, e.g. [::1]:50051")
    if not port_text.isascii() or not port_text.isdigit():
        raise _error(flag, f"port {port_text!r} of {address!r} is not a number in [{least}, {MAX_PORT}]")
    port = int(port_text)
    if not least <= port <= MAX_PORT:
        raise _error(flag, f"port {port} of {address!r} is out of range [{least}, {MAX_PORT}]")
    return check_host(host, flag), port


def check_listen(address: str, flag: str = "--listen") -> None:
    """A ``ConfigError`` unless ``address`` is something a server can listen on: ``HOST:PORT`` (port 0: a free
    one) or a Unix socket."""
    if address.startswith(_UNIX):
        if not address.split(":", 1)[1]:
            raise _error(flag, f"{address!r} names no socket path")
        return
    split_host_port(address, flag, allow_port_zero=True)


def parse_target(address: str, flag: str) -> tuple[str, int] | None:
    """``(host, port)`` of a server's gRPC target (port 1-65535), None for a Unix socket; a ``ConfigError``
    starting with ``flag`` for anything else."""
    if address.startswith(_UNIX):
        if not address.split(":", 1)[1]:
            raise _error(flag, f"{address!r} names no socket path")
        return None
    text = address
    for scheme in _SCHEMES:
        text = text.removeprefix(scheme)
    return split_host_port(text, flag, allow_port_zero=False)


def _resolve(host: str, port: int, timeout_s: float) -> list[tuple]:
    """``getaddrinfo`` for TCP, waited on for at most ``timeout_s`` (a resolver may hang for long; it runs on a
    daemon thread, so a command that gives up on it exits at once); ``TimeoutError`` past it."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            result.append(exc)

    thread = threading.Thread(target=run, name="kvshelf-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise TimeoutError(f"{host!r} did not resolve within {timeout_s:g} s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def probe_server(address: str, flag: str, timeout_s: float) -> None:
    """Check that a TCP connection to ``address`` (a gRPC target) opens within ``timeout_s``; raise at once where
    the cause is known: ``ConfigError`` for a malformed address, ``TierUnavailableError`` for a host that does not
    resolve, a refused connection or an unreachable network, and, after ``timeout_s``, for no answer. A Unix
    socket is checked by connecting to it too."""
    target = parse_target(address, flag)
    where = f"kvshelf server at {address}"
    if target is None:
        path = address.split(":", 1)[1]
        family_path = "\0" + path if address.startswith("unix-abstract:") else path
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect(family_path)
            except (FileNotFoundError, ConnectionRefusedError):
                raise TierUnavailableError(f"{where} unreachable: no server listens on {path}") from None
            except OSError as exc:
                raise TierUnavailableError(f"{where} unreachable: {exc.strerror or exc}") from None
        return
    host, port = target
    deadline = time.monotonic() + timeout_s
    try:
        infos = _resolve(host, port, timeout_s)
    except TimeoutError:
        raise TierUnavailableError(f"{where} unreachable: host {host!r} did not resolve within {timeout_s:g} s"
                                   ) from None
    except (OSError, UnicodeError) as exc:
        reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
        raise TierUnavailableError(f"{where} unreachable: unknown host {host!r} ({reason})") from None
    failures: list[str] = []
    for family, kind, proto, _, sockaddr in infos:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(left)
            try:
                sock.connect(sockaddr)
                return
            except ConnectionRefusedError:
                failures.append(f"connection refused (nothing listens on port {port})")
            except TimeoutError:
                break
            except OSError as exc:
                failures.append(exc.strerror or str(exc))
    if failures and time.monotonic() < deadline:
        raise TierUnavailableError(f"{where} unreachable: {failures[0]}")
    raise TierUnavailableError(f"{where} unreachable: timed out (no answer within {timeout_s:g} s: a firewall "
                               "dropping packets, or a host that is down)")
