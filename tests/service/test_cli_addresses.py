"""Addresses on the command line, as a user gives them: ``kvshelf serve`` refuses a listen address it cannot honour
(a port out of range, no port, a bare IPv6 address) before it starts anything, with one line and exit code 2; the
client commands (``stats``, ``events``, ``dashboard``) tell a malformed address, an unknown host, a refused
connection and a connection nobody answers apart, the first three at once. Real subprocesses of the command line,
real sockets on loopback."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_helpers import ServeProcess, kvshelf_cli

from kvshelf.kvstore.errors import ConfigError
from kvshelf.service.address import check_host, check_listen, parse_target

#: --connect-timeout of the checks that must not wait for it (a bound on liveness, not a timing claim: a command
#: that returned well before it did not wait it out)
WAIT_S = "60"


def _one_error_line(done) -> str:  # noqa: ANN001
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize(("listen", "says"), [
    ("127.0.0.1:99999", "port 99999 of '127.0.0.1:99999' is out of range [0, 65535]"),
    ("127.0.0.1", "'127.0.0.1' has no port"),
    ("127.0.0.1:", "port '' of '127.0.0.1:' is not a number"),
    ("127.0.0.1:-1", "port '-1' of '127.0.0.1:-1' is not a number"),
    ("::1:50051", "put an IPv6 address in brackets"),
    ("[::1]", "'[::1]' has no port"),
    ("[::1:5", "has no closing bracket"),
    ("300.1.1.1:5", "'300.1.1.1' is not an IPv4 address"),
    ("bad host:5", "'bad host' is not a host name or IP address"),
    (":5", "no host in ''"),
])
def test_serve_refuses_a_listen_address_it_cannot_honour(listen: str, says: str, tmp_path: Path) -> None:
    done = kvshelf_cli("serve", "--listen", listen, "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2, done.stdout + done.stderr
    line = _one_error_line(done)
    assert line.startswith("error: --listen: ") and says in line
    assert "kvshelf serving on" not in done.stdout
    assert not (tmp_path / "data").exists()  # refused before the store was opened


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--metrics-addr", "300.0.0.1", "'300.0.0.1' is not an IPv4 address"),
    ("--admin-addr", "::1::2", "'::1::2' is not an IPv6 address"),
    ("--admin-addr", "a b", "'a b' is not a host name or IP address"),
])
def test_serve_refuses_a_bad_metrics_or_admin_address(flag: str, value: str, says: str, tmp_path: Path) -> None:
    done = kvshelf_cli("serve", "--listen", "127.0.0.1:0", flag, value, "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert _one_error_line(done) == f"error: {flag}: {says}"


def test_the_environment_and_a_config_file_are_checked_too(tmp_path: Path) -> None:
    config = tmp_path / "kvshelf.toml"
    config.write_text('listen = "127.0.0.1:70000"\n')
    done = kvshelf_cli("serve", "--config", str(config), "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2
    assert "listen: port 70000 of '127.0.0.1:70000' is out of range [0, 65535]" in _one_error_line(done)


def test_serve_listens_on_an_ipv6_address_in_brackets(tmp_path: Path) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    server = ServeProcess("--listen", "[::1]:0", "--data-dir", str(tmp_path / "data"), "--no-data-path")
    try:
        assert server.address.startswith("[::1]:")
        done = kvshelf_cli("stats", "--server", server.address, "--json")
        assert done.returncode == 0, done.stderr
    finally:
        server.stop()


@pytest.mark.parametrize(("address", "ok"), [
    ("127.0.0.1:0", True), ("0.0.0.0:50051", True), ("[::]:0", True), ("localhost:65535", True),
    ("my-host.example.org:1", True), ("unix:/tmp/kvshelf.sock", True),
    ("127.0.0.1:65536", False), ("host", False), ("unix:", False), ("[1.2.3.4]:5", False),
    ("-host:5", False), ("127.0.0.1:5a", False), ("127.0.0.1:٥", False),
])
def test_listen_addresses(address: str, ok: bool) -> None:
    if ok:
        check_listen(address)
    else:
        with pytest.raises(ConfigError):
            check_listen(address)


def test_client_targets_need_a_port_from_1() -> None:
    assert parse_target("dns:///localhost:50051", "--server") == ("localhost", 50051)
    assert parse_target("ipv6:[::1]:5", "--server") == ("::1", 5)
    assert parse_target("unix:/run/kvshelf.sock", "--server") is None
    with pytest.raises(ConfigError, match=r"--server: port 0 of '127.0.0.1:0' is out of range \[1, 65535\]"):
        parse_target("127.0.0.1:0", "--server")
    assert check_host("[::1]", "--metrics-addr") == "::1"
    assert check_host("::1", "--metrics-addr") == "::1"


# -- stats, events, dashboard: why a server cannot be reached ------------------------------------------------------


@pytest.fixture
def free_port() -> int:
    """A loopback port nothing listens on (bound then closed: refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def unanswered_port() -> Iterator[int]:
    """A loopback port whose listener never accepts and whose accept queue is full: a new connection's SYN is
    dropped and the connection is never answered (a filtered port, as a firewall makes one)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filling: list[socket.socket] = []
    for _ in range(4):
        sock = socket.socket()
        sock.settimeout(0.5)
        try:
            sock.connect(("127.0.0.1", port))
            filling.append(sock)
        except OSError:
            sock.close()
            break
    else:
        pytest.skip("this kernel keeps answering connections to a full accept queue")
    yield port
    for sock in filling:
        sock.close()
    listener.close()


def _timed(*args: str):  # noqa: ANN202
    start = time.monotonic()
    done = kvshelf_cli(*args)
    return done, time.monotonic() - start


@pytest.mark.parametrize("command", [["stats"], ["events"], ["dashboard", "--port", "0"]])
def test_a_refused_connection_is_said_at_once(command: list[str], free_port: int) -> None:
    flag = "--target" if command[0] == "dashboard" else "--server"
    done, took = _timed(*command, flag, f"127.0.0.1:{free_port}", "--connect-timeout", WAIT_S)
    assert done.returncode == 2
    assert _one_error_line(done) == (f"error: kvshelf server at 127.0.0.1:{free_port} unreachable: connection "
                                     f"refused (nothing listens on port {free_port})")
    assert took < 50  # it did not wait out --connect-timeout


def test_an_unknown_host_is_said_at_once() -> None:
    done, took = _timed("stats", "--server", "no-such-host.invalid:50051", "--connect-timeout", WAIT_S)
    assert done.returncode == 2
    line = _one_error_line(done)
    assert line.startswith("error: kvshelf server at no-such-host.invalid:50051 unreachable: unknown host "
                           "'no-such-host.invalid' (")
    assert "no connection within" not in line
    assert took < 50


@pytest.mark.parametrize(("address", "says"), [
    ("127.0.0.1:99999", "--server: port 99999 of '127.0.0.1:99999' is out of range [1, 65535]"),
    ("127.0.0.1", "--server: '127.0.0.1' has no port; give HOST:PORT"),
    ("127.0.0.1:0", "--server: port 0 of '127.0.0.1:0' is out of range [1, 65535]"),
    ("::1:50051", "--server: '::1:50051': put an IPv6 address in brackets"),
])
def test_a_malformed_server_address_is_a_usage_error(address: str, says: str) -> None:
    done, took = _timed("stats", "--server", address, "--connect-timeout", WAIT_S)
    assert done.returncode == 2
    assert _one_error_line(done).startswith(f"error: {says}")
    assert took < 50


def test_a_connection_nobody_answers_times_out_and_says_so(unanswered_port: int) -> None:
    done = kvshelf_cli("stats", "--server", f"127.0.0.1:{unanswered_port}", "--connect-timeout", "1")
    assert done.returncode == 2
    assert _one_error_line(done) == (
        f"error: kvshelf server at 127.0.0.1:{unanswered_port} unreachable: timed out (no answer within 1 s: a "
        "firewall dropping packets, or a host that is down)")


def test_a_reachable_server_still_answers(tmp_path: Path) -> None:
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"))
    try:
        done = kvshelf_cli("stats", "--server", server.address, "--json")
        assert done.returncode == 0, done.stderr
    finally:
        server.stop()


def test_dashboard_refuses_a_bad_address_of_its_own(free_port: int) -> None:
    done = kvshelf_cli("dashboard", "--target", f"127.0.0.1:{free_port}", "--addr", "300.1.1.1", "--port", "0")
    assert done.returncode == 2
    assert _one_error_line(done) == "error: --addr: '300.1.1.1' is not an IPv4 address"


def test_demo_checks_its_remote_before_loading_a_model(free_port: int) -> None:
    bad = kvshelf_cli("demo", "--remote", "127.0.0.1")
    assert bad.returncode == 2
    assert _one_error_line(bad).startswith("error: --remote: '127.0.0.1' has no port")
    refused = kvshelf_cli("demo", "--remote", f"127.0.0.1:{free_port}")
    assert refused.returncode == 2
    assert _one_error_line(refused).endswith(f"connection refused (nothing listens on port {free_port})")
