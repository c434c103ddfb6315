"""The command line loads only what a command needs. ``kvshelf --help`` and the help of the light commands load
neither torch nor transformers (nor grpc, nor the store): the command line imports them inside the commands that use
them (``kvshelf/cli/__init__.py``). ``kvshelf stats`` and ``kvshelf events`` run against a real ``kvshelf serve``
(and fail to reach one) without torch or transformers: the client's admin and event calls move no blocks
(``service/client.py``) and ``kvshelf.kvstore`` loads its names on first use. Each case runs in a fresh interpreter,
the only place where ``sys.modules`` tells what a command imported."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "grpc", "kvshelf.kvstore", "kvshelf.service", "kvshelf.adapters", "kvshelf.bench")
#: light modules of those packages: the settings of ``kvshelf serve`` (standard library only), which its --help shows
LIGHT = ("kvshelf.service", "kvshelf.service.config")
#: what the commands that talk to a server must never load
MODEL_STACK = ("torch", "transformers")
MARK = "heavy modules loaded: "
WAIT_S = 60.0

PROBE = f"""
import json, sys
from kvshelf.cli import main
sys.argv = ["kvshelf", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
except KeyboardInterrupt:
    code = "KeyboardInterrupt"
else:
    code = 0
print("{MARK}" + json.dumps([code, sorted({{m for m in {HEAVY!r} for n in list(sys.modules)
                                    if (n == m or n.startswith(m + ".")) and n not in {LIGHT!r}}})]), flush=True)
"""


class Probe(NamedTuple):
    code: object  # the exit code main() gave
    loaded: list[str]  # the HEAVY modules it loaded
    stdout: str  # without the probe's own last line
    stderr: str


def probe_command(*args: str) -> list[str]:
    return [sys.executable, "-P", "-c", PROBE, *args]


def probe_result(returncode: int, stdout: str, stderr: str) -> Probe:
    assert returncode == 0, stderr
    lines = stdout.rstrip("\n").splitlines()
    assert lines and lines[-1].startswith(MARK), stdout + stderr
    code, loaded = json.loads(lines[-1].removeprefix(MARK))
    return Probe(code, loaded, "".join(f"{line}\n" for line in lines[:-1]), stderr)


def run_probe(*args: str) -> Probe:
    """``kvshelf ARGS`` through ``main()`` in a fresh interpreter: exit code, heavy modules it loaded, output."""
    done = subprocess.run(probe_command(*args), cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="120"))
    return probe_result(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize("args", [["--help"], ["stats", "--help"], ["events", "--help"], ["dashboard", "--help"],
                                  ["bench", "--help"],
                                  ["serve", "--help"], ["bench", "ttft", "--help"], []],
                         ids=lambda args: " ".join(args) or "no arguments")
def test_help_loads_nothing_heavy(args: list[str]) -> None:
    code, loaded, output, _ = run_probe(*args)
    assert code in (0, 2) and "Usage:" in output  # no arguments: the help, exit code 2 (click's)
    assert loaded == [], f"kvshelf {' '.join(args)} imported {loaded}"


def commands(output: str) -> list[str]:
    """The command names of a help page's Commands panel, in order."""
    panel = output[output.index("Commands"):]
    return re.findall(r"^│ (\S+) ", panel, flags=re.MULTILINE)


def test_every_command_is_listed_in_order() -> None:
    """The list in ``kvshelf/cli/__init__.py`` makes every command, in its order."""
    assert commands(run_probe("--help").stdout) == [
        "demo", "serve", "repair", "replay", "precompute", "prepare-model", "stats", "events", "dashboard", "explain",
        "bench"]
    assert commands(run_probe("bench", "--help").stdout) == [
        "replay", "eviction-bounds", "ttft", "rag", "rag-chain", "serve", "pruning", "longctx", "codecs", "mla", "gpu",
        "vllm", "lmdb", "lmdb-capacity", "store", "clear", "kv-events", "dashboard", "chaos", "abuse"]


def test_python_m_runs_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "kvshelf.cli", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "prepare-model" in done.stdout, done.stderr


# -- the commands that talk to a server, run ------------------------------------------------------------------


def assert_no_model_stack(probe: Probe, what: str) -> None:
    assert "grpc" in probe.loaded, f"{what} did not get as far as the client: {probe}"
    assert not set(MODEL_STACK) & set(probe.loaded), f"{what} imported {probe.loaded}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The address of a real ``kvshelf serve`` (subprocess, dev mode) on a free loopback port."""
    from service_helpers import ServeProcess

    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path_factory.mktemp("served") / "data"))
    try:
        yield server.address
    finally:
        server.stop()


def test_stats_of_a_server_loads_no_torch(served: str) -> None:
    probe = run_probe("stats", "--server", served)
    assert probe.code == 0, probe.stderr
    assert f"kvshelf {served}" in probe.stdout and "hit rates" in probe.stdout  # the admin view
    assert_no_model_stack(probe, "kvshelf stats")


def test_stats_json_of_a_server_loads_no_torch(served: str) -> None:
    probe = run_probe("stats", "--server", served, "--json")
    assert probe.code == 0, probe.stderr
    data = json.loads(probe.stdout)
    assert {"tiers", "health"} <= set(data.get("store", data)) | set(data), data.keys()
    assert_no_model_stack(probe, "kvshelf stats --json")


def _put_one(address: str) -> bytes:
    """A block put into the server from this process (which may load torch): its key."""
    from helpers import key_of, make_block

    from kvshelf.service.client import RemoteStore

    block = make_block([11, 12, 13])
    with RemoteStore(address, shared_memory=False) as remote:
        assert remote.put_many([(key_of(block), block)]) == 1
    return key_of(block)


def test_events_of_a_server_load_no_torch_and_ctrl_c_exits_0(served: str) -> None:
    proc = subprocess.Popen(probe_command("events", "--server", served, "--json"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def line() -> dict:
        try:
            return json.loads(lines.get(timeout=WAIT_S))
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"no line from kvshelf events; stderr: {proc.communicate()[1]}") from None

    try:
        assert line()["type"] == "started"
        key = _put_one(served)
        event = line()
        assert event["type"] == "BlockStored" and event["block_hashes"] == [key.hex()], event
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the command's way out
        assert proc.wait(timeout=WAIT_S) == 0
        reader.join(WAIT_S)  # the rest of its output, the probe's line last
        rest = [lines.get_nowait() for _ in range(lines.qsize())]
        probe = probe_result(0, "".join(rest), proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert probe.code == 0, probe.stderr
    assert_no_model_stack(probe, "kvshelf events")


def test_dashboard_of_a_server_loads_no_torch_and_ctrl_c_exits_0(served: str) -> None:
    """``kvshelf dashboard --target``: the page and its data over HTTP from a real server's Stats, then Ctrl-C."""
    import urllib.request

    proc = subprocess.Popen(probe_command("dashboard", "--target", served, "--port", "0"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+/) \(no token: loopback only\)", first)
        assert match, first + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        with urllib.request.urlopen(match.group(1), timeout=WAIT_S) as page:
            assert b"kvshelf admin" in page.read()
        key = _put_one(served)
        from kvshelf.service.client import RemoteStore

        with RemoteStore(served, shared_memory=False) as remote:
            assert remote.lookup_prefix([key]) == 1
        with urllib.request.urlopen(match.group(1) + "api/data", timeout=WAIT_S) as response:
            data = json.loads(response.read())
        assert data["scope"] == "every namespace" and data["title"] == served
        assert key.hex() in [p["key"] for p in data["top_prefixes"]]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
        probe = probe_result(proc.returncode, first + out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert probe.code == 0, probe.stderr
    assert_no_model_stack(probe, "kvshelf dashboard")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command", ["stats", "events", "dashboard"])
def test_no_server_is_one_error_line_and_no_torch(command: str) -> None:
    flag = "--target" if command == "dashboard" else "--server"
    probe = run_probe(command, flag, f"127.0.0.1:{_free_port()}", "--connect-timeout", "1")
    assert probe.code == 2
    err = probe.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "unreachable" in err[0], probe.stderr
    assert_no_model_stack(probe, f"kvshelf {command} (no server)")


@pytest.mark.parametrize("args", [["--memory", "1.5"], ["--max-inflight", "0"], ["--listen", "[::1"]])
def test_serve_refuses_bad_settings_before_loading_the_store(tmp_path: Path, args: list[str]) -> None:
    """A bad setting is answered in well under a second: the settings are checked before the store (and torch)
    load."""
    probe = run_probe("serve", "--data-dir", str(tmp_path / "data"), *args)
    assert probe.code == 2, probe.stderr
    err = probe.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and args[0] in err[0], probe.stderr
    assert not set(probe.loaded) & {"torch", "transformers", "grpc"}, probe.loaded
    assert not (tmp_path / "data").exists()
