"""Metrics endpoint, stats history, admin tables and the hit-rate/usage plot, on a real embedded store."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from helpers import FINGERPRINT, key_of, make_block
from rich.console import Console

from kvshelf.cli.views.admin import plot, render
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.errors import KVShelfError
from kvshelf.service.history import StatsHistory
from kvshelf.service.metrics import serve_metrics


@pytest.fixture
def busy_store(tmp_path):
    store = open_embedded_store(tmp_path, memory_bytes=8192)  # tiny memory (entries charged their overhead): evictions
    entries = []
    for i in range(6):
        block = make_block([100 * i + j for j in range(8)], namespace="tenant-a")
        entries.append((key_of(block), block))
    store.put_many(entries)
    keys = [k for k, _ in entries]
    store.lookup_prefix(keys + [b"\x00" * 16], namespace="tenant-a", model=FINGERPRINT)
    store.get_many(keys[:4] + [b"\x01" * 16], fingerprint=FINGERPRINT, namespace="tenant-a")
    yield store
    store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_endpoint_exports_store_counters(busy_store):
    port = _free_port()
    serve_metrics(busy_store, port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert f'kvshelf_lookup_blocks_total{{model="{FINGERPRINT}",namespace="tenant-a"}} 7.0' in body
    assert f'kvshelf_lookup_hit_blocks_total{{model="{FINGERPRINT}",namespace="tenant-a"}} 6.0' in body
    assert f'kvshelf_retrieve_hit_blocks_total{{model="{FINGERPRINT}",namespace="tenant-a"}} 4.0' in body
    evictions = busy_store.stats()["tiers"][0]["evictions"]
    assert evictions > 0
    assert f'kvshelf_tier_evictions_total{{model="{FINGERPRINT}",namespace="tenant-a",tier="memory"}} ' \
           f"{float(evictions)}" in body
    disk_bytes = busy_store.stats()["tiers"][1]["bytes"]
    assert f'kvshelf_tier_bytes{{tier="disk"}} {float(disk_bytes)}' in body
    assert 'kvshelf_tier_available{tier="memory"} 1.0' in body


def test_history_render_and_plot(busy_store, tmp_path):
    history = StatsHistory(busy_store, interval_s=3600)
    history.record()
    busy_store.get_many([key_of(make_block([0, 1, 2, 3, 4, 5, 6, 7], namespace="tenant-a"))],
                        fingerprint=FINGERPRINT, namespace="tenant-a")
    history.record()
    points = history.points()
    assert points[1]["retrieve_blocks"] == points[0]["retrieve_blocks"] + 1
    assert points[1]["tiers"]["disk"]["blocks"] == 6

    console = Console(record=True, width=160)
    console.print(render(busy_store.stats(), title="test"))
    text = console.export_text()
    assert "tenant-a" in text and "85.7%" in text and "83.3%" in text  # lookups 6 of 7, retrievals 5 of 6
    out = plot(points, tmp_path / "stats.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(KVShelfError, match="2 history points"):
        plot(points[:1], tmp_path / "x.png")
