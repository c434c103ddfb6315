"""``kvshelf bench mla``: an MLA block (the latent transformers caches) against the expanded K/V it stands for."""

from __future__ import annotations

import json

import torch
from service_helpers import kvshelf_cli

from kvshelf.adapters.shaped import shaped_config
from kvshelf.bench.mla import expanded_bytes, latent_block


def test_latent_block_has_the_cached_shapes():
    config = shaped_config("deepseek-v3-shaped:2")
    block = latent_block(config, 8, torch.float32)
    assert block.keys.shape == (2, 1, 8, 512) and block.values.shape == (2, 1, 8, 64)
    assert expanded_bytes(config, 8, 4) == 2 * 128 * 8 * (128 + 64 + 128) * 4


def test_bench_mla_writes_its_table(tmp_path):
    path = tmp_path / "mla.json"
    result = kvshelf_cli("bench", "mla", "--tokens", "32", "--codecs", "raw,int8", "--json", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["codec"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["raw"]["max_abs_error"] == 0 and rows["raw"]["ratio_vs_expanded"] >= 60
    assert rows["int8"]["bytes"] < rows["raw"]["bytes"]
    anchor = rows["expanded K/V (raw)"]  # the materialized K/V, stored raw: the bytes the ratio is against
    assert anchor["ratio_vs_expanded"] <= 1.0 and anchor["bytes"] > 60 * rows["raw"]["bytes"]
    # prefix reuse through each codec on the tiny DeepSeek-V3: raw exact, int8 within 1e-3 of plain generate
    assert rows["raw"]["same_tokens"] and rows["raw"]["reused_tokens"] == 128
    assert rows["raw"]["max_logit_diff"] <= 1e-4 and rows["int8"]["max_logit_diff"] <= 1e-3


def test_bench_mla_refuses_unknown_shapes_and_shapes_without_a_latent():
    for shape, message in (("nope-shaped", "unknown shaped model"), ("llama3-8b-shaped", "no multi-head latent")):
        result = kvshelf_cli("bench", "mla", "--shape", shape)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
