"""``kvshelf bench ttft``: time to first token with full prefill vs. reuse from memory, from disk (each codec
against ``raw`` in the same run), from a remote ``kvshelf serve`` and from Redis. The method:
docs/benchmarks.md, "TTFT: full prefill vs reuse".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench.common import corpus_texts, machine_description, median, save_results

#: codecs whose round trip is exact (a lossy codec's "same output" may be "no")
LOSSLESS = ("raw", "zstd")
CODECS_RESULTS = Path(__file__).resolve().parent / "results" / "codecs.json"
#: the modes of a remote run, each a fresh worker process per round: ``disk`` (a local LMDB, no memory tier: the
#: anchor the remote modes are compared with) runs whenever ``remote`` or ``redis`` does
REMOTE_MODES = {"disk": "warm-disk", "remote": "warm-remote", "redis": "warm-redis"}

QUESTION = (
    "\n\nQuestion: Which problem does the first abstract above address, and which method do its authors "
    "propose? Answer in one short sentence.\nAnswer:"
)
DEFAULT_LENGTHS = (1024, 2048, 4096)
#: glibc tunables of the disk-mode processes (see the module docstring): mmap only above 32 MiB (the most glibc
#: allows), never trim the heap
WORKER_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=68719476736"


def build_context(tokenizer: Any, texts: list[str], tokens: int) -> list[int]:
    """Token ids of concatenated corpus texts, cut to exactly ``tokens`` (repeating texts if needed)."""
    ids: list[int] = []
    i = 0
    while len(ids) < tokens:
        ids.extend(tokenizer(texts[i % len(texts)] + "\n\n", add_special_tokens=False)["input_ids"])
        i += 1
    return ids[:tokens]


def _warm_up(generator: Any) -> None:
    """One short call so one-time start-up costs stay out of the timings."""
    generator.generate(list(range(10, 80)), max_new_tokens=2, reuse=False, store=False)


def _timed_runs(generator: Any, prompt: list[int], runs: int, new_tokens: int, **kwargs: Any) -> dict:
    ttfts, outputs, reused = [], [], []
    for _ in range(runs):
        result = generator.generate(prompt, max_new_tokens=new_tokens, **kwargs)
        ttfts.append(result.ttft_s)
        outputs.append(result.new_ids)
        reused.append(result.reused_tokens)
    if not ttfts:  # runs == 0 (the full mode's extra runs with --runs 1)
        return {"ttft_s": float("nan"), "all_ttft_s": [], "new_ids": [], "reused_tokens": 0}
    return {"ttft_s": median(ttfts), "all_ttft_s": ttfts, "new_ids": outputs, "reused_tokens": min(reused)}


def _merged(parts: list[dict]) -> dict:
    """Several ``_timed_runs`` results of one mode as one: the median over all their calls."""
    ttfts = [t for part in parts for t in part["all_ttft_s"]]
    return {"ttft_s": median(ttfts), "all_ttft_s": ttfts,
            "new_ids": [ids for part in parts for ids in part["new_ids"]],
            "reused_tokens": min(part["reused_tokens"] for part in parts)}


def _codec_params(model: Any, tokenizer: Any, corpus: str | None, codec: str, params: dict[str, Any], tmp: str,
                  label: str = "xquant") -> tuple[dict[str, Any] | None, str | None]:
    """The disk codec's parameters, and for ``xquant`` the file of the model tables they need (else None)."""
    if codec != "xquant":
        return (params or None), None
    from kvshelf.adapters.xquant import xquant_params
    from kvshelf.bench.codecs import xquant_calibration
    from kvshelf.compress.xquant import bound_tables, save_tables

    rest = {k: v for k, v in params.items() if k != "basis"}
    bound = xquant_params(model, xquant_calibration(tokenizer, corpus), basis=params.get("basis", "klt"), **rest)
    tables_path = str(Path(tmp) / f"{label}-tables.safetensors")
    save_tables(bound_tables(bound["model"]), tables_path)
    return bound, tables_path


def _state_sizes(model: Any, block_size: int) -> Any:
    """``adapters.states.StateSizes`` of a hybrid model (bytes per state snapshot and per KV block), else None."""
    from kvshelf.adapters import states

    if not states.has_state_layers(model.config):
        return None
    return states.state_sizes(model.config, block_size=block_size, dtype=model.dtype)


def _device_name(device: Any) -> str:
    """``cpu``, or a CUDA device with its card's name (``cuda:0 (NVIDIA H200)``)."""
    if device.type != "cuda":
        return str(device)
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})"


def disk_worker(spec_path: str) -> None:
    """Run in a fresh process: only the LMDB tier, which holds the blocks written by the parent."""
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore.embedded import open_embedded_store
    from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = load_model(spec["model"], dtype=spec.get("dtype", "float32"), device=spec.get("device", "cpu"))
    if spec.get("xquant_tables"):
        from kvshelf.compress.xquant import bind_tables, load_tables

        bind_tables(load_tables(spec["xquant_tables"]))

    def open_store() -> Any:
        backend = spec.get("backend", "lmdb")
        if backend == "remote":
            from kvshelf.service.client import RemoteStore

            return RemoteStore(spec["address"], namespace=spec["namespace"], codec=spec["disk_codec"],
                               codec_params=spec.get("disk_codec_params"), shared_memory=False, timeout_s=600)
        if backend == "redis":
            return _redis_store(spec["redis_url"], spec["namespace"], spec["disk_codec"], spec.get("disk_codec_params"))
        return open_embedded_store(spec["data_dir"], memory_bytes=None, disk_codec=spec.get("disk_codec", "raw"),
                                   disk_codec_params=spec.get("disk_codec_params"),
                                   namespace=spec.get("namespace", DEFAULT_NAMESPACE))

    store = open_store()
    generator = CachedGenerator(model, tokenizer, store, block_size=spec["block_size"])
    _warm_up(generator)
    results = []
    for case in spec["prompts"]:
        # one untimed load of this context first: a process's first load of a size faults in its buffers (the
        # cache, the decode scratch, the forward's concatenation), ~0.3 s at 4,096 tokens, paid once per process
        generator.generate(case, max_new_tokens=1, reuse=True, store=False)
        if spec.get("backend", "lmdb") != "lmdb":  # the remote modes (and their warm-disk anchor, "disk")
            timed = _timed_runs(generator, case, spec["runs"], spec["new_tokens"], reuse=True, store=False)
            results.append({**timed, **_load_breakdown(generator, case)})
            continue
        if not spec.get("cold"):
            results.append(_timed_runs(generator, case, spec["runs"], spec["new_tokens"], reuse=True, store=False))
            continue
        calls = []
        for _ in range(spec["runs"]):  # each call on a store whose file is out of the page cache
            store.close()
            _drop_from_page_cache(Path(spec["data_dir"]))
            store = generator.store = open_store()
            calls.append(_timed_runs(generator, case, 1, spec["new_tokens"], reuse=True, store=False))
        results.append(_merged(calls))
    results_stats = store.stats()
    store.close()
    Path(spec["out"]).write_text(json.dumps({"results": results, "stats": results_stats}))


def _redis_store(url: str, namespace: str, codec: str, params: dict[str, Any] | None) -> Any:
    """A ``TieredStore`` (reads in ``namespace``) whose only tier is the Redis at ``url``, values in ``codec``."""
    from kvshelf.kvstore.redis_tier import RedisTier
    from kvshelf.kvstore.store import TieredStore, TierSpec

    tier = RedisTier.from_url(url, prefix="kvshelf-ttft:", socket_timeout=60)
    return TieredStore([TierSpec(tier, codec, dict(params or {}))], namespace=namespace)


def _load_breakdown(generator: Any, prompt: list[int], runs: int = 3) -> dict[str, Any]:
    """Where a warm load's time goes: ``fetch_s`` (the context's encoded blocks fetched, not decoded), ``load_s``
    (fetched and decoded into a cache: ``generator.load_prefix``, no forward pass), ``bytes`` (fetched); medians."""
    from kvshelf.kvstore.keys import prefix_block_keys

    keys = prefix_block_keys(generator.fingerprint, generator.namespace, prompt, generator.block_size)
    fetches, loads, nbytes = [], [], 0
    for _ in range(runs):
        start = time.perf_counter()
        values = generator.store.get_encoded_many(keys, namespace=generator.namespace)
        fetches.append(time.perf_counter() - start)
        nbytes = sum(len(v) for v in values if v is not None)
        del values
        start = time.perf_counter()
        generator.load_prefix(prompt)
        loads.append(time.perf_counter() - start)
    return {"fetch_s": median(fetches), "load_s": median(loads), "bytes": nbytes}


def _drop_from_page_cache(data_dir: Path) -> None:
    """Write back and drop the store's files from the page cache (they must not be open, or mapped pages stay)."""
    for path in sorted(data_dir.rglob("*.mdb")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(
    *,
    json_path: str | None,
    corpus: str | None,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    runs: int = 3,
    model_name: str = "smollm2-135m",
    block_size: int = 256,
    new_tokens: int = 16,
    console: Console | None = None,
    disk_codec: str = "raw",
    disk_codec_params: dict[str, Any] | None = None,
    rounds: int = 3,
    cold: bool = False,
    remote: bool = False,
    redis: bool = False,
    codecs: Sequence[tuple[str, dict[str, Any]]] = (),
    dtype: str = "float32",
    device: str = "cpu",
) -> dict[str, Any]:
    """The TTFT table (see the module); with ``remote`` and/or ``redis`` the remote modes replace the disk modes,
    for ``raw`` and each of ``codecs`` (``(name, params)``)."""
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore.embedded import open_embedded_store

    console = console or Console()
    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    texts = list(corpus_texts(corpus))
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    prompts = [build_context(tokenizer, texts, n) + question for n in lengths]
    results: list[dict[str, Any]] = []
    shown_params = dict(disk_codec_params or {})
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-") as tmp:
        codec_params, tables_path = _codec_params(model, tokenizer, corpus, disk_codec, shown_params, tmp)
        store = open_embedded_store(tmp, disk_codec=disk_codec, disk_codec_params=codec_params)
        generator = CachedGenerator(model, tokenizer, store, block_size=block_size)
        _warm_up(generator)
        measured: dict[tuple[int, str], dict] = {}
        for n, prompt in tqdm(list(zip(lengths, prompts, strict=True)), desc="full + warm-memory", unit="ctx"):
            # the first full run also stores the blocks (after its first token, so outside its TTFT)
            snapshots_before = generator.snapshot_stats["stored"]
            first = generator.generate(prompt, max_new_tokens=new_tokens, reuse=False, store=True, wait=True)
            rest = _timed_runs(generator, prompt, runs - 1, new_tokens, reuse=False, store=False)
            full = {
                "ttft_s": median([first.ttft_s, *rest["all_ttft_s"]]),
                "new_ids": [first.new_ids, *rest["new_ids"]],
                "reused_tokens": 0,
                "snapshots": generator.snapshot_stats["stored"] - snapshots_before,
            }
            measured[(n, "full")] = full
            measured[(n, "warm-memory")] = _timed_runs(generator, prompt, runs, new_tokens, reuse=True, store=False)
        if remote or redis:
            remote_rows = _remote_modes(
                model, tokenizer, store, generator.fingerprint, prompts, lengths, measured, tmp=tmp,
                model_name=model_name, corpus=corpus, block_size=block_size, runs=runs, new_tokens=new_tokens,
                rounds=rounds, modes=["disk", *(m for m, on in (("remote", remote), ("redis", redis)) if on)],
                codecs=codecs,
                console=console)
            store.close()
            return _finish_remote(remote_rows, measured, lengths, question, json_path, console, model_name=model_name,
                                  runs=runs, rounds=rounds, block_size=block_size, corpus=corpus)
        store.close()
        disk_mode = "cold-disk" if cold else "warm-disk"
        disk_runs = [(disk_mode, tmp, disk_codec)]
        if disk_codec != "raw":  # the anchor: the same contexts' blocks stored raw, in a store of their own
            raw_dir = str(Path(tmp) / "raw")
            raw_store = open_embedded_store(raw_dir, memory_bytes=None, disk_codec="raw")
            raw_generator = CachedGenerator(model, tokenizer, raw_store, block_size=block_size)
            for prompt in tqdm(prompts, desc="raw anchor blocks", unit="ctx"):
                raw_generator.generate(prompt, max_new_tokens=1, reuse=False, store=True, wait=True)
            raw_store.close()
            disk_runs.insert(0, (f"{disk_mode}-raw", raw_dir, "raw"))
        disk_calls: dict[tuple[int, str], list[dict]] = {}
        for round_index in range(rounds):
            order = disk_runs if round_index % 2 == 0 else disk_runs[::-1]
            for mode, data_dir, codec in order:
                console.print(f"[dim]round {round_index + 1}/{rounds}, {mode}: a fresh process with only the LMDB "
                              f"tier ({codec})...[/dim]")
                spec = Path(tmp) / f"spec-{mode}.json"
                out = Path(tmp) / f"disk-{mode}.json"
                spec.write_text(json.dumps({"model": model_name, "dtype": dtype, "device": device,
                                            "data_dir": data_dir, "block_size": block_size,
                                            "runs": runs, "new_tokens": new_tokens, "prompts": prompts,
                                            "out": str(out), "disk_codec": codec, "cold": cold,
                                            "disk_codec_params": codec_params if codec == disk_codec else None,
                                            "xquant_tables": tables_path if codec == "xquant" else None}))
                subprocess.run([sys.executable, "-m", "kvshelf.bench.ttft", "--worker", str(spec)], check=True,
                               env={**os.environ, "GLIBC_TUNABLES": WORKER_MALLOC})
                disk = json.loads(out.read_text())
                for n, result in zip(lengths, disk["results"], strict=True):
                    disk_calls.setdefault((n, mode), []).append(result)
        for key, parts in disk_calls.items():
            measured[key] = _merged(parts)
    modes = ["full", "warm-memory", *(mode for mode, _, _ in disk_runs)]
    sizes = _state_sizes(model, block_size)
    for n in lengths:
        reference = measured[(n, "full")]
        for mode in modes:
            m = measured[(n, mode)]
            row = {
                "tokens": n,
                "prompt_tokens": n + len(question),
                "mode": mode,
                "ttft_s": round(m["ttft_s"], 4),
                "speedup": round(reference["ttft_s"] / m["ttft_s"], 2),
                "same_output": all(ids == reference["new_ids"][0] for ids in m["new_ids"]),
                "reused_tokens": m["reused_tokens"],
            }
            if mode.startswith(disk_mode):
                row["disk_codec"] = "raw" if mode == f"{disk_mode}-raw" else disk_codec
                row["all_ttft_s"] = [round(t, 4) for t in m["all_ttft_s"]]
            if mode == disk_mode and (n, f"{disk_mode}-raw") in measured:
                row["vs_raw"] = round(measured[(n, f"{disk_mode}-raw")]["ttft_s"] / m["ttft_s"], 3)
            if mode == "full" and sizes is not None:  # what storing this prefix wrote beside its KV blocks
                row["snapshots"] = reference["snapshots"]
                row["snapshot_bytes"] = reference["snapshots"] * sizes.snapshot_bytes
                row["kv_bytes"] = (n + len(question)) // block_size * sizes.kv_bytes_per_block
            results.append(row)
    payload = {
        "model": model_name,
        "dtype": dtype,
        "device": _device_name(model.device),
        "machine": machine_description(),
        "runs": runs,
        "disk_rounds": rounds,
        "cold_disk": cold,
        "block_size": block_size,
        "disk_codec": disk_codec,
        "disk_codec_params": shown_params,
        "question_tokens": len(question),
        "disk_worker_env": {"GLIBC_TUNABLES": WORKER_MALLOC},
        "corpus": corpus or "synthetic (no corpus found)",
        "results": results,
    }
    _print_table(console, payload)
    save_results(json_path, payload, console)
    return payload


def codec_variants(codecs: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, codec, params)`` of the remote modes: ``raw`` first (the anchor), then each codec (a repeated
    codec gets ``-2``, ``-3``... in its label)."""
    out: list[tuple[str, str, dict[str, Any]]] = [("raw", "raw", {})]
    for codec, params in codecs:
        if codec == "raw" and not params:
            continue
        label, n = codec, 2
        while label in {taken for taken, _, _ in out}:
            label, n = f"{codec}-{n}", n + 1
        out.append((label, codec, dict(params)))
    return out


def _rekeyed(store: Any, fingerprint: str, prompts: list[list[int]], block_size: int,
             namespace: str) -> list[tuple[bytes, Any]]:
    """The contexts' blocks the full prefill stored in ``store``, as blocks of ``namespace`` under its keys."""
    import dataclasses

    from kvshelf.kvstore.keys import prefix_block_spans

    entries: dict[bytes, Any] = {}
    for prompt in prompts:
        source = prefix_block_spans(fingerprint, store.namespace, prompt, block_size)
        target = prefix_block_spans(fingerprint, namespace, prompt, block_size)
        blocks = store.get_many([span.key for span in source], fingerprint=fingerprint)
        for span, block in zip(target, blocks, strict=True):
            if block is None:
                raise RuntimeError(f"block at tokens {span.start}-{span.end} missing from the bench's store")
            entries[span.key] = dataclasses.replace(block, namespace=namespace)
    return list(entries.items())


def _remote_modes(model: Any, tokenizer: Any, store: Any, fingerprint: str, prompts: list[list[int]],
                  lengths: tuple[int, ...], measured: dict, *, tmp: str, model_name: str, corpus: str | None,
                  block_size: int, runs: int, new_tokens: int, rounds: int, modes: list[str],
                  codecs: Sequence[tuple[str, dict[str, Any]]], console: Console) -> list[dict[str, Any]]:
    """Fill the blocks in a ``kvshelf serve`` and/or a Redis per codec, time the fresh worker processes in rounds;
    return one description per ``(mode, variant)`` (its measurements are added to ``measured``)."""
    from contextlib import ExitStack

    from kvshelf.bench.servers import kvshelf_server, redis_server
    from kvshelf.kvstore.embedded import open_embedded_store
    from kvshelf.service.client import RemoteStore

    variants = []
    for label, codec, params in codec_variants(codecs):
        bound, tables = _codec_params(model, tokenizer, corpus, codec, params, tmp, label=label)
        variants.append({"label": label, "codec": codec, "params": params, "bound": bound or {}, "tables": tables,
                         "namespace": f"ttft-{label}"})
    described = []
    with ExitStack() as stack:
        backends: dict[str, dict[str, Any]] = {}
        if "disk" in modes:
            backends["disk"] = {"data_dir": str(Path(tmp) / "disk")}
        if "remote" in modes:
            address = stack.enter_context(kvshelf_server(str(Path(tmp) / "served")))
            backends["remote"] = {"address": address}
        if "redis" in modes:
            server = stack.enter_context(redis_server("8gb"))
            backends["redis"] = {"redis_url": server.url}
        for v in tqdm(variants, desc="blocks per codec", unit="codec"):
            entries = _rekeyed(store, fingerprint, prompts, block_size, v["namespace"])
            for mode, where in backends.items():
                if mode == "disk":
                    target = open_embedded_store(where["data_dir"], memory_bytes=None, disk_codec=v["codec"],
                                                 disk_codec_params=v["bound"], namespace=v["namespace"])
                elif mode == "remote":
                    target = RemoteStore(where["address"], namespace=v["namespace"], codec=v["codec"],
                                         codec_params=v["bound"], shared_memory=False, timeout_s=600)
                else:
                    target = _redis_store(where["redis_url"], v["namespace"], v["codec"], v["bound"])
                try:
                    for i in range(0, len(entries), 4):  # a few blocks per call: bounded memory
                        if target.put_many(entries[i : i + 4]) != len(entries[i : i + 4]):
                            raise RuntimeError(f"{mode}: the store refused blocks of codec {v['label']}")
                finally:
                    target.close()
            del entries
        calls: dict[tuple[int, str, str], list[dict]] = {}
        for round_index in range(rounds):
            order = variants if round_index % 2 == 0 else variants[::-1]
            for v in order:
                for mode, where in backends.items():
                    console.print(f"[dim]round {round_index + 1}/{rounds}, {REMOTE_MODES[mode]} {v['label']}: a "
                                  "fresh process...[/dim]")
                    spec = Path(tmp) / f"spec-{mode}-{v['label']}.json"
                    out = Path(tmp) / f"out-{mode}-{v['label']}.json"
                    spec.write_text(json.dumps({
                        "model": model_name, "backend": mode, **where, "namespace": v["namespace"],
                        "block_size": block_size, "runs": runs, "new_tokens": new_tokens, "prompts": prompts,
                        "out": str(out), "disk_codec": v["codec"], "disk_codec_params": v["bound"],
                        "xquant_tables": v["tables"]}))
                    subprocess.run([sys.executable, "-m", "kvshelf.bench.ttft", "--worker", str(spec)], check=True,
                                   env={**os.environ, "GLIBC_TUNABLES": WORKER_MALLOC})
                    result = json.loads(out.read_text())
                    for n, part in zip(lengths, result["results"], strict=True):
                        calls.setdefault((n, mode, v["label"]), []).append(part)
    for (n, mode, label), parts in calls.items():
        merged = _merged(parts)
        for field in ("fetch_s", "load_s"):
            merged[field] = median([p[field] for p in parts])
        merged["bytes"] = parts[-1]["bytes"]
        measured[(n, REMOTE_MODES[mode], label)] = merged
    for mode in modes:
        for v in variants:
            described.append({"mode": REMOTE_MODES[mode], "label": v["label"], "codec": v["codec"],
                              "params": v["params"]})
    return described


def _finish_remote(described: list[dict[str, Any]], measured: dict, lengths: tuple[int, ...], question: list[int],
                   json_path: str | None, console: Console, *, model_name: str, runs: int, rounds: int,
                   block_size: int, corpus: str | None) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for n in lengths:
        reference = measured[(n, "full")]
        for mode in ("full", "warm-memory"):
            m = measured[(n, mode)]
            results.append({"tokens": n, "prompt_tokens": n + len(question), "mode": mode, "codec": "raw",
                            "ttft_s": round(m["ttft_s"], 4), "speedup": round(reference["ttft_s"] / m["ttft_s"], 2),
                            "same_output": all(ids == reference["new_ids"][0] for ids in m["new_ids"]),
                            "reused_tokens": m["reused_tokens"]})
        for d in described:
            m = measured[(n, d["mode"], d["label"])]
            raw = measured[(n, d["mode"], "raw")]
            disk = measured.get((n, "warm-disk", d["label"]))
            results.append({
                "tokens": n, "prompt_tokens": n + len(question), "mode": d["mode"], "codec": d["codec"],
                "codec_params": d["params"], "ttft_s": round(m["ttft_s"], 4),
                "speedup": round(reference["ttft_s"] / m["ttft_s"], 2),
                "vs_raw": round(raw["ttft_s"] / m["ttft_s"], 3),
                # this mode's TTFT over warm-disk's, same codec, same rounds (1.0 for warm-disk itself)
                "vs_warm_disk": round(m["ttft_s"] / disk["ttft_s"], 3) if disk else None,
                "same_output": all(ids == reference["new_ids"][0] for ids in m["new_ids"]),
                "lossy": d["codec"] not in LOSSLESS,
                "dppl_rel": codec_dppl_rel(d["codec"], d["params"]),
                "bytes": m["bytes"], "fetch_s": round(m["fetch_s"], 4), "load_s": round(m["load_s"], 4),
                "reused_tokens": m["reused_tokens"], "all_ttft_s": [round(t, 4) for t in m["all_ttft_s"]],
            })
    payload = {
        "model": model_name,
        "machine": machine_description(),
        "runs": runs,
        "rounds": rounds,
        "block_size": block_size,
        "question_tokens": len(question),
        "disk_store": "warm-disk: a local LMDB (no memory tier) read by a fresh worker process, in the same rounds",
        "remote_server": "kvshelf serve in another process (bench.servers.kvshelf_server: 4 GiB memory tier over "
                         "LMDB, tiers keep blocks as sent), RemoteStore(shared_memory=False): the gRPC wire path",
        "redis_server": "redis-server (bench.servers.redis_server, maxmemory 8gb), the only tier of a TieredStore",
        "worker_env": {"GLIBC_TUNABLES": WORKER_MALLOC},
        "dppl_source": str(CODECS_RESULTS.relative_to(CODECS_RESULTS.parents[2])),
        "corpus": corpus or "synthetic (no corpus found)",
        "results": results,
    }
    _print_table(console, payload)
    save_results(json_path, payload, console)
    return payload


def _codec_key(codec: str, params: dict[str, Any]) -> tuple[str, str] | None:
    """A codec's parameters with its defaults filled in (xquant: without its tables' digest, with its basis)."""
    from kvshelf.kvstore.codec import get_codec
    from kvshelf.kvstore.errors import KVShelfError

    try:
        full = get_codec(codec, {k: v for k, v in params.items() if k not in ("model", "basis")}).params()
    except KVShelfError:
        return None
    full.pop("model", None)
    if codec == "xquant":
        full["basis"] = params.get("basis", "klt")
    return codec, json.dumps(full, sort_keys=True)


def codec_dppl_rel(codec: str, params: dict[str, Any], results: Path = CODECS_RESULTS) -> float | None:
    """The relative perplexity increase ``kvshelf bench codecs`` measured for ``codec`` with ``params`` (saved in
    ``results``); 0 for ``raw``; None when it measured no such setting."""
    if codec == "raw":
        return 0.0
    try:
        rows = json.loads(results.read_text())["results"]
    except (OSError, ValueError, KeyError):
        return None
    want = _codec_key(codec, params)
    for row in rows:
        if row.get("codec") == codec and want is not None and _codec_key(codec, row.get("params") or {}) == want:
            return row.get("dppl_rel")
    return None


def _print_table(console: Console, payload: dict[str, Any]) -> None:
    console.print(results_table(payload), width=max(console.width, 130))
    for r in payload["results"]:
        if "snapshots" in r:
            console.print(f"  {r['tokens']} tokens: stored {r['snapshots']} state snapshots "
                          f"({r['snapshot_bytes'] / 1e6:.1f} MB) beside {r['kv_bytes'] / 1e6:.1f} MB of KV blocks")


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    if "disk_rounds" in payload:
        rounds = payload["disk_rounds"]
        disk = "cold" if payload.get("cold_disk") else "warm"
        title = (f"TTFT, {payload['model']}, disk codec {payload.get('disk_codec', 'raw')}, median of "
                 f"{payload['runs']} ({disk}-disk: {payload['runs'] * rounds} in {rounds} fresh processes) "
                 f"({payload['machine']})")
    else:
        rounds = payload["rounds"]
        title = (f"TTFT, {payload['model']}, remote reuse, median of {payload['runs']} (remote modes: "
                 f"{payload['runs'] * rounds} in {rounds} fresh processes) ({payload['machine']})")
    table = Table(title=title)
    by_disk = any(r.get("vs_warm_disk") is not None for r in payload["results"])
    columns = ("context tokens", "mode", "codec", "TTFT (s)", "speedup vs full", "vs raw",
               *(("TTFT / warm-disk's",) if by_disk else ()), "MB loaded", "fetch (s)", "load (s)", "Δppl",
               "reused tokens", "same output")
    for column in columns:
        table.add_column(column, justify="right")
    for r in payload["results"]:
        codec = r.get("codec", r.get("disk_codec", "-"))
        if r.get("codec_params"):
            codec += " " + ", ".join(f"{k}={v}" for k, v in r["codec_params"].items())
        same = "yes" if r["same_output"] else "no (lossy)" if r.get("lossy") else "NO"
        dppl = r.get("dppl_rel")
        vs_disk = r.get("vs_warm_disk")
        by_disk_cell = [f"{vs_disk:.2f}x" if vs_disk is not None else "-"] if by_disk else []
        table.add_row(str(r["tokens"]), r["mode"], codec, f"{r['ttft_s']:.3f}",
                      f"{r['speedup']:.1f}x", f"{r['vs_raw']:.2f}x" if "vs_raw" in r else "-", *by_disk_cell,
                      f"{r['bytes'] / 1e6:.1f}" if "bytes" in r else "-",
                      f"{r['fetch_s']:.3f}" if "fetch_s" in r else "-", f"{r['load_s']:.3f}" if "load_s" in r else "-",
                      f"{100 * dppl:+.2f}%" if dppl is not None else "-", str(r["reused_tokens"]), same)
    return table


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        disk_worker(sys.argv[2])
    else:
        raise SystemExit("run this benchmark with `kvshelf bench ttft`")
