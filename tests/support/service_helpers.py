"""Helpers of the gRPC service tests: servers on free ports, a subprocess `kvshelf serve`, a self-signed
certificate, and the one stand-in of the suite (a tier whose backing service is unreachable)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
from helpers import REPO_ROOT

from kvshelf.kvstore.errors import TierUnavailableError
from kvshelf.kvstore.tier import Tier, TierUsage
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.server import SERVICE_NAME

TOKENS = {"token-of-tenant-a": "tenant-a", "token-of-tenant-b": "tenant-b"}


class UnreachableTier(Tier):
    """A STAND-IN (the only mock in these tests) for a shared tier whose server is down at start, such as
    Redis: every data call raises ``TierUnavailableError`` as the real tier does when it cannot connect.
    The real Redis case is tested with a real redis-server in the Redis tier's tests."""

    def __init__(self, name: str = "shared") -> None:
        self.name = name

    def _down(self) -> TierUnavailableError:
        return TierUnavailableError(f"tier {self.name}: connection refused")

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        raise self._down()

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        raise self._down()

    def prefix_run_length(self, keys: Sequence[bytes]) -> int:
        raise self._down()

    def delete(self, keys: Iterable[bytes]) -> int:
        raise self._down()

    def usage(self) -> TierUsage:
        raise self._down()

    def keys(self) -> list[bytes]:
        raise self._down()


def kvshelf_cli(*args: str) -> subprocess.CompletedProcess:
    """``kvshelf ARGS`` in a subprocess (this checkout's code), its output captured."""
    return subprocess.run([sys.executable, "-P", "-c", "from kvshelf.cli import main; main()", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def write_tokens(path: Path, tokens: dict[str, str] = TOKENS) -> Path:
    path.write_text("[tokens]\n" + "".join(f'"{t}" = "{ns}"\n' for t, ns in tokens.items()))
    return path


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost / 127.0.0.1 (``openssl`` CLI): ``(cert.pem, key.pem)``."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


class ServeProcess:
    """A real ``kvshelf serve`` subprocess on a free port (``listen 127.0.0.1:0``; the port is read from its
    first line of output)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", "from kvshelf.cli import main; main()", "serve", *args],
            cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:  # warnings (an unreachable tier...) may come first
            seen.append(line)
            if "kvshelf serving on" in line:
                break
        else:
            self.proc.wait(timeout=30)
            raise AssertionError(f"kvshelf serve did not start: {''.join(seen)}")
        self.first_line = seen[-1]
        self.output_before_start = "".join(seen[:-1])
        self.address = self.first_line.split("kvshelf serving on ", 1)[1].split()[0]

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def put_with_lineage(port: int, namespace: str, entries: list, lineage: list) -> int:
    """PutBlocks on 127.0.0.1:``port`` whose first chunks carry ``(parent_key, token_ids)`` per block (what any client
    may send for the blocks' KV events), on a raw channel; returns how many were stored."""
    import grpc

    from kvshelf.kvstore import encode_block
    from kvshelf.proto import kvshelf_pb2 as pb
    from kvshelf.service.client import put_requests
    from kvshelf.service.server import SERVICE_NAME

    items = [(key, encode_block(block, key)) for key, block in entries]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_unary(f"/{SERVICE_NAME}/PutBlocks", request_serializer=None,
                                    response_deserializer=pb.PutBlocksResponse.FromString)
        return call(put_requests(items, namespace, lineage=lineage), timeout=60).stored


def data_path_call(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """The raw ``OpenDataPath`` call of ``channel`` (a ticket message, then the transfer's result)."""
    return channel.unary_stream(f"/{SERVICE_NAME}/OpenDataPath",
                                request_serializer=pb.DataPathRequest.SerializeToString,
                                response_deserializer=pb.DataPathResponse.FromString)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class InProcessServe:
    """``serve(config)`` in a thread: ``grpc`` address, ``metrics_port``, the start-up ``line``."""

    def __init__(self, config: Any, capsys: Any) -> None:
        self.ready, self.stop = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(config,), daemon=True)
        self.thread.start()
        assert self.ready.wait(60), self.errors
        out = capsys.readouterr().out
        (self.line,) = [line for line in out.splitlines() if "kvshelf serving on" in line]
        self.grpc = self.line.split("kvshelf serving on ", 1)[1].split()[0]
        self.metrics_port = config.metrics.port

    def _run(self, config: Any) -> None:
        try:
            from kvshelf.service.serve import serve

            serve(config, ready=self.ready, stop=self.stop)
        except BaseException as exc:  # noqa: BLE001 (shown by the failing ready.wait)
            self.errors.append(exc)
            self.ready.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
