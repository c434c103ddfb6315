"""``kvshelf bench mla``: the bytes of a multi-head latent attention (MLA) block, as kvshelf stores it, against the
keys and values it stands for.

DeepSeek-V2/V3, MiniCPM3 and Kimi (DeepSeek-V2, "Multi-head Latent Attention", 2024) compute each token's keys and
values from a latent: ``kv_lora_rank`` values (normalized) expanded per head by ``kv_b_proj`` into the keys' no-RoPE
part (``qk_nope_head_dim``) and the values (``v_head_dim``), plus one RoPE key of ``qk_rope_head_dim`` shared by
every head. transformers 5.x caches the latent and the RoPE key, not the expanded keys and values (attention expands
them at every forward), so a kvshelf block of such a model holds ``kv_lora_rank + qk_rope_head_dim`` values per
token and layer: ``[layers, 1, tokens, kv_lora_rank]`` as its keys and ``[layers, 1, tokens, qk_rope_head_dim]`` as
its values. Against the expanded keys and values (``heads x (qk_nope + qk_rope + v)`` per token and layer, what a
cache of materialized K/V would hold) that is the shape's bound, reached by the ``raw`` codec with nothing to
rematerialize: loading it is decoding it.

For a block of ``tokens`` tokens of the shape's layers (random latent values, seeded), every codec listed: encoded
bytes (whole blocks: header, token ids and checksum included), the ratio to the expanded K/V in the same dtype,
encode and decode (load) times (median of ``runs``), and the largest absolute error of the decoded latent. The
anchor row ``expanded K/V (raw)`` is the same block with its keys and values materialized per head
(``[layers, heads, tokens, qk_nope + qk_rope]`` and ``[layers, heads, tokens, v]``), stored raw: what a cache of
materialized K/V stores and loads.

Then each codec serves prefix reuse on a tiny DeepSeek-V3 model in fp32 (``adapters.model.tiny_deepseek_v3``:
2 layers, 8 heads, latent 64 + 16): a 128-token context stored through a memory tier in that codec, reused with
another question; its greedy tokens and the largest logit difference against plain ``model.generate``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvshelf.bench.common import machine_description, median, save_results
from kvshelf.kvstore import KVBlock, decode_block, encode_block
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import chunk_key

DEFAULT_CODECS = ("raw", "fp16", "bf16", "zstd", "int8")


def expanded_bytes(config: Any, tokens: int, itemsize: int) -> int:
    """Bytes of the expanded keys and values of ``tokens`` tokens: ``layers x heads x tokens x (qk_nope + qk_rope +
    v) x itemsize``."""
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return config.num_hidden_layers * config.num_attention_heads * tokens * per_head * itemsize


def latent_block(config: Any, tokens: int, dtype: torch.dtype, seed: int = 0) -> KVBlock:
    """A block of the latent as transformers caches it: keys ``[layers, 1, tokens, kv_lora_rank]`` (normalized
    latent), values ``[layers, 1, tokens, qk_rope_head_dim]`` (the shared RoPE key)."""
    generator = torch.Generator().manual_seed(seed)
    layers = config.num_hidden_layers
    keys = torch.randn(layers, 1, tokens, config.kv_lora_rank, generator=generator).to(dtype)
    values = torch.randn(layers, 1, tokens, config.qk_rope_head_dim, generator=generator).to(dtype)
    ids = tuple(range(tokens))
    return KVBlock(keys, values, ids, 0, "bench-mla")


def expanded_block(config: Any, tokens: int, dtype: torch.dtype, seed: int = 1) -> KVBlock:
    """The expanded keys ``[layers, heads, tokens, qk_nope + qk_rope]`` and values ``[layers, heads, tokens, v]`` of
    ``tokens`` tokens (random, seeded): the anchor a cache of materialized K/V holds."""
    generator = torch.Generator().manual_seed(seed)
    shape = (config.num_hidden_layers, config.num_attention_heads, tokens)
    keys = torch.randn(*shape, config.qk_nope_head_dim + config.qk_rope_head_dim, generator=generator).to(dtype)
    values = torch.randn(*shape, config.v_head_dim, generator=generator).to(dtype)
    return KVBlock(keys, values, tuple(range(tokens)), 0, "bench-mla-expanded")


def exactness(codecs: tuple[str, ...], *, context: int = 128, new_tokens: int = 4) -> list[dict[str, Any]]:
    """Per codec: prefix reuse of a ``context``-token prompt stored in that codec on the tiny DeepSeek-V3 (fp32),
    against plain ``generate``: reused tokens, same greedy tokens, largest logit difference."""
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import tiny_deepseek_v3
    from kvshelf.kvstore import MemoryTier, TieredStore, TierSpec

    model = tiny_deepseek_v3()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (context + 16,), generator=generator).tolist()
    first, second = ids[:context + 8], ids[:context] + ids[context + 8:]
    prompt = torch.tensor([second])
    with torch.inference_mode():
        plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True)
    rows = []
    for codec in codecs:
        store = TieredStore([TierSpec(MemoryTier(256 << 20), codec=codec)])
        gen = CachedGenerator(model, store=store, block_size=16, write_behind=False)
        gen.generate(first, max_new_tokens=1, eos_token_id=None, pad_token_id=0)
        result = gen.generate(second, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                              output_logits=True)
        diff = max(float((a - b).abs().max()) for a, b in zip(result.logits, plain.logits, strict=True))
        rows.append({"codec": codec, "reused_tokens": result.reused_tokens,
                     "same_tokens": result.new_ids == plain.sequences[0, len(second):].tolist(),
                     "max_logit_diff": diff})
    return rows


def _anchor_row(config: Any, tokens: int, torch_dtype: torch.dtype, dtype: str, expanded: int,
                runs: int) -> dict[str, Any]:
    """The ``expanded K/V (raw)`` row: the materialized keys and values stored raw, encoded and loaded."""
    anchor = expanded_block(config, tokens, torch_dtype)
    key = chunk_key(anchor.fingerprint, anchor.namespace, anchor.token_ids)
    encode_s, encoded = _timed(lambda: encode_block(anchor, key, "raw"), runs)
    decode_s, _ = _timed(lambda: decode_block(encoded, expected_key=key), runs)
    return {"codec": "expanded K/V (raw)", "dtype": dtype, "tokens": tokens, "layers": config.num_hidden_layers,
            "bytes": len(encoded), "expanded_kv_bytes": expanded,
            "ratio_vs_expanded": round(expanded / len(encoded), 2),
            "encode_ms": round(encode_s * 1e3, 3), "decode_ms": round(decode_s * 1e3, 3), "max_abs_error": 0.0}


def _timed(fn: Any, runs: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return median(times), result


def run(*, json_path: str | None, shape: str = "deepseek-v3-shaped", tokens: int = 256,
        codecs: tuple[str, ...] = DEFAULT_CODECS, dtype: str = "bfloat16", runs: int = 3,
        console: Console | None = None) -> dict[str, Any]:
    """Measure every codec on one block of ``shape``; print the table; write ``{"results": [...]}``."""
    from kvshelf.adapters.model import resolve_dtype
    from kvshelf.adapters.shaped import shaped_config

    console = console or Console()
    config = shaped_config(shape)
    if getattr(config, "kv_lora_rank", None) is None:
        raise ConfigError(f"{shape!r} has no multi-head latent attention (no kv_lora_rank); try deepseek-v3-shaped")
    torch_dtype = resolve_dtype(dtype)
    block = latent_block(config, tokens, torch_dtype)
    key = chunk_key(block.fingerprint, block.namespace, block.token_ids)
    expanded = expanded_bytes(config, tokens, block.keys.element_size())
    rows = []
    for codec in codecs:
        encode_s, encoded = _timed(lambda c=codec: encode_block(block, key, c), runs)
        decode_s, decoded = _timed(lambda e=encoded: decode_block(e, expected_key=key), runs)
        error = max(float((decoded.keys.float() - block.keys.float()).abs().max()),
                    float((decoded.values.float() - block.values.float()).abs().max()))
        rows.append({"codec": codec, "dtype": dtype, "tokens": tokens, "layers": config.num_hidden_layers,
                     "bytes": len(encoded), "expanded_kv_bytes": expanded,
                     "ratio_vs_expanded": round(expanded / len(encoded), 2),
                     "encode_ms": round(encode_s * 1e3, 3), "decode_ms": round(decode_s * 1e3, 3),
                     "max_abs_error": error})
    rows.append(_anchor_row(config, tokens, torch_dtype, dtype, expanded, runs))
    checks = {row["codec"]: row for row in exactness(codecs)}
    for row in rows:
        row.update({k: v for k, v in checks.get(row["codec"], {}).items() if k != "codec"})
    payload = {"results": rows, "shape": shape, "machine": machine_description(),
               "latent_per_token_layer": config.kv_lora_rank + config.qk_rope_head_dim,
               "expanded_per_token_layer": config.num_attention_heads * (config.qk_nope_head_dim
                                                                         + config.qk_rope_head_dim
                                                                         + config.v_head_dim)}
    console.print(results_table(payload))
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    rows = payload["results"]
    first = rows[0]
    table = Table(title=f"MLA block, {payload['shape']}, {first['tokens']} tokens, {first['dtype']} "
                        f"({payload['machine']})")
    for column in ("codec", "bytes", "vs expanded K/V", "encode ms", "decode ms", "max abs error",
                   "tiny model: same tokens", "max logit diff"):
        table.add_column(column, justify="left" if column == "codec" else "right")
    for row in rows:
        exact = ("-", "-") if "same_tokens" not in row else (
            "yes" if row["same_tokens"] else "no", f"{row['max_logit_diff']:.2g}")
        table.add_row(row["codec"], f"{row['bytes']:,}", f"{row['ratio_vs_expanded']:.1f}x",
                      f"{row['encode_ms']:.1f}", f"{row['decode_ms']:.1f}", f"{row['max_abs_error']:.3g}", *exact)
    return table
