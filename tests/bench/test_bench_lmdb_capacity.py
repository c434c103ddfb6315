"""``kvshelf bench lmdb-capacity`` (a short run with a small capacity: every invariant of the figure holds) and
``kvshelf serve --max-disk`` as the disk tier's capacity, seen by ``kvshelf stats`` (capacity and evictions)."""

from __future__ import annotations

import json

from helpers import FINGERPRINT, key_of, make_block
from service_helpers import ServeProcess, kvshelf_cli

from kvshelf.service.client import RemoteStore

MiB = 1 << 20


def test_bench_lmdb_capacity_short_run_holds_every_invariant(tmp_path):
    out = tmp_path / "lmdb-capacity.json"
    proc = kvshelf_cli("bench", "lmdb-capacity", "--duration", "4", "--capacity", "16MiB", "--min-block", "64KiB",
                       "--max-block", "512KiB", "--no-durable", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["ok"] is True
    assert result["capacity_bytes"] == 16 * MiB and result["bound_bytes"] == 16 * MiB + result["slack_bytes"]
    assert result["puts"] > 100 and result["evictions"] > 50, "the run did not get past the capacity"
    assert result["stored"] + result["not_stored"] == result["puts"]
    assert result["hits"] > 0 and result["hits"] + result["misses"] + result["wrong"] == result["gets"]
    assert result["errors"] == result["wrong"] == result["evicted_wrong"] == 0 and result["audit"] == []
    assert result["max_file_bytes"] <= result["bound_bytes"]
    assert result["held_bytes"] <= 16 * MiB
    for word in ("puts", "evictions", "max file size", "capacity + slack", "held"):
        assert word in proc.stdout


def test_bench_lmdb_capacity_bad_inputs_are_one_error_line():
    zero = kvshelf_cli("bench", "lmdb-capacity", "--duration", "1", "--capacity", "0")
    assert zero.returncode == 2 and "error:" in zero.stderr and "--capacity" in zero.stderr
    inverted = kvshelf_cli("bench", "lmdb-capacity", "--duration", "1", "--min-block", "2MiB", "--max-block", "1MiB")
    assert inverted.returncode == 2 and "--min-block <= --max-block" in inverted.stderr
    garbage = kvshelf_cli("bench", "lmdb-capacity", "--duration", "1", "--capacity", "lots")
    assert garbage.returncode == 2 and "--capacity: cannot read size 'lots'" in garbage.stderr


def test_serve_max_disk_is_the_capacity_and_stats_show_it_with_the_evictions(tmp_path):
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--memory", "0",
                          "--max-disk", "8MiB")
    try:
        store = RemoteStore(server.address, namespace="tenant-a")
        blocks = [make_block([1000 * i + j for j in range(16)], layers=8, heads=8, head_dim=128, namespace="tenant-a")
                  for i in range(24)]  # 1 MiB of payload each: 24 MiB through an 8 MiB disk tier
        for block in blocks:
            assert store.put_many([(key_of(block), block)]) == 1
        got = store.get_many([key_of(b) for b in blocks], fingerprint=FINGERPRINT)
        held = sum(g is not None for g in got)
        assert 0 < held <= 8 and got[-1] is not None  # the newest is held, most of the old ones were evicted

        as_json = kvshelf_cli("stats", "--server", server.address, "--namespace", "tenant-a", "--json")
        assert as_json.returncode == 0, as_json.stderr
        disk = next(t for t in json.loads(as_json.stdout)["tiers"] if t["name"] == "disk")
        assert disk["capacity_bytes"] == 8 * MiB and disk["bytes"] <= 8 * MiB
        assert disk["evictions"] == 24 - disk["blocks"] and disk["blocks"] == held
        table = kvshelf_cli("stats", "--server", server.address, "--namespace", "tenant-a")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("│ disk"))
        cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines[at : at + 2]]  # a narrow terminal wraps
        # columns: tier, codec, blocks, bytes, capacity, hits, misses, hit rate, evictions, corrupt, foreign
        assert " ".join(c[4] for c in cells).strip() == "8.0 MiB" and cells[0][8] == str(disk["evictions"])
    finally:
        server.stop()
    local = kvshelf_cli("stats", "--data-dir", str(tmp_path / "d"), "--json")  # the server stopped: its files
    assert local.returncode == 0, local.stderr
    disk = next(t for t in json.loads(local.stdout)["tiers"] if t["name"] == "disk")
    assert disk["capacity_bytes"] == 8 * MiB and disk["blocks"] == held
