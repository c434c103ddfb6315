"""The benchmarks that run a model: ``kvshelf bench ttft | rag | rag-chain | serve | pruning | longctx | codecs | mla |
gpu | vllm``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import ModelOpt, check_device, console, corpus_path, ints, json_object


def bench_ttft(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}")] = None,
    lengths: Annotated[str, typer.Option(help="comma-separated context lengths")] = "1024,2048,4096",
    runs: Annotated[int, typer.Option(min=1, help="runs per mode (median reported)")] = 3,
    model: ModelOpt = "smollm2-135m",
    block_size: Annotated[int, typer.Option(min=1)] = 256,
    codec: Annotated[list[str] | None, typer.Option(
        help="codec of the disk tier (warm-disk reads it; default raw); with --remote/--redis: the codecs to "
             "compare with raw (repeatable or comma-separated, e.g. int8,xquant,cachegen)")] = None,
    codec_params: Annotated[str | None, typer.Option(
        help='the codec\'s parameters as JSON, e.g. \'{"step": 0.45}\' (xquant also takes "basis"); with several '
             'codecs an object by codec, e.g. \'{"xquant": {"step": 0.35}, "cachegen": {"bits": 4}}\'')] = None,
    rounds: Annotated[int, typer.Option(
        min=1, help="fresh processes per disk (or remote) mode, alternating raw and the codec(s)")] = 3,
    cold: Annotated[bool, typer.Option(
        "--cold", help="cold-disk instead of warm-disk: the LMDB file is dropped from the page cache before each "
                       "timed call")] = False,
    remote: Annotated[bool, typer.Option(
        "--remote", help="warm-remote instead of the disk modes: blocks loaded over the gRPC wire from a `kvshelf "
                         "serve` in another process (no shared memory), raw and each --codec")] = False,
    redis: Annotated[bool, typer.Option(
        "--redis", help="warm-redis instead of the disk modes: a store whose only tier is a real redis-server, raw "
                        "and each --codec")] = False,
    dtype: Annotated[str, typer.Option(help="the model's dtype: float32, bfloat16, float16")] = "float32",
    device: Annotated[str, typer.Option(help="the model's device: cpu, cuda, cuda:N")] = "cpu",
) -> None:
    """TTFT of full prefill vs warm-memory vs warm-disk (or warm-remote / warm-redis) reuse, with same-output
    checks."""
    from kvshelf.kvstore.errors import KVShelfError

    if cold and (remote or redis):
        raise KVShelfError("--cold is a disk mode: it does not go with --remote/--redis")
    names, chosen_params = _ttft_codecs(codec, codec_params, remote or redis)
    remote_modes = remote or redis  # the codecs go to the remote modes; the bench's own store stays raw
    disk, params = ("raw", {}) if remote_modes else (names[0], chosen_params[0])
    chosen = corpus_path(corpus)
    parsed = ints(lengths, "--lengths")
    check_device(device, dtype)
    if any(n < block_size for n in parsed):
        raise KVShelfError(f"every length must be >= the block size {block_size}: {parsed}")
    from kvshelf.bench.ttft import run  # transformers and the model after the options are checked

    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None,
        lengths=parsed, runs=runs, model_name=model, block_size=block_size, console=console, disk_codec=disk,
        disk_codec_params=params, rounds=rounds, cold=cold, remote=remote, redis=redis,
        codecs=list(zip(names, chosen_params, strict=True)), dtype=dtype, device=device)


def _ttft_codecs(codec: list[str] | None, codec_params: str | None,
                 remote_modes: bool) -> tuple[list[str], list[dict]]:
    """``bench ttft``'s codecs and each one's parameters from ``--codec`` and ``--codec-params``, every one checked
    by the codec registry (an unknown codec or parameter is a clear error before the model loads)."""
    from kvshelf.kvstore.codec import get_codec
    from kvshelf.kvstore.errors import KVShelfError

    names = [name.strip() for value in (codec or ["raw"]) for name in value.split(",") if name.strip()] or ["raw"]
    if len(names) > 1 and not remote_modes:
        raise KVShelfError(f"several codecs ({', '.join(names)}) need --remote or --redis (the disk modes take one)")
    raw_params = json_object(codec_params, "--codec-params")
    keyed = len(names) > 1 or (bool(raw_params) and set(raw_params) <= set(names)
                               and all(isinstance(v, dict) for v in raw_params.values()))
    if keyed and set(raw_params) - set(names):
        raise KVShelfError(f"--codec-params: {sorted(set(raw_params) - set(names))} are not among the codecs "
                           f"{names}; with several codecs give an object by codec name")
    chosen_params = [dict(raw_params.get(name, {})) if keyed else dict(raw_params) for name in names]
    for name, params in zip(names, chosen_params, strict=True):
        if not isinstance(params, dict):
            raise KVShelfError(f"--codec-params: the parameters of {name} must be a JSON object")
        # xquant's "basis" is the adapter's parameter, not the codec's
        get_codec(name, {k: v for k, v in params.items() if not (name == "xquant" and k == "basis")})
    return names, chosen_params


def bench_rag(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}")] = None,
    cases: Annotated[int, typer.Option(min=1, help="needle QA cases")] = 40,
    runs: Annotated[int, typer.Option(min=1, help="runs per TTFT measurement (median)")] = 3,
    model: ModelOpt = "smollm2-135m",
) -> None:
    """Needle QA over 8 retrieved chunks: full vs reuse vs reuse-blend vs block attention; TTFT at 8x512."""
    from kvshelf.bench.rag import run

    chosen = corpus_path(corpus)
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, cases=cases,
        runs=runs, model_name=model, console=console)


def bench_rag_chain(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}")] = None,
    cases: Annotated[int, typer.Option(min=1, help="planted-fact questions (8 chunks each)")] = 20,
    mode: Annotated[list[str] | None, typer.Option(
        help="kvshelf's RAG mode, a row each (repeatable): full, reuse, reuse-blend, block-attention (default: the "
             "chat model's)")] = None,
    model: ModelOpt = "smollm2-135m",
    recompute_ratio: Annotated[float | None, typer.Option(
        help="reuse-blend's share of chunk tokens recomputed (CacheBlend's r; default 0.15)")] = None,
) -> None:
    """One LangChain RAG chain: LangChain's HuggingFace chat model vs kvshelf's; TTFT p50 and accuracy."""
    from kvshelf.bench.rag_chain import run
    from kvshelf.kvstore.errors import KVShelfError

    known = ("full", "reuse", "reuse-blend", "block-attention")
    unknown = sorted(set(mode or ()) - set(known))
    if unknown:
        raise KVShelfError(f"--mode: unknown {unknown}; use one of {', '.join(known)}")
    chosen = corpus_path(corpus)
    if recompute_ratio is not None:
        from kvshelf.reuse.blend import check_ratio

        check_ratio(recompute_ratio)
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, cases=cases,
        modes=mode, model_name=model, console=console, recompute_ratio=recompute_ratio)


def bench_serve(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}")] = None,
    seconds: Annotated[float, typer.Option(min=1, help="length of each system's run")] = 120,
    clients: Annotated[int, typer.Option(min=1, max=64, help="client threads (even: chat, odd: RAG)")] = 4,
    threads: Annotated[int, typer.Option(min=1, help="torch intra-op threads (both systems)")] = 1,
    turns: Annotated[int, typer.Option(min=0, help="chat-turns measurement: turns (0: skip it)")] = 8,
    pool: Annotated[int, typer.Option(min=7, help="plain chunks in the RAG pool (needle chunks: half)")] = 64,
    precompute_documents: Annotated[bool, typer.Option(
        help="kvshelf stores the chat documents' prompt heads before the run (else first turns are cold)")] = True,
    model: ModelOpt = "smollm2-135m",
) -> None:
    """Serving run, plain HF generate vs kvshelf: chat and RAG clients; requests/s, TTFT p50/p99, accuracy."""
    from kvshelf.bench.serve import run

    chosen = corpus_path(corpus)
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, seconds=seconds,
        clients=clients, threads=threads, turns=turns, pool=pool, precompute_documents=precompute_documents,
        model_name=model, console=console)


def bench_pruning(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}")] = None,
    cases: Annotated[int, typer.Option(min=1, help="needle QA cases (~1,300-token contexts)")] = 40,
    windows: Annotated[int, typer.Option(min=1, help="2,048-token perplexity windows")] = 8,
    kvpress: Annotated[bool, typer.Option(help="run NVIDIA kvpress in its own virtualenv as the anchor")] = True,
    kvpress_venv: Annotated[Path | None, typer.Option(
        help="kvpress's virtualenv, created on first use (default: $KVSHELF_KVPRESS_VENV, else venv-kvpress under "
             "$KVSHELF_CACHE)")] = None,
    methods: Annotated[str | None, typer.Option(
        help="comma-separated kvshelf methods to run (default: all); full and the kvpress presses always run")] = None,
    model: ModelOpt = "smollm2-135m",
) -> None:
    """Needle accuracy, perplexity increase, KV bytes and decode speed of each pruning method vs kvpress."""
    from kvshelf.bench.pruning import STATIC, run
    from kvshelf.kvstore.errors import KVShelfError

    chosen = corpus_path(corpus)
    only = None
    if methods is not None:
        only = tuple(m.strip() for m in methods.split(",") if m.strip())
        unknown = sorted(set(only) - {*STATIC, "tokenselect"})
        if unknown or not only:
            known = ", ".join((*STATIC, "tokenselect"))
            raise KVShelfError(f"--methods: unknown {unknown or methods!r}; known: {known}")
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, cases=cases,
        windows=windows, model_name=model, kvpress=kvpress, kvpress_venv=str(kvpress_venv) if kvpress_venv else None,
        methods=only, console=console)


def bench_longctx(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}: the haystack")] = None,
    tasks: Annotated[str | None, typer.Option(
        help="comma-separated: niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, fwe, qa, ppl "
             "(default: the eight RULER tasks; with neither --tasks nor --lengths: every task at 4K, the needle "
             "tasks and ppl at 8K)")] = None,
    lengths: Annotated[str | None, typer.Option(
        help="comma-separated lengths in tokens, 256 to 8192 (default 4096)")] = None,
    methods: Annotated[str | None, typer.Option(
        help="comma-separated kvshelf methods (default: all); full and the kvpress presses always run")] = None,
    budgets: Annotated[str, typer.Option(help="comma-separated fractions of the context's KV kept")] = "0.25,0.125",
    samples: Annotated[int, typer.Option(min=1, help="samples per task and length")] = 1,
    new_tokens: Annotated[int | None, typer.Option(
        min=1, help="greedy tokens per answer (default: each task's own)")] = None,
    kvpress: Annotated[bool, typer.Option(help="run NVIDIA kvpress's presses in their own virtualenv")] = True,
    kvpress_venv: Annotated[Path | None, typer.Option(
        help="kvpress's virtualenv, created on first use (default: $KVSHELF_KVPRESS_VENV, else venv-kvpress under "
             "$KVSHELF_CACHE)")] = None,
    model: ModelOpt = "smollm2-135m",
) -> None:
    """RULER-style long-context accuracy (needles, variable tracking, word extraction, QA, perplexity) of every
    pruning and selection method, kvpress, fastkv and tier-sparse against the fraction of KV kept."""
    import sys

    from kvshelf.bench.longctx import check_plan, plan_of, run
    from kvshelf.kvstore.errors import KVShelfError

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())

    try:
        chosen_budgets = tuple(float(b) for b in budgets.split(","))
    except ValueError:
        raise KVShelfError(f"--budgets must be comma-separated fractions, got {budgets!r}") from None
    chosen_tasks, chosen_methods = names(tasks), names(methods)
    chosen_lengths = ints(lengths, "--lengths") if lengths is not None else None
    check_plan(plan_of(chosen_tasks, chosen_lengths), chosen_budgets, samples, chosen_methods)
    chosen = corpus_path(corpus)
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, tasks=chosen_tasks,
        lengths=chosen_lengths, methods=chosen_methods, budgets=chosen_budgets, samples=samples,
        new_tokens=new_tokens, kvpress=kvpress, kvpress_venv=str(kvpress_venv) if kvpress_venv else None,
        model_name=model, command="kvshelf bench longctx " + " ".join(sys.argv[3:]), console=console)


def bench_codecs(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}")] = None,
    windows: Annotated[int, typer.Option(min=1, help="2,048-token perplexity windows")] = 8,
    anchors: Annotated[bool, typer.Option(help="also measure HF QuantizedCache (quanto/HQQ)")] = True,
    only: Annotated[list[str] | None, typer.Option("--only", help="only this codec's settings (repeatable)")] = None,
    model: ModelOpt = "smollm2-135m",
) -> None:
    """Compression ratio, bits per value, encode/decode MB/s and perplexity increase of every codec."""
    from kvshelf.bench.codecs import run

    chosen = corpus_path(corpus)
    run(str(json_path) if json_path else None, str(chosen) if chosen else None, windows=windows,
        model_name=model, anchors=anchors, only=only, console=console)


def bench_mla(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    shape: Annotated[str, typer.Option(help="a shaped MLA model (adapters.shaped)")] = "deepseek-v3-shaped",
    tokens: Annotated[int, typer.Option(min=1, max=65536, help="tokens in the block")] = 256,
    codecs: Annotated[str, typer.Option(help="comma-separated codecs")] = "raw,fp16,bf16,zstd,int8",
    dtype: Annotated[str, typer.Option(help="the block's dtype")] = "bfloat16",
) -> None:
    """Bytes of an MLA block (the latent transformers caches) against the expanded keys and values it stands for."""
    from kvshelf.bench.mla import run
    from kvshelf.kvstore.errors import KVShelfError

    chosen = tuple(c.strip() for c in codecs.split(",") if c.strip())
    if not chosen:
        raise KVShelfError("--codecs names no codec")
    run(json_path=str(json_path) if json_path else None, shape=shape, tokens=tokens, codecs=chosen, dtype=dtype,
        console=console)



def bench_gpu(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    models: Annotated[str, typer.Option(help="comma-separated models (shaped: adapters.shaped)")] =
        "llama3-8b-shaped,qwen3.5-0.8b-shaped,smollm2-135m-shaped",
    lengths: Annotated[str, typer.Option(help="comma-separated context lengths")] = "4096,16384,32768",
    codecs: Annotated[str, typer.Option(help="comma-separated codecs of the CPU, LMDB and remote tiers")] =
        "raw,int8,xquant",
    modes: Annotated[str, typer.Option(help="comma-separated: full (always), warm-gpu, warm-cpu, warm-lmdb, "
                                            "warm-remote")] = "full,warm-gpu,warm-cpu,warm-lmdb,warm-remote",
    runs: Annotated[int, typer.Option(min=1, help="runs per row (median reported)")] = 3,
    device: Annotated[str, typer.Option(help="cuda, cuda:N, or cpu (the same code on the CPU)")] = "cuda",
    dtype: Annotated[str, typer.Option(help="the models' dtype: bfloat16, float16, float32")] = "bfloat16",
    gpu_bytes: Annotated[str, typer.Option(help="the GPU tier's capacity")] = "16GiB",
    memory_bytes: Annotated[str, typer.Option(help="the pinned CPU tier's capacity (per codec)")] = "24GiB",
    remote_max_tokens: Annotated[int, typer.Option(
        min=0, help="warm-remote only for contexts up to this many tokens (the gRPC wire moves ~1 GB/s)")] = 8192,
    codec_max_tokens: Annotated[int | None, typer.Option(
        min=1, help="codecs after the first only for contexts up to this many tokens (their CPU encode is slow)")] =
        None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract} (xquant's calibration text)")] =
        None,
) -> None:
    """TTFT on a GPU: full prefill vs warm loads from the GPU tier, the pinned CPU tier, LMDB and a remote kvshelf
    serve, per codec; host-to-device GB/s against the card's copy bandwidth; codec decode GB/s on the GPU.
    Without CUDA: one line, exit 0."""
    from kvshelf.bench.gpu import MODES, cuda_missing, run
    from kvshelf.kvstore.codec import get_codec
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.kvstore.sizes import parse_size

    if cuda_missing(device):
        console.print(cuda_missing(device))
        return
    names = [m.strip() for m in models.split(",") if m.strip()]
    chosen_codecs = [c.strip() for c in codecs.split(",") if c.strip()]
    chosen_modes = [m.strip() for m in modes.split(",") if m.strip()]
    if not names or not chosen_codecs:
        raise KVShelfError("--models and --codecs each need at least one name")
    unknown = sorted(set(chosen_modes) - set(MODES))
    if unknown:
        raise KVShelfError(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    for codec in chosen_codecs:  # an unknown codec is a clear error before a model loads
        get_codec(codec)
    check_device(device, dtype)
    chosen = corpus_path(corpus)
    run(json_path=str(json_path) if json_path else None, models=names, lengths=ints(lengths, "--lengths"),
        codecs=chosen_codecs, modes=chosen_modes, runs=runs, device=device, dtype=dtype,
        gpu_bytes=parse_size(gpu_bytes, "--gpu-bytes"), memory_bytes=parse_size(memory_bytes, "--memory-bytes"),
        remote_max_tokens=remote_max_tokens, codec_max_tokens=codec_max_tokens, corpus=str(chosen) if chosen else None,
        console=console)


def bench_vllm(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}: the documents")] = None,
    systems: Annotated[str, typer.Option(
        help="comma-separated: vllm, kvshelf, kvshelf-serve, lmcache")] = "vllm,kvshelf,kvshelf-serve,lmcache",
    lengths: Annotated[str, typer.Option(help="comma-separated TTFT document lengths (multiples of 128)")] =
        "1024,4096",
    ttft_docs: Annotated[int, typer.Option(help="documents per TTFT length")] = 2,
    qa_docs: Annotated[int, typer.Option(help="long_doc_qa: documents")] = 8,
    qa_tokens: Annotated[int, typer.Option(help="long_doc_qa: tokens per document (a multiple of 128)")] = 2048,
    questions: Annotated[int, typer.Option(help="long_doc_qa: questions per document in the query round")] = 2,
    max_tokens: Annotated[int, typer.Option(help="greedy output tokens per request")] = 16,
    kv_blocks: Annotated[int, typer.Option(
        help="vLLM's KV space in 128-token pages (num_gpu_blocks_override): less than the long_doc_qa documents")] =
        48,
    vllm_venv: Annotated[Path | None, typer.Option(
        help="the venv with vLLM and kvshelf (default: $KVSHELF_VLLM_VENV, else .venv-vllm: `make vllm-venv`)")] =
        None,
    model: ModelOpt = "smollm2-135m",
) -> None:
    """TTFT (cold, warm), time per output token and long-document QA throughput of vLLM alone, kvshelf's vLLM
    connector (embedded store; a shared kvshelf serve) and LMCache MP, each engine in a process of its own."""
    import sys

    from kvshelf.bench.vllm import Options, check, check_vllm_venv, run
    from kvshelf.bench.vllm import vllm_venv as find_venv

    options = Options(systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
                      lengths=ints(lengths, "--lengths"), ttft_docs=ttft_docs, qa_docs=qa_docs, qa_tokens=qa_tokens,
                      questions=questions, max_tokens=max_tokens, kv_blocks=kv_blocks)
    check(options)
    check_vllm_venv(find_venv(str(vllm_venv) if vllm_venv else None))
    chosen = corpus_path(corpus)
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, options=options,
        vllm_venv_dir=str(vllm_venv) if vllm_venv else None, model_name=model, console=console,
        command="kvshelf bench vllm " + " ".join(sys.argv[3:]))
