"""``kvshelf bench gpu``: time to first token on a GPU, full prefill against warm loads from each tier, per codec;
host-to-device bandwidth against the card's own; each codec's decode rate on the GPU.

For each model (shaped models: real layer counts and head sizes, random weights, ``adapters.shaped``) and context
length (random token ids, seeded, then a fixed question), in one process:

* ``full``: prefill the whole prompt (median of ``runs``; the first run also stores the context's blocks).
* ``warm-gpu``: the blocks in the GPU tier (``kvstore.device_tier``: decoded, in device memory): a copy within
  the device. Its blocks were written by the store's put: the codec does not apply (``codec`` = ``decoded``).
* ``warm-cpu``: the blocks in the CPU tier in page-locked memory (``kvstore.pinned_memory``), in ``codec``:
  verified, then ``raw`` copied to the device by DMA, ``int8``/``int4`` and ``xquant`` decoded on the device from
  their payloads when their payload classes write to device tensors (else decoded on the CPU and staged).
* ``warm-lmdb``: the blocks in LMDB only (same process; the file in the page cache), in ``codec``.
* ``warm-remote``: the blocks in a ``kvshelf serve`` on this machine, fetched by ``RemoteStore`` over the gRPC
  wire path (no shared memory), in ``codec``; contexts up to ``remote_max_tokens`` (the wire moves ~1 GB/s).

Each warm row: TTFT (median of ``runs``, after one untimed load of that context), its speedup over ``full``,
whether its greedy tokens equal the full run's, ``load_s`` (the cache built from the store, no forward: median
of ``runs``, synchronized) and ``load_gb_s`` (the decoded KV's bytes over ``load_s``). ``copy_gb_s``: the card's
host-to-device copy of 1 GiB from page-locked memory (median of 5), and each ``warm-cpu`` ``raw`` row's
``load_gb_s`` as a fraction of it (``h2d_fraction``). Then ``bench.gpu_decode.decode_rates``: each codec's decode
(payload parsed, written into device tensors) in GB/s of decoded KV.

Without CUDA (and ``--device cuda``): one line saying so, exit 0. ``--device cpu`` runs the same code on the CPU
(the suite runs it on tiny shapes).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench.common import machine_description, median, save_results
from kvshelf.bench.ttft import _device_name

DEFAULT_MODELS = ("llama3-8b-shaped", "qwen3.5-0.8b-shaped", "smollm2-135m-shaped")
DEFAULT_LENGTHS = (4096, 16384, 32768)
DEFAULT_CODECS = ("raw", "int8", "xquant")
MODES = ("full", "warm-gpu", "warm-cpu", "warm-lmdb", "warm-remote")
QUESTION = "\n\nQuestion: What does the first document above propose? Answer in one sentence.\nAnswer:"


def cuda_missing(device: str) -> str | None:
    """The line ``kvshelf bench gpu`` prints instead of running when ``device`` is CUDA and there is none."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return (f"kvshelf bench gpu: no CUDA device on this machine (torch {torch.__version__}); nothing to measure "
                "(--device cpu runs the same code on the CPU)")
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, runs: int = 5) -> float | None:
    """GB/s of one copy of ``nbytes`` from page-locked host memory to ``device`` (median of ``runs``); None on a
    CPU."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(runs + 1):
        _sync(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    return nbytes / median(times[1:]) / 1e9


def _prompt(n: int, question: list[int], seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=generator).tolist() + question


def _kv_bytes(model: Any, tokens: int) -> int:
    """Bytes of the decoded KV of ``tokens`` tokens (the attention layers' keys and values, the model's dtype)."""
    from kvshelf.adapters import hf

    text = model.config.get_text_config(decoder=True)
    layers = sum(1 for t in hf.attention_layer_types(model.config) if t in (hf.FULL_ATTENTION,
                                                                              *hf.WINDOWED_ATTENTION))
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return layers * heads * tokens * dim * 2 * model.dtype.itemsize


class _Timer:
    """TTFTs and load times of one generator (``CachedGenerator``) on one prompt."""

    def __init__(self, generator: Any, device: torch.device, runs: int, new_tokens: int) -> None:
        self.generator, self.device, self.runs, self.new_tokens = generator, device, runs, new_tokens

    def ttft(self, prompt: list[int], *, reuse: bool, first: Any = None) -> dict[str, Any]:
        results = [first] if first is not None else []
        while len(results) < self.runs:
            results.append(self.generator.generate(prompt, max_new_tokens=self.new_tokens, reuse=reuse,
                                                   store=False))
        return {"ttft_s": median([r.ttft_s for r in results]), "new_ids": [r.new_ids for r in results],
                "reused_tokens": min(r.reused_tokens for r in results)}

    def load_s(self, prompt: list[int]) -> float:
        times = []
        for _ in range(self.runs):
            _sync(self.device)
            start = time.perf_counter()
            self.generator.load_prefix(prompt)
            _sync(self.device)
            times.append(time.perf_counter() - start)
        return median(times)


def _codec_settings(model: Any, tokenizer: Any, codec: str, corpus: str | None, tmp: str) -> dict[str, Any]:
    from kvshelf.bench.ttft import _codec_params

    params, _ = _codec_params(model, tokenizer, corpus, codec, {}, tmp, label=f"gpu-{codec}")
    return dict(params or {})


def _measure_model(name: str, *, lengths: Sequence[int], codecs: Sequence[str], modes: Sequence[str], runs: int,
                   new_tokens: int, device: torch.device, dtype: str, block_size: int, gpu_bytes: int,
                   memory_bytes: int, remote_max_tokens: int, codec_max_tokens: int | None, corpus: str | None,
                   tmp: str, console: Console, rows: list[dict[str, Any]], skipped: list[str],
                   checkpoint: Any) -> Any:
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore.device_tier import DeviceTier
    from kvshelf.kvstore.pinned_memory import PinnedMemoryTier
    from kvshelf.kvstore.store import TieredStore, TierSpec
    from kvshelf.kvstore.tier_registry import lmdb_url, open_tier

    model, tokenizer = load_model(name, dtype=dtype, device=str(device))
    window = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    usable = [n for n in lengths if window is None or n + 64 <= window]
    for n in sorted(set(lengths) - set(usable)):
        skipped.append(f"{name}: {n} tokens is beyond its window of {window}")
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    prompts = {n: _prompt(n, question, seed=n) for n in usable}
    full: dict[int, dict[str, Any]] = {}

    def row(n: int, mode: str, codec: str, timed: dict[str, Any], load_s: float | None = None) -> None:
        reference = full[n]
        kv = _kv_bytes(model, n)
        out = {"model": name, "tokens": n, "mode": mode, "codec": codec, "ttft_s": round(timed["ttft_s"], 4),
               "speedup": round(reference["ttft_s"] / timed["ttft_s"], 2),
               "same_output": all(ids == reference["new_ids"][0] for ids in timed["new_ids"]),
               "reused_tokens": timed["reused_tokens"], "kv_bytes": kv}
        if load_s is not None:
            out["load_s"] = round(load_s, 4)
            out["load_gb_s"] = round(kv / load_s / 1e9, 2)
        rows.append(out)
        checkpoint()

    for index, codec in enumerate(codecs):
        params = _codec_settings(model, tokenizer, codec, corpus, tmp)
        limit = codec_max_tokens if index > 0 and codec_max_tokens is not None else None
        for n in usable if limit is not None else ():
            if n > limit:
                skipped.append(f"{name} {codec}: {n} tokens is beyond --codec-max-tokens {limit}")
        lengths_here = [n for n in usable if limit is None or n <= limit]
        with ExitStack() as stack:
            memory = PinnedMemoryTier(memory_bytes, pin=device.type == "cuda")
            stack.callback(memory.close)
            disk = open_tier(lmdb_url(Path(tmp) / f"{name}-{codec}"), capacity_bytes=1 << 40, durable=False)
            stack.callback(disk.close)
            gpu = DeviceTier(gpu_bytes, device) if index == 0 and "warm-gpu" in modes else None
            if gpu is not None:
                stack.callback(gpu.close)
            writer_store = TieredStore([TierSpec(memory, codec, params), TierSpec(disk, codec, params)],
                                       device_tier=gpu)
            writer = CachedGenerator(model, tokenizer, writer_store, block_size=block_size)
            stack.callback(writer.close)
            timer = _Timer(writer, device, runs, new_tokens)
            writer.generate(prompts[usable[0]][:200], max_new_tokens=2, reuse=False, store=False)  # warm-up
            for n in tqdm(lengths_here, desc=f"{name} {codec}: full prefill (stores the blocks)", unit="ctx"):
                first = writer.generate(prompts[n], max_new_tokens=new_tokens, reuse=False, store=True, wait=True)
                if index == 0:
                    full[n] = timer.ttft(prompts[n], reuse=False, first=first)
                    row(n, "full", "-", full[n])
                    if gpu is not None:
                        writer.generate(prompts[n], max_new_tokens=1, reuse=True, store=False)
                        row(n, "warm-gpu", "decoded", timer.ttft(prompts[n], reuse=True), timer.load_s(prompts[n]))
            for mode, tier in (("warm-cpu", memory), ("warm-lmdb", disk)):
                if mode not in modes:
                    continue
                reader = CachedGenerator(model, tokenizer, TieredStore([TierSpec(tier, codec, params)]),
                                         block_size=block_size)
                reader_timer = _Timer(reader, device, runs, new_tokens)
                for n in tqdm(lengths_here, desc=f"{name} {codec}: {mode}", unit="ctx"):
                    reader.generate(prompts[n], max_new_tokens=1, reuse=True, store=False)  # untimed first load
                    row(n, mode, codec, reader_timer.ttft(prompts[n], reuse=True), reader_timer.load_s(prompts[n]))
                reader.close()
        if "warm-remote" in modes:
            _remote_rows(model, tokenizer, name, codec, params, [n for n in lengths_here if n <= remote_max_tokens],
                         prompts, tmp=tmp, block_size=block_size, runs=runs, new_tokens=new_tokens, device=device,
                         row=row)
    return model


def _remote_rows(model: Any, tokenizer: Any, name: str, codec: str, params: dict[str, Any], lengths: list[int],
                 prompts: dict[int, list[int]], *, tmp: str, block_size: int, runs: int, new_tokens: int,
                 device: torch.device, row: Any) -> None:
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.bench.servers import kvshelf_server
    from kvshelf.service.client import RemoteStore

    if not lengths:
        return
    with kvshelf_server(str(Path(tmp) / f"served-{name}-{codec}"), "--max-block", "256MiB") as address:
        store = RemoteStore(address, namespace=f"gpu-{codec}", codec=codec, codec_params=params or None,
                            shared_memory=False, timeout_s=600)
        generator = CachedGenerator(model, tokenizer, store, block_size=block_size)
        timer = _Timer(generator, device, runs, new_tokens)
        try:
            for n in tqdm(lengths, desc=f"{name} {codec}: warm-remote", unit="ctx"):
                generator.generate(prompts[n], max_new_tokens=1, reuse=False, store=True, wait=True)
                generator.generate(prompts[n], max_new_tokens=1, reuse=True, store=False)
                row(n, "warm-remote", codec, timer.ttft(prompts[n], reuse=True), timer.load_s(prompts[n]))
        finally:
            generator.close()
            store.close()


def run(*, json_path: str | None, models: Sequence[str] = DEFAULT_MODELS,
        lengths: Sequence[int] = DEFAULT_LENGTHS, codecs: Sequence[str] = DEFAULT_CODECS,
        modes: Sequence[str] = MODES, runs: int = 3, new_tokens: int = 8, device: str = "cuda",
        dtype: str = "bfloat16", block_size: int = 256, gpu_bytes: int = 16 << 30, memory_bytes: int = 24 << 30,
        remote_max_tokens: int = 8192, codec_max_tokens: int | None = None, corpus: str | None = None,
        decode_tokens: int = 4096,
        console: Console | None = None) -> dict[str, Any] | None:
    """The table of the module docstring; None (after one line) where ``device`` is CUDA and there is none."""
    console = console or Console()
    missing = cuda_missing(device)
    if missing:
        console.print(missing)
        return None
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    payload: dict[str, Any] = {
        "device": _device_name(target),
        "machine": machine_description(), "dtype": dtype, "runs": runs, "block_size": block_size,
        "new_tokens": new_tokens, "remote_max_tokens": remote_max_tokens, "codec_max_tokens": codec_max_tokens,
        "copy_gb_s": None, "results": rows, "decode": [], "skipped": skipped,
    }
    payload["copy_gb_s"] = round(copy_bandwidth(target) or 0, 2) or None

    def checkpoint() -> None:  # what is measured so far survives a run cut short
        if json_path:
            _h2d_fractions(payload)
            Path(json_path).write_text(json.dumps(payload, indent=2))

    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-gpu-") as tmp:
        model = None
        for name in models:
            model = None
            torch.cuda.empty_cache() if target.type == "cuda" else None
            model = _measure_model(name, lengths=lengths, codecs=codecs, modes=modes, runs=runs,
                                   new_tokens=new_tokens, device=target, dtype=dtype, block_size=block_size,
                                   gpu_bytes=gpu_bytes, memory_bytes=memory_bytes,
                                   remote_max_tokens=remote_max_tokens, codec_max_tokens=codec_max_tokens,
                                   corpus=corpus, tmp=tmp, console=console, rows=rows, skipped=skipped,
                                   checkpoint=checkpoint)
            if not payload["decode"]:  # the first model's shape (the largest, by the default order)
                payload["decode"] = _decode_rows(target, codecs, model, decode_tokens, dtype, skipped)
            checkpoint()
    _h2d_fractions(payload)
    console.print(results_table(payload), width=max(console.width, 140))
    if payload["decode"]:
        console.print(decode_table(payload))
    for line in skipped:
        console.print(f"[dim]skipped: {line}[/dim]")
    save_results(json_path, payload, console)
    return payload


def _h2d_fractions(payload: dict[str, Any]) -> None:
    copy = payload.get("copy_gb_s")
    for r in payload["results"]:
        if copy and r["mode"] == "warm-cpu" and r["codec"] == "raw" and "load_gb_s" in r:
            r["h2d_fraction"] = round(r["load_gb_s"] / copy, 3)


def _decode_rows(device: torch.device, codecs: Sequence[str], model: Any, tokens: int, dtype: str,
                 skipped: list[str]) -> list[dict[str, Any]]:
    try:
        from kvshelf.bench.gpu_decode import decode_rates
    except ImportError as exc:
        skipped.append(f"decode rates: {exc}")
        return []
    from kvshelf.adapters import hf
    from kvshelf.adapters.model import resolve_dtype

    text = model.config.get_text_config(decoder=True)
    if set(hf.attention_layer_types(model.config)) != {hf.FULL_ATTENTION}:
        skipped.append(f"decode rates: {text.model_type} has layers other than full attention")
        return []
    return decode_rates(str(device), [(c, {}) for c in codecs], layers=text.num_hidden_layers,
                        kv_heads=text.num_key_value_heads,
                        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                        tokens=tokens, dtype=resolve_dtype(dtype), model=model)


def results_table(payload: dict[str, Any]) -> Table:
    """The TTFT table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    copy = payload.get("copy_gb_s")
    table = Table(title=f"TTFT on {payload['device']}, {payload['dtype']}, median of {payload['runs']} "
                        f"(host-to-device copy {copy} GB/s)" if copy else
                        f"TTFT on {payload['device']}, {payload['dtype']}, median of {payload['runs']}")
    for column in ("model", "context tokens", "mode", "codec", "TTFT (s)", "speedup vs full", "load (s)",
                   "load GB/s", "of copy bw", "same output"):
        table.add_column(column, justify="right")
    for r in payload["results"]:
        same = "yes" if r["same_output"] else "no (lossy)" if r["codec"] not in ("raw", "decoded", "-") else "NO"
        table.add_row(r["model"], str(r["tokens"]), r["mode"], r["codec"], f"{r['ttft_s']:.3f}",
                      f"{r['speedup']:.1f}x", f"{r['load_s']:.3f}" if "load_s" in r else "-",
                      f"{r['load_gb_s']:.1f}" if "load_gb_s" in r else "-",
                      f"{100 * r['h2d_fraction']:.0f}%" if "h2d_fraction" in r else "-", same)
    return table


def decode_table(payload: dict[str, Any]) -> Table:
    table = Table(title=f"Codec decode on {payload['device']} (GB/s of decoded KV)")
    for column in ("codec", "decoded MB", "encoded MB", "decode (ms)", "GB/s"):
        table.add_column(column, justify="right")
    for r in payload["decode"]:
        if r.get("skipped"):
            table.add_row(r["codec"], "-", "-", "-", f"skipped: {r['skipped']}")
            continue
        table.add_row(r["codec"], f"{r['decoded_bytes'] / 1e6:.1f}", f"{r['encoded_bytes'] / 1e6:.1f}",
                      f"{1000 * r['decode_s']:.2f}", f"{r['decode_gb_s']:.1f}")
    return table


def results_tables(payload: dict[str, Any]) -> list[Table]:
    """The TTFT table and, when measured, the decode table (docs/benchmarks.md renders both)."""
    return [results_table(payload), *([decode_table(payload)] if payload.get("decode") else [])]
