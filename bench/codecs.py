"""``kvshelf bench codecs``: size, speed and perplexity cost of every KV codec on SmolLM2.

Quality protocol: windows of 2,048 corpus tokens; prefill tokens ``[0, 1536)``; encode then decode their
KV (in 256-token blocks through ``encode_block``/``decode_block``, as the store does); teacher-forced perplexity of
tokens ``[1536, 2048)`` attending to the decoded KV; the absolute and relative increase over the uncompressed KV,
averaged over the windows. The prefill of each window is shared by all codecs.

Size: ``ratio`` is fp16 bytes over the encoded blocks' bytes (everything counted: frame, header, token ids,
checksum); ``bits_per_value`` = 8 * encoded bytes / values. Speed: MB/s of fp16-equivalent data (2 bytes per
value), encode and decode of the blocks (``encode_block`` / ``decode_block``: framing and checksums included), on
this CPU with torch's default threads (timings are noisy when other work shares the cores); every setting first
round-trips one block untimed, so one-time costs (imports, first allocations, cached entropy models) stay out.

The entropy-coding gain: the ``int4`` row is set against the ``cachegen`` setting of the highest ratio whose
relative Δppl is no larger than ``int4``'s (``int4_vs_cachegen`` in the JSON, a line under the table).

Anchors (``"anchor": true``): HF transformers ``QuantizedCache`` with the quanto and HQQ backends at 4 and 2 bits,
fed the same prefill KV; their size is computed from their format (``nbits`` plus the per-group scale and zero
point), their speed is the time of their quantize / dequantize calls. A backend that cannot be installed or run
here is recorded with its error instead.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench.common import corpus_texts, default_corpus, machine_description, save_results

WINDOW = 2048
PREFIX = 1536
BLOCK = 256

# (codec, params, sparse keep policy or None)
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("raw", {}),
    ("zstd", {"level": 3}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {"group_size": 128}),
    ("int4", {"group_size": 32}),
    ("int2", {"group_size": 32}),
    ("cachegen", {}),  # defaults: bits=3.5, fp16 sink tokens, no rotation
    ("cachegen", {"bits": 4}),
    ("cachegen", {"bits": 3.25}),
    ("cachegen", {"bits": 3}),
    ("cachegen", {"bits": 3.4}),
    ("cachegen", {"bits": 3, "early_extra_bits": 1, "early_fraction": 0.2}),  # +1 bit in the first 6 of 30 layers
    ("cachegen", {"bits": 3, "early_extra_bits": 1, "early_fraction": 0.3}),  # +1 bit in the first 9 of 30 layers
    ("cachegen", {"rotate": True}),  # QuaRot-style Hadamard rotation first
    ("sparse", {"inner": "int8", "inner_params": {"group_size": 128}}),
    # xquant needs the model: its tables are computed on calibration text (corpus end, disjoint from the windows)
    # and bound before the windows; "basis" picks the latent (klt: activation-aware SVD, svd: weights only)
    ("xquant", {"step": 0.35, "basis": "klt"}),
    ("xquant", {"step": 0.35, "drop_below": 0.4, "basis": "klt"}),  # the lowest class not stored: faster decode
    ("xquant", {"step": 0.35, "drop_below": 0.8, "basis": "klt"}),  # and most of the next one
    ("xquant", {"step": 0.35, "drop_below": 1.2, "basis": "klt"}),
    ("xquant", {"step": 0.45, "basis": "klt"}),
    ("xquant", {"step": 0.5, "basis": "klt"}),
    ("xquant", {"step": 0.6, "basis": "klt"}),
    ("xquant", {"step": 0.45, "basis": "svd"}),
    # XQuant-CL: each layer's latent predicted from the two rebuilt layers below (predictors fitted on the same
    # calibration text), only the residual coded
    ("xquant", {"step": 0.35, "cross_layer": True}),
    ("xquant", {"step": 0.4, "cross_layer": True}),
    ("xquant", {"step": 0.45, "cross_layer": True}),
    ("xquant", {"step": 0.4, "drop_below": 0.4, "cross_layer": True}),
]
XQUANT_CALIBRATION_TOKENS = 4096
SPARSE_SINKS, SPARSE_RECENT = 64, 1088  # the sparse setting keeps StreamingLLM-style sinks + recent tokens
ANCHORS = [("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 2)]
ANCHOR_GROUP = 64


def _windows(tokenizer: Any, corpus: str | None, count: int) -> list[list[int]]:
    ids: list[int] = []
    texts = list(corpus_texts(corpus))
    i = 0
    while len(ids) < count * WINDOW:
        ids.extend(tokenizer(texts[i % len(texts)] + "\n\n", add_special_tokens=False)["input_ids"])
        i += 1
    return [ids[n * WINDOW : (n + 1) * WINDOW] for n in range(count)]


def _prefill(model: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from kvshelf.adapters.hf import cache_tensors

    with torch.no_grad():
        out = model(torch.tensor([ids[:PREFIX]]), use_cache=True)
    layers = cache_tensors(out.past_key_values)  # per layer (keys, values) [1, kv_heads, tokens, head_dim]
    return torch.stack([k[0] for k, _ in layers]), torch.stack([v[0] for _, v in layers])


def _suffix_nll(model: Any, ids: list[int], cache: Any, attention_mask: torch.Tensor | None = None) -> float:
    """Mean NLL of tokens ``[PREFIX + 1, WINDOW)`` fed after ``cache`` (teacher forcing)."""
    suffix = torch.tensor([ids[PREFIX:]])
    with torch.no_grad():
        kwargs: dict[str, Any] = {"past_key_values": cache, "use_cache": True}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        logits = model(suffix, **kwargs).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, suffix[0, 1:]))


def _cache_of(model: Any, keys: torch.Tensor, values: torch.Tensor) -> Any:
    from kvshelf.adapters.cache_bridge import cache_from_blocks
    from kvshelf.kvstore.block import KVBlock

    block = KVBlock(keys, values, tuple(range(keys.shape[2])), 0, "bench")
    return cache_from_blocks([block], model.config)


def _round_trip(name: str, params: dict[str, Any], keys: torch.Tensor, values: torch.Tensor,
                token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, int, float, float]:
    """Encode and decode ``keys``/``values`` in 256-token blocks; return them, the encoded bytes and timings."""
    from kvshelf.kvstore.block import KVBlock
    from kvshelf.kvstore.encoding import decode_block, encode_block

    encoded_bytes, t_enc, t_dec, out_k, out_v = 0, 0.0, 0.0, [], []
    for s in range(0, keys.shape[2], BLOCK):
        block = KVBlock(keys[:, :, s : s + BLOCK].contiguous(), values[:, :, s : s + BLOCK].contiguous(),
                        tuple(token_ids[s : s + BLOCK]), s, "bench-fingerprint")
        t0 = time.perf_counter()
        data = encode_block(block, b"k" * 16, name, params)
        t1 = time.perf_counter()
        back = decode_block(data)
        t2 = time.perf_counter()
        encoded_bytes += len(data)
        t_enc += t1 - t0
        t_dec += t2 - t1
        out_k.append(back.keys)
        out_v.append(back.values)
    return torch.cat(out_k, dim=2), torch.cat(out_v, dim=2), encoded_bytes, t_enc, t_dec


def _sparse_input(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keep = torch.zeros(keys.shape[2], dtype=torch.bool)
    keep[:SPARSE_SINKS] = True
    keep[-SPARSE_RECENT:] = True
    k, v = keys.clone(), values.clone()
    k[:, :, ~keep] = float("nan")
    v[:, :, ~keep] = float("nan")
    return k, v, keep


def _warm_up(model: Any, ids: list[int], settings: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """One untimed round trip of a block per setting (imports, first allocations, entropy-model caches)."""
    keys, values = _prefill(model, ids[:BLOCK])
    for name, _, params in settings:
        _round_trip(name, params, keys, values, ids[:BLOCK])


def xquant_calibration(tokenizer: Any, corpus: str | None) -> list[int]:
    """Calibration ids for xquant: corpus texts from the end (the windows take them from the start)."""
    ids: list[int] = []
    for text in reversed(list(corpus_texts(corpus))):
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= XQUANT_CALIBRATION_TOKENS:
            break
    return ids[:XQUANT_CALIBRATION_TOKENS]


def calibration_texts(tokenizer: Any, corpus: str | None, windows: int) -> dict[str, int | bool]:
    """Which corpus texts the windows (from the start) and the xquant calibration (from the end) read, counted as
    ``_windows`` and ``xquant_calibration`` do: ``disjoint`` when no text feeds both."""
    texts = list(corpus_texts(corpus))
    lengths = [len(tokenizer(t + "\n\n", add_special_tokens=False)["input_ids"]) for t in texts]
    read, first = 0, 0
    while read < windows * WINDOW:
        read += lengths[first % len(texts)]
        first += 1
    read, last = 0, 0
    while read < XQUANT_CALIBRATION_TOKENS and last < len(texts):
        read += lengths[len(texts) - 1 - last]
        last += 1
    return {"corpus_texts": len(texts), "window_texts": first, "calibration_texts": last,
            "disjoint": first + last <= len(texts)}


def _settings(model: Any, tokenizer: Any, corpus: str | None, only: list[str] | None,
              ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(codec, params shown, params given to the codec)``; xquant's tables are computed and bound here."""
    out = []
    calibration = None
    for name, params in SETTINGS:
        if only and name not in only:
            continue
        codec_params = params
        if name == "xquant":
            from kvshelf.adapters.xquant import xquant_params

            calibration = calibration or xquant_calibration(tokenizer, corpus)
            rest = {k: v for k, v in params.items() if k != "basis"}
            codec_params = xquant_params(model, calibration, basis=params.get("basis", "klt"), **rest)
        out.append((name, params, codec_params))
    return out


def int4_vs_cachegen(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The entropy-coding gain: ``int4`` against the ``cachegen`` setting of the highest ratio among those whose
    relative Δppl is no larger than ``int4``'s (``None`` without an ``int4`` row or without such a setting)."""
    int4 = next((r for r in results if r["codec"] == "int4" and r.get("ratio")), None)
    if int4 is None:
        return None
    same = [r for r in results if r["codec"] == "cachegen" and r.get("ratio") and r["dppl_rel"] <= int4["dppl_rel"]]
    if not same:
        return None
    best = max(same, key=lambda r: r["ratio"])
    return {"int4_params": int4["params"], "int4_ratio": int4["ratio"], "int4_dppl_rel": int4["dppl_rel"],
            "cachegen_params": best["params"], "cachegen_ratio": best["ratio"], "cachegen_dppl_rel": best["dppl_rel"],
            "smaller_than_int4": round(best["ratio"] / int4["ratio"], 3)}


def _anchor_probe(backend: str, nbits: int, model: Any) -> Any:
    from kvshelf.adapters.hf import quantized_cache

    return quantized_cache(backend, model.config, nbits=nbits, group_size=ANCHOR_GROUP, residual_length=128)


def _anchor_window(backend: str, nbits: int, model: Any, ids: list[int], keys: torch.Tensor,
                   values: torch.Tensor) -> tuple[float, float, float]:
    """NLL with the prefix KV held in a ``QuantizedCache``; quantize and dequantize seconds."""
    cache = _anchor_probe(backend, nbits, model)
    t0 = time.perf_counter()
    for n in range(keys.shape[0]):
        cache.update(keys[n : n + 1].contiguous(), values[n : n + 1].contiguous(), n)
    t_enc = time.perf_counter() - t0
    from kvshelf.adapters.hf import dequantize_cache

    t0 = time.perf_counter()
    dequantize_cache(cache)
    t_dec = time.perf_counter() - t0
    return _suffix_nll(model, ids, cache), t_enc, t_dec


def run(
    json_path: str | None,
    corpus: str | None,
    *,
    windows: int = 8,
    model_name: str = "smollm2-135m",
    anchors: bool = True,
    only: list[str] | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Measure every codec setting (those of the codecs in ``only`` when given) and the anchors on ``windows``
    windows; write ``json_path``; print a table."""
    from kvshelf.adapters.model import load_model

    console = console or Console()
    model, tokenizer = load_model(model_name)
    if corpus is None:
        corpus = default_corpus()
    wins = _windows(tokenizer, corpus, windows)
    settings = _settings(model, tokenizer, corpus, only)
    _warm_up(model, wins[0], settings)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    anchor_errors: dict[str, str] = {}
    base_ppl: list[float] = []
    for ids in tqdm(wins, desc="windows", unit="win"):
        keys, values = _prefill(model, ids)
        fp16_bytes = 2 * 2 * keys.numel()
        base = math.exp(_suffix_nll(model, ids, _cache_of(model, keys, values)))
        base_ppl.append(base)
        for name, params, codec_params in settings:
            mask = None
            in_k, in_v = keys, values
            if name == "sparse":
                in_k, in_v, keep = _sparse_input(keys, values)
                mask = torch.cat([keep, torch.ones(WINDOW - PREFIX, dtype=torch.bool)]).long()[None]
            out_k, out_v, nbytes, t_enc, t_dec = _round_trip(name, codec_params, in_k, in_v, ids[:PREFIX])
            if name == "sparse":
                out_k, out_v = torch.nan_to_num(out_k, nan=0.0), torch.nan_to_num(out_v, nan=0.0)
            if mask is None and torch.equal(out_k, keys) and torch.equal(out_v, values):
                ppl = base  # lossless: bit-identical KV, the uncompressed run's perplexity
            else:
                ppl = math.exp(_suffix_nll(model, ids, _cache_of(model, out_k, out_v), mask))
            row = rows.setdefault((name, repr(params)), {"codec": name, "params": params, "anchor": False,
                                                         "ppl": [], "bytes": 0, "fp16": 0, "enc": 0.0, "dec": 0.0})
            row["ppl"].append(ppl)
            row["bytes"] += nbytes
            row["fp16"] += fp16_bytes
            row["enc"] += t_enc
            row["dec"] += t_dec
        for backend, nbits in ANCHORS if anchors else []:
            label = f"QuantizedCache[{backend}]"
            if backend in anchor_errors:
                continue
            try:
                nll, t_enc, t_dec = _anchor_window(backend, nbits, model, ids, keys, values)
            except Exception as exc:  # an optional backend that is missing or broken on this CPU
                anchor_errors[backend] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            bits = nbits + 2 * 16 / ANCHOR_GROUP
            row = rows.setdefault((label, str(nbits)), {
                "codec": label, "params": {"nbits": nbits, "q_group_size": ANCHOR_GROUP, "axis_key": 0,
                                           "axis_value": 0, "size": "computed: nbits + fp16 scale+zero per group"},
                "anchor": True, "ppl": [], "bytes": 0, "fp16": 0, "enc": 0.0, "dec": 0.0})
            row["ppl"].append(math.exp(nll))
            row["bytes"] += keys.numel() * 2 * bits / 8
            row["fp16"] += fp16_bytes
            row["enc"] += t_enc
            row["dec"] += t_dec
    mean_base = sum(base_ppl) / len(base_ppl)
    results = []
    for row in rows.values():
        ppl = sum(row["ppl"]) / len(row["ppl"])
        dppl = sum(p - b for p, b in zip(row["ppl"], base_ppl, strict=False)) / len(row["ppl"])
        results.append({
            "codec": row["codec"], "params": row["params"], "anchor": row["anchor"],
            "ratio": round(row["fp16"] / row["bytes"], 3),
            "bits_per_value": round(8 * row["bytes"] / (row["fp16"] / 2), 3),
            "ppl": round(ppl, 4), "dppl": round(dppl, 4), "dppl_rel": round(dppl / mean_base, 5),
            "encode_mb_s": round(row["fp16"] / 1e6 / row["enc"], 1) if row["enc"] else None,
            "decode_mb_s": round(row["fp16"] / 1e6 / row["dec"], 1) if row["dec"] else None,
        })
    for backend, error in anchor_errors.items():
        results.append({"codec": f"QuantizedCache[{backend}]", "params": {}, "anchor": True, "error": error,
                        "ratio": None, "bits_per_value": None, "ppl": None, "dppl": None, "dppl_rel": None,
                        "encode_mb_s": None, "decode_mb_s": None})
    payload = {
        "model": model_name, "machine": machine_description(), "windows": windows, "window_tokens": WINDOW,
        "prefix_tokens": PREFIX, "block_tokens": BLOCK, "baseline_ppl": round(mean_base, 4),
        "sparse_policy": f"keep the first {SPARSE_SINKS} and last {SPARSE_RECENT} of {PREFIX} prefix tokens",
        "xquant_calibration": f"{XQUANT_CALIBRATION_TOKENS} tokens of corpus texts taken from its end (chunks of "
                              "1,024; the windows take texts from its start); cross-layer predictors fitted on the "
                              "same calibration tokens",
        "xquant_calibration_texts": calibration_texts(tokenizer, corpus, windows)
        if any(name == "xquant" for name, _, _ in settings) else None,
        "corpus": str(corpus) if corpus else "synthetic (no corpus found)", "results": results,
        "int4_vs_cachegen": int4_vs_cachegen(results),
    }
    _print_table(console, payload)
    save_results(json_path, payload, console)
    return payload


_SHORT = {"group_size": "g", "q_group_size": "g", "early_extra_bits": "early+", "early_fraction": "frac",
          "nbits": "bits", "level": "lvl"}


def _short_value(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{_SHORT.get(k, k)}={v}" for k, v in value.items())
    return str(value)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(console: Console, payload: dict[str, Any]) -> None:
    console.print(results_table(payload), width=max(console.width, 160))
    gain = payload.get("int4_vs_cachegen")
    if gain:
        console.print(f"entropy-coding gain: cachegen {_short_value(gain['cachegen_params']) or 'defaults'} is "
                      f"{gain['cachegen_ratio']:.2f}x vs fp16 at {100 * gain['cachegen_dppl_rel']:+.2f}% Δppl, int4 "
                      f"{_short_value(gain['int4_params'])} {gain['int4_ratio']:.2f}x at "
                      f"{100 * gain['int4_dppl_rel']:+.2f}%: [bold]{gain['smaller_than_int4']:.2f}x smaller[/bold] "
                      "than int4 at no more Δppl")
    else:
        console.print("entropy-coding gain: no cachegen setting at or below int4's Δppl in this run")


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    table = Table(title=f"KV codecs, {payload['model']}, {payload['windows']} windows, baseline ppl "
                        f"{payload['baseline_ppl']:.3f} ({payload['machine']})", padding=(0, 1))
    for column in ("codec", "params", "ratio", "bits/val", "ppl", "Δppl", "Δppl%", "enc MB/s", "dec MB/s"):
        table.add_column(column, justify="right" if column not in ("codec", "params") else "left")
    for r in payload["results"]:
        params = " ".join(f"{_SHORT.get(k, k)}={_short_value(v)}" for k, v in r["params"].items()
                          if k not in ("size", "axis_key", "axis_value")) or "-"
        if "error" in r:
            params = f"[red]unavailable: {escape(r['error'][:80])}[/red]"
        codec = escape(r["codec"].replace("QuantizedCache", "QC") + (" anchor" if r["anchor"] else ""))
        table.add_row(codec, params, _fmt(r["ratio"], ".2f"),
                      _fmt(r["bits_per_value"], ".2f"), _fmt(r["ppl"], ".2f"), _fmt(r["dppl"], "+.3f"),
                      "-" if r["dppl_rel"] is None else f"{100 * r['dppl_rel']:+.2f}%",
                      _fmt(r["encode_mb_s"], ".0f"), _fmt(r["decode_mb_s"], ".0f"))
    return table
