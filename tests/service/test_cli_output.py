"""What the command line prints where the output is not a terminal (a pipe, as CI and scripts read it): tables and
help at full width (rich's own 80 columns cut cells to ``196… MiB`` and option names), ``kvshelf --version``, and
``stats --json`` led by the data asked for. Real subprocesses of the command line, a real ``kvshelf serve``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FINGERPRINT, REPO_ROOT, key_of, make_block
from service_helpers import ServeProcess

import kvshelf
from kvshelf.service import config as cfg
from kvshelf.service.client import RemoteStore

ELLIPSIS = "…"


def piped(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``kvshelf ARGS`` with its output through a pipe and no width named ($COLUMNS unset), as CI runs it."""
    clean = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-P", "-c", "from kvshelf.cli import main; main()", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=clean)


def test_version() -> None:
    done = piped("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvshelf {kvshelf.__version__}\n"
    assert re.fullmatch(r"kvshelf \d+\.\d+\.\d+\n", done.stdout)


def test_serve_help_through_a_pipe_shows_every_option_whole() -> None:
    done = piped("serve", "--help")
    assert done.returncode == 0, done.stderr
    assert ELLIPSIS not in done.stdout
    for spec in cfg.SETTINGS:
        assert re.search(rf"{re.escape(spec.flag)}\b", done.stdout), spec.flag


@pytest.mark.parametrize("command", ["precompute", "bench serve", "bench store", "bench abuse"])
def test_other_help_through_a_pipe_is_not_cut(command: str) -> None:
    """The commands whose help rich cut at 80 columns."""
    done = piped(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert ELLIPSIS not in done.stdout


def test_a_width_the_user_names_is_kept() -> None:
    """$COLUMNS still rules (a guard of the fix: the old code kept it too)."""
    done = piped("serve", "--help", env={"COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 100


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A dev-mode server holding 40 blocks of 4,096 tokens (40 MiB of values) in namespace
    tenant-a, read back once (hits in the counters)."""
    served = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path_factory.mktemp("out") / "data"),
                          "--memory", "1GiB")
    try:
        with RemoteStore(served.address, namespace="tenant-a", shared_memory=False) as store:
            blocks = [make_block([i * 5000 + j for j in range(4096)], namespace="tenant-a", layers=4)
                      for i in range(40)]
            keys = [key_of(b) for b in blocks]
            for key, block in zip(keys, blocks, strict=True):
                assert store.put_many([(key, block)]) == 1
            assert all(g is not None for g in store.get_many(keys[:4], fingerprint=FINGERPRINT))
        yield served
    finally:
        served.stop()


def test_stats_table_through_a_pipe_is_not_cut(server: ServeProcess) -> None:
    done = piped("stats", "--server", server.address)
    assert done.returncode == 0, done.stderr
    assert ELLIPSIS not in done.stdout, done.stdout
    assert re.search(r"\d+\.\d MiB", done.stdout), done.stdout
    assert "tenant-a" in done.stdout


def test_stats_json_leads_with_the_store_on_a_dev_mode_server(server: ServeProcess) -> None:
    done = piped("stats", "--server", server.address, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert list(data)[:3] == ["scope", "tiers", "lookup_hit_rate"]
    assert data["scope"] == "store" and "namespace" not in data and "store" not in data
    memory = next(t for t in data["tiers"] if t["name"] == "memory")
    assert memory["blocks"] == 40 and memory["hits"] >= 4
    assert data["health"]["status"] == "serving" and isinstance(data["history"], list)


def test_stats_json_of_one_namespace_leads_with_it(server: ServeProcess) -> None:
    done = piped("stats", "--server", server.address, "--namespace", "tenant-a", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert list(data)[:2] == ["scope", "namespace"] and list(data)[-1] == "store"
    assert data["scope"] == "namespace" and data["namespace"] == "tenant-a"
    assert next(t for t in data["tiers"] if t["name"] == "memory")["blocks"] == 40


def test_demo_tables_through_a_pipe_are_not_cut(tmp_path: Path) -> None:
    done = piped("demo", "--model", "smollm2-135m-shaped:2", "--documents", "1", "--tokens", "300",
                 "--data-dir", str(tmp_path / "demo"), env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert ELLIPSIS not in done.stdout, done.stdout
    for header in ("document", "speedup", "warm disk", "Time to first token"):
        assert header in done.stdout
