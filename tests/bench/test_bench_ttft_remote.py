"""`kvshelf bench ttft --remote --redis --codec int8` at its smallest: SmolLM2, one 256-token context, one round of
fresh worker processes against a local LMDB (warm-disk), a real `kvshelf serve` (data path) and a real redis-server."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvshelf.bench.ttft import run

pytestmark = pytest.mark.slow


def test_remote_and_redis_rows_carry_codec_speedup_and_vs_raw(tmp_path, corpus_path):
    out = tmp_path / "ttft_remote.json"
    payload = run(json_path=str(out), corpus=corpus_path, lengths=(256,), runs=1, rounds=1,
                  new_tokens=4, console=Console(quiet=True), remote=True, redis=True, codecs=[("int8", {})])
    written = json.loads(out.read_text())
    assert written["results"] == payload["results"]
    rows = {(r["mode"], r["codec"]): r for r in written["results"]}
    assert set(rows) == {("full", "raw"), ("warm-memory", "raw"), ("warm-disk", "raw"), ("warm-disk", "int8"),
                         ("warm-remote", "raw"), ("warm-remote", "int8"), ("warm-redis", "raw"), ("warm-redis", "int8")}
    for mode in ("warm-disk", "warm-remote", "warm-redis"):  # warm-disk: the anchor of the other two, same rounds
        raw, int8 = rows[(mode, "raw")], rows[(mode, "int8")]
        for r in (raw, int8):
            assert r["reused_tokens"] == 256 and r["ttft_s"] > 0 and r["speedup"] > 0, r
            assert r["vs_raw"] == pytest.approx(raw["ttft_s"] / r["ttft_s"], rel=0.01), r
            assert r["fetch_s"] > 0 and r["load_s"] > 0, r
            disk = rows[("warm-disk", r["codec"])]
            assert r["vs_warm_disk"] == pytest.approx(r["ttft_s"] / disk["ttft_s"], rel=0.01), r
        assert raw["vs_raw"] == 1.0 and raw["same_output"] and not raw["lossy"] and raw["dppl_rel"] == 0.0
        assert int8["lossy"] and int8["dppl_rel"] is not None and int8["dppl_rel"] < 0.01  # bench/results/codecs.json
        # int8 moves about a quarter of raw's float32 bytes (8.3 bits per value against 32)
        assert 0.2 < int8["bytes"] / raw["bytes"] < 0.3, (int8["bytes"], raw["bytes"])
        assert int8["same_output"]  # int8 keeps SmolLM2's 4 greedy tokens here
