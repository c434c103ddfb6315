"""Decode GB/s of the codecs into a preallocated cache on a device (``decode_rates``; ``kvshelf bench gpu`` calls it).

Random keys and values of a model's shape are encoded block by block; each timed decode is what a warm load does
with the stored blocks: ``Codec.prepare_at`` of every block's payload (parsing, entropy decoding, on the CPU)
then ``PreparedPayload.write_run`` of the whole run into the destination ``[layers, kv_heads, tokens, head_dim]``
on ``device``. On a CUDA device the codecs send only their compact payload there and decode with torch ops on it
(KIVI's dequantization, XQuant's rematerialization: ``compress.kivi.write_portable``,
``compress.xquant.write_portable``); ``torch.cuda.synchronize`` brackets every timed run.

``decoded_bytes`` counts the keys and values written (in ``dtype``), ``encoded_bytes`` the payloads read;
``decode_gb_s`` is decoded bytes (1e9 a GB) per second of the median run; ``prepare_s`` the median time of the
runs' ``prepare_at`` calls alone (host parsing and entropy decoding, one thread: a store runs them on its decode
threads), the rest of ``decode_s`` is ``write_run`` (the copy to the device and the decode there).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvshelf.compress.xquant import XQuantTables, bind_tables, bound_tables, keep_plan
from kvshelf.kvstore.codec import BlockShape, get_codec


def _xquant_model(model: Any, params: Mapping[str, Any], geometry: tuple[int, int, int]) -> tuple[dict | None, str]:
    """``xquant`` parameters bound to ``model`` (bound tables' digest, ``XQuantTables`` or a HF model), or None
    and why not."""
    rest = {k: v for k, v in params.items() if k != "basis"}
    if model is None and not rest.get("model"):
        return None, "xquant needs a model's tables: pass model= (a HF model, XQuantTables or a bound digest)"
    if model is None:
        digest = str(rest["model"])
    elif isinstance(model, str):
        digest = model
    elif isinstance(model, XQuantTables):
        digest = bind_tables(model)
    else:
        from kvshelf.adapters.xquant import bind_xquant

        digest = bind_xquant(model, basis=params.get("basis", "klt"))
    tables = bound_tables(digest)
    if (tables.layers, tables.kv_heads, tables.head_dim) != geometry:
        return None, (f"xquant tables are for {tables.layers} layers x {tables.kv_heads} kv heads x "
                      f"{tables.head_dim}, the blocks are {geometry[0]} x {geometry[1]} x {geometry[2]}")
    bound = {**rest, "model": digest}
    keep_plan(bound)
    return bound, ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rates(
    device: str,
    codecs: Sequence[tuple[str, dict]],
    *,
    layers: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    tokens: int = 4096,
    block_tokens: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    runs: int = 5,
    model: Any = None,
    seed: int = 0,
) -> list[dict]:
    """Time decoding ``tokens`` tokens of random KV (``[layers, kv_heads, tokens, head_dim]`` in ``dtype``, blocks
    of ``block_tokens``, the last one partial) with each ``(codec, params)`` into a cache preallocated on
    ``device``: the median of ``runs`` runs after one untimed run.

    ``model``: what ``xquant`` needs (a HF model, ``XQuantTables`` or the digest of bound tables); without one,
    or with tables of another shape, its rows say ``"skipped"`` and why. Returns one row per codec:
    ``{"codec", "params", "device", "decoded_bytes", "encoded_bytes", "decode_s", "decode_gb_s", "prepare_s"}``.
    """
    target = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    sizes = [min(block_tokens, tokens - start) for start in range(0, tokens, block_tokens)]
    blocks = []
    for size in sizes:  # roughly unit-scale KV, a few outlier channels in the keys (as KIVI describes)
        keys = torch.randn(layers, kv_heads, size, head_dim, generator=generator)
        keys[..., :: max(head_dim // 8, 1)] *= 4.0
        values = torch.randn(layers, kv_heads, size, head_dim, generator=generator)
        blocks.append((keys.to(dtype), values.to(dtype)))
    keys_out = torch.empty(layers, kv_heads, tokens, head_dim, dtype=dtype, device=target)
    values_out = torch.empty_like(keys_out)
    decoded = 2 * keys_out.numel() * keys_out.element_size()
    rows = []
    for name, params in codecs:
        row: dict[str, Any] = {"codec": name, "params": dict(params), "device": str(target)}
        given = dict(params)
        if name == "xquant":
            bound, why = _xquant_model(model, params, (layers, kv_heads, head_dim))
            if bound is None:
                rows.append({**row, "skipped": why})
                continue
            given = bound
        codec = get_codec(name, given)
        payloads, start = [], 0
        for keys, values in blocks:
            payloads.append(memoryview(b"".join(bytes(p) for p in codec.encode_at(keys, values, start))))
            start += keys.shape[2]
        times, prepare_times = [], []
        for run in range(runs + 1):
            _sync(target)
            began = time.perf_counter()
            prepared, start = [], 0
            for payload, size in zip(payloads, sizes, strict=True):
                prepared.append(codec.prepare_at(payload, BlockShape((layers, kv_heads, size, head_dim)), dtype,
                                                 start))
                start += size
            parsed = time.perf_counter()
            type(prepared[0]).write_run(prepared, keys_out, values_out)
            _sync(target)
            if run:
                times.append(time.perf_counter() - began)
                prepare_times.append(parsed - began)
        seconds = statistics.median(times) if times else float("nan")
        rows.append({**row, "decoded_bytes": decoded, "encoded_bytes": sum(len(p) for p in payloads),
                     "decode_s": seconds, "decode_gb_s": decoded / seconds / 1e9 if seconds > 0 else float("nan"),
                     "prepare_s": statistics.median(prepare_times) if prepare_times else float("nan")})
    return rows
