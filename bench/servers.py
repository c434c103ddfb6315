"""Start real local servers for benchmarks: a throwaway ``redis-server`` on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(maxmemory: str = "4gb") -> Iterator[str]:
    """A ``redis-server`` on 127.0.0.1 (no persistence); yields its ``redis://`` URL; killed on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("redis-server is not installed: run `make install` (it installs Redis from Debian)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvshelf-redis-") as workdir:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                        conn.sendall(b"PING\r\n")
                        if conn.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise ConfigError(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


@contextmanager
def kvshelf_server(data_dir: str, *extra: str) -> Iterator[str]:
    """A `kvshelf serve` subprocess on a free loopback port over ``data_dir``; yields ``host:port``."""
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", "from service.cli import main; main()", "serve", "--listen", "127.0.0.1:0",
         "--data-dir", data_dir, "--memory", "4GiB", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "kvshelf serving on" in line:
                address = line.split("kvshelf serving on ", 1)[1].split()[0]
                break
        else:
            raise ConfigError("kvshelf serve did not start")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
