"""`kvshelf serve` over a damaged disk tier (real LMDB files damaged on disk): one ``error:`` line at start
naming the path and the recovery, ``--reset-disk`` moving the damaged environment aside and serving, and a
running server whose disk tier is damaged under it: never INTERNAL, health degraded, the memory tier serving."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import REPO_ROOT, assert_same_block, key_of, make_block
from lmdb_damage import MiB, damage, fill
from service_helpers import ServeProcess, kvshelf_cli

from kvshelf.kvstore import LMDBTier, MemoryTier, TieredStore
from kvshelf.service.client import RemoteStore
from kvshelf.service.server import TIERS_HEALTH_NAME, start_server

FINGERPRINT = make_block(4).fingerprint


def _serve_once(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", "from kvshelf.cli import main; main()", "serve",
                           "--listen", "127.0.0.1:0", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("how", ["truncated", "garbage_branch_header", "leaf_header"])
def test_serve_on_a_damaged_data_dir_prints_one_error_line(tmp_path, how):
    data = tmp_path / "data"
    fill(data / "lmdb", 300)
    damage(data / "lmdb", how)
    proc = _serve_once("--data-dir", str(data))
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and "kvshelf serving" not in proc.stdout
    assert str(data / "lmdb") in lines[0] and "is damaged" in lines[0]
    assert f"kvshelf repair --data-dir {data}" in lines[0] and "kvshelf serve --reset-disk" in lines[0]
    assert sorted(p.name for p in data.iterdir()) == ["lmdb"]  # nothing moved without --reset-disk


def test_reset_disk_moves_the_damaged_environment_aside_and_serves(tmp_path):
    data = tmp_path / "data"
    fill(data / "lmdb", 300)
    damage(data / "lmdb", "truncated")
    damaged_bytes = (data / "lmdb" / "data.mdb").read_bytes()
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(data), "--reset-disk")
    try:
        warnings = [line for line in server.output_before_start.splitlines() if "--reset-disk" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0] and "lmdb.damaged-" in warnings[0]
        aside = [p for p in data.iterdir() if p.name.startswith("lmdb.damaged-")]
        assert len(aside) == 1 and (aside[0] / "data.mdb").read_bytes() == damaged_bytes  # kept as it was
        block = make_block(list(range(16)), namespace="default")
        with RemoteStore(server.address, namespace="default") as remote:
            assert remote.put_many([(key_of(block), block)]) == 1
            assert_same_block(remote.get_many([key_of(block)], fingerprint=block.fingerprint)[0], block)
            stats = remote.stats()
            assert stats["health"]["status"] == "serving" and stats["health"]["damaged_tiers"] == []
    finally:
        server.stop()


def test_running_server_over_a_disk_damaged_under_it(tmp_path):
    path = tmp_path / "data" / "lmdb"
    fill(path, 300)  # namespace "ns": the server's tier keys carry a scope tag, these are never hit
    disk = LMDBTier(path, initial_map_bytes=MiB)
    store = TieredStore([MemoryTier(8 * MiB), disk])
    running = start_server(store, "127.0.0.1:0")
    try:
        blocks = [make_block(list(range(i * 16, i * 16 + 16)), namespace="default", seed=i) for i in range(8)]
        keys = [key_of(b) for b in blocks]
        with RemoteStore(f"127.0.0.1:{running.port}", namespace="default") as remote:
            assert remote.put_many(list(zip(keys, blocks, strict=True))) == 8
            damage(path, "garbage_branch_header")
            missing = make_block(list(range(50_000, 50_016)), namespace="default")
            # misses in memory go to the damaged disk: a miss, not INTERNAL
            got = remote.get_many([*keys, key_of(missing)], fingerprint=FINGERPRINT)
            for block, expected in zip(got[:8], blocks, strict=True):
                assert_same_block(block, expected)
            assert got[8] is None
            assert remote.lookup_prefix([key_of(missing)]) == 0
            # writes go on (to memory), deletes too
            assert remote.put_many([(key_of(missing), missing)]) == 1
            assert_same_block(remote.get_many([key_of(missing)], fingerprint=FINGERPRINT)[0], missing)
            stats = remote.stats()
            assert stats["health"] == {"status": "degraded", "unavailable_tiers": ["disk"], "damaged_tiers": ["disk"]}
            disk_stats = next(t for t in stats["tiers"] if t["name"] == "disk")
            assert disk_stats["available"] is False
            assert disk.damaged
            assert store.stats()["tiers"][1]["unavailable"] >= 1
        channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(service=TIERS_HEALTH_NAME)).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        assert check(health_pb2.HealthCheckRequest(service="kvshelf.v1.KVShelf")).status == \
            health_pb2.HealthCheckResponse.SERVING
        channel.close()
    finally:
        running.stop(0)
        store.close()


def test_stats_of_a_damaged_data_dir_is_one_error_line(tmp_path):
    data = tmp_path / "data"
    fill(data / "lmdb", 300)
    damage(data / "lmdb", "truncated")
    proc = kvshelf_cli("stats", "--data-dir", str(data))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "kvshelf repair" in lines[0], proc.stderr
