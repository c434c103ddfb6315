"""The operator's view of a running server: `kvshelf stats` (table, JSON, plot), Prometheus metrics, and two
servers sharing one real Redis (standalone and Cluster)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from helpers import FINGERPRINT, key_of, make_block
from redis_servers import free_port, redis_cluster, redis_server  # noqa: F401  (fixtures)
from service_helpers import ServeProcess, kvshelf_cli

from kvshelf.service.client import RemoteStore


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_two_servers_sharing_one_redis_see_each_others_blocks(kind, request, tmp_path):
    url = request.getfixturevalue("redis_server" if kind == "standalone" else "redis_cluster").url
    servers = [ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / f"d{i}"), "--redis", url)
               for i in range(2)]
    try:
        first, second = (RemoteStore(s.address, namespace=f"shared-{kind}") for s in servers)
        blocks = [make_block([7000 + 10 * i + j for j in range(16)], namespace=f"shared-{kind}") for i in range(3)]
        keys = [key_of(b) for b in blocks]
        first.put_many(list(zip(keys, blocks, strict=True)))
        assert second.lookup_prefix(keys) == 3  # server 2's own tiers are empty: Redis answers
        got = second.get_many(keys, fingerprint=FINGERPRINT)
        assert all(g is not None and g.token_ids == b.token_ids and (g.keys == b.keys).all()
                   for g, b in zip(got, blocks, strict=True))
        other_tenant = RemoteStore(servers[1].address, namespace="someone-else")
        assert other_tenant.lookup_prefix(keys) == 0
    finally:
        for s in servers:
            s.stop()


def test_stats_tool_metrics_and_plot(tmp_path):
    metrics_port = free_port()
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--memory", "64MiB",
                          "--metrics-port", str(metrics_port), "--history-interval", "0.2")
    try:
        store = RemoteStore(server.address, namespace="tenant-a")
        blocks = [make_block([100 * i + j for j in range(8)], namespace="tenant-a") for i in range(4)]
        keys = [key_of(b) for b in blocks]
        store.put_many(list(zip(keys[:3], blocks[:3], strict=True)))
        assert store.lookup_prefix(keys, model=FINGERPRINT, tokens=[8, 8, 8, 8]) == 3
        got = store.get_many(keys, fingerprint=FINGERPRINT, tokens=[8, 8, 8, 8])
        assert [g is not None for g in got] == [True, True, True, False]
        time.sleep(1.0)  # a few history samples

        as_json = kvshelf_cli("stats", "--server", server.address, "--namespace", "tenant-a", "--json")
        assert as_json.returncode == 0, as_json.stderr
        data = json.loads(as_json.stdout)
        assert data["lookup_hit_rate"] == pytest.approx(0.75) and data["retrieve_hit_rate"] == pytest.approx(0.75)
        assert data["health"]["status"] == "serving"
        assert len(data["history"]) >= 3 and data["history"][-1]["retrieve_blocks"] == 4

        table = kvshelf_cli("stats", "--server", server.address)
        assert table.returncode == 0, table.stderr
        assert "tenant-a" in table.stdout and "75.0%" in table.stdout  # hit rate in blocks and in tokens

        png = tmp_path / "stats.png"
        plotted = kvshelf_cli("stats", "--server", server.address, "--plot", str(png))
        assert plotted.returncode == 0, plotted.stderr
        assert png.read_bytes()[:4] == b"\x89PNG"

        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'kvshelf_request_seconds_count{method="LookupPrefix"} 1.0' in body
        assert f'kvshelf_lookup_hit_tokens_total{{model="{FINGERPRINT}",namespace="tenant-a"}} 24.0' in body
        assert 'kvshelf_tier_blocks{tier="disk"} 3.0' in body
    finally:
        server.stop()


def test_stats_tool_bad_inputs(tmp_path):
    neither = kvshelf_cli("stats")
    assert neither.returncode == 2 and "exactly one of --server" in neither.stderr
    missing = kvshelf_cli("stats", "--data-dir", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no kvshelf store" in missing.stderr
    unreachable = kvshelf_cli("stats", "--server", f"127.0.0.1:{free_port()}")
    assert unreachable.returncode == 2 and "error:" in unreachable.stderr
    assert len(unreachable.stderr.strip().splitlines()) == 1  # one readable line, no traceback
