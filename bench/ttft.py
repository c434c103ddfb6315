"""``kvshelf bench ttft``: time to first token with full prefill vs. reuse from memory and from disk.

For contexts of 1,024 / 2,048 / 4,096 tokens from the corpus plus a ~32-token question:

* ``full``: no reuse, the whole prompt is prefilled (the anchor);
* ``warm-memory``: the context's blocks are in the embedded store's memory tier;
* ``warm-disk``: a fresh process whose store has only the LMDB tier holding the blocks, encoded with the disk
  codec (``--codec``, default ``raw``), timed after one untimed load of the same context (as the parent's modes
  run after earlier calls);
* ``warm-disk-raw`` (with a disk codec other than ``raw``): the anchor of ``warm-disk`` in the same run, a fresh
  process reading the same blocks stored ``raw`` in an LMDB store of their own; ``vs_raw`` is its TTFT over the
  codec's (above 1: the codec is faster).

With ``cold=True`` (``--cold``) these two modes are ``cold-disk`` and ``cold-disk-raw``: before each timed call the
process closes its store, drops the LMDB file from the operating system's page cache (``posix_fadvise``
``DONTNEED``) and reopens the store, so the blocks are read from the disk itself: where a compressed tier saves
reading time.

The disk-mode processes run in ``rounds`` (default 3), the two disk modes alternating (raw first in even rounds,
the codec first in odd ones), each a fresh process timing ``runs`` calls; their TTFT is the median of all
``rounds * runs`` calls, so a slow spell of a shared machine weighs on both alike.

Codec parameters go with ``--codec-params JSON``. ``xquant`` needs the model's tables: they are computed on
calibration text (the corpus's end, as ``bench codecs`` does), saved to a safetensors file, and loaded by the
warm-disk process before its timed runs, as a server loads them once at start beside the weights.

The disk-mode processes run with glibc's malloc thresholds fixed (``WORKER_MALLOC``): large freed blocks are
kept and reused instead of returned to the system. Without it, glibc's dynamic mmap threshold decides per process
whether the ~190 MB a raw 4,096-token read copies out of LMDB land in recycled memory or in freshly faulted pages
(measured: raw loads of ~30 ms in some processes, 60-100 ms in others), and the comparison measured the
allocator's mood rather than the codecs.

Each mode's TTFT is the median of ``runs`` calls; ``same_output`` compares 16 greedy tokens with ``full``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench.common import corpus_texts, machine_description, median, save_results

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
                  ) -> tuple[dict[str, Any] | None, str | None]:
    """The disk codec's parameters, and for ``xquant`` the file of the model tables they need (else None)."""
    if codec != "xquant":
        return (params or None), None
    from kvshelf.adapters.xquant import xquant_params
    from kvshelf.bench.codecs import xquant_calibration
    from kvshelf.compress.xquant import bound_tables, save_tables

    rest = {k: v for k, v in params.items() if k != "basis"}
    bound = xquant_params(model, xquant_calibration(tokenizer, corpus), basis=params.get("basis", "klt"), **rest)
    tables_path = str(Path(tmp) / "xquant-tables.safetensors")
    save_tables(bound_tables(bound["model"]), tables_path)
    return bound, tables_path


def disk_worker(spec_path: str) -> None:
    """Run in a fresh process: only the LMDB tier, which holds the blocks written by the parent."""
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore.embedded import open_embedded_store

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = load_model(spec["model"])
    if spec.get("xquant_tables"):
        from kvshelf.compress.xquant import bind_tables, load_tables

        bind_tables(load_tables(spec["xquant_tables"]))

    def open_store() -> Any:
        return open_embedded_store(spec["data_dir"], memory_bytes=None, disk_codec=spec.get("disk_codec", "raw"),
                                   disk_codec_params=spec.get("disk_codec_params"))

    store = open_store()
    generator = CachedGenerator(model, tokenizer, store, block_size=spec["block_size"])
    _warm_up(generator)
    results = []
    for case in spec["prompts"]:
        # one untimed load of this context first: a process's first load of a size faults in its buffers (the
        # cache, the decode scratch, the forward's concatenation), ~0.3 s at 4,096 tokens, paid once per process
        generator.generate(case, max_new_tokens=1, reuse=True, store=False)
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
) -> dict[str, Any]:
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore.embedded import open_embedded_store

    console = console or Console()
    model, tokenizer = load_model(model_name)
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
            first = generator.generate(prompt, max_new_tokens=new_tokens, reuse=False, store=True, wait=True)
            rest = _timed_runs(generator, prompt, runs - 1, new_tokens, reuse=False, store=False)
            full = {
                "ttft_s": median([first.ttft_s, *rest["all_ttft_s"]]),
                "new_ids": [first.new_ids, *rest["new_ids"]],
                "reused_tokens": 0,
            }
            measured[(n, "full")] = full
            measured[(n, "warm-memory")] = _timed_runs(generator, prompt, runs, new_tokens, reuse=True, store=False)
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
                spec.write_text(json.dumps({"model": model_name, "data_dir": data_dir, "block_size": block_size,
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
            results.append(row)
    payload = {
        "model": model_name,
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


def _print_table(console: Console, payload: dict[str, Any]) -> None:
    rounds = payload.get("disk_rounds", 1)
    disk = "cold" if payload.get("cold_disk") else "warm"
    table = Table(title=f"TTFT, {payload['model']}, disk codec {payload.get('disk_codec', 'raw')}, median of "
                        f"{payload['runs']} ({disk}-disk: {payload['runs'] * rounds} in {rounds} fresh processes) "
                        f"({payload['machine']})")
    for column in ("context tokens", "mode", "disk codec", "TTFT (s)", "speedup vs full", "vs raw disk",
                   "reused tokens", "same output"):
        table.add_column(column, justify="right")
    for r in payload["results"]:
        table.add_row(str(r["tokens"]), r["mode"], r.get("disk_codec", "-"), f"{r['ttft_s']:.3f}",
                      f"{r['speedup']:.1f}x", f"{r['vs_raw']:.2f}x" if "vs_raw" in r else "-",
                      str(r["reused_tokens"]), "yes" if r["same_output"] else "NO")
    console.print(table, width=max(console.width, 130))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        disk_worker(sys.argv[2])
    else:
        raise SystemExit("run this benchmark with `kvshelf bench ttft`")
