"""The ``kvshelf`` command line: demo, benchmarks, model preparation and the store admin view."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvshelf.kvstore.errors import KVShelfError

app = typer.Typer(help="kvshelf: KV-cache management and context reuse for transformer LLMs.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Benchmarks (each writes JSON and prints a table).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()

ModelOpt = Annotated[str, typer.Option(help="bundled name (smollm2-135m), local directory, or cached HF id")]


@app.command()
def demo(
    model: ModelOpt = "smollm2-135m",
    documents: Annotated[int, typer.Option(min=1, max=8, help="how many documents")] = 2,
    tokens: Annotated[int, typer.Option(min=300, max=7000, help="approximate tokens per document")] = 1800,
    data_dir: Annotated[Path | None, typer.Option(help="store directory (default: a temporary one)")] = None,
    remote: Annotated[str | None, typer.Option(help="use a `kvshelf serve` server at HOST:PORT instead")] = None,
) -> None:
    """Long-document QA with the embedded store: cold vs warm (memory, and disk in a new process) TTFT."""
    from kvshelf.service.demo import run_demo

    run_demo(model_name=model, documents=documents, tokens=tokens,
             data_dir=str(data_dir) if data_dir else None, console=console, remote=remote)


def _opt(help_text: str) -> object:
    return typer.Option(help=help_text, show_default=False)


@app.command()
def serve(
    listen: Annotated[str | None, _opt("HOST:PORT to listen on (default 127.0.0.1:50051)")] = None,
    data_dir: Annotated[str | None, _opt("store directory (CPU memory + LMDB)")] = None,
    memory: Annotated[str | None, _opt("memory tier capacity, e.g. 2GiB (0: none)")] = None,
    max_disk: Annotated[str | None, _opt(
        "LMDB tier capacity, e.g. 100GiB (default 1TiB): it evicts to stay under it; the file may pass it by a "
        "documented slack for LMDB's own pages (39.25MiB for 256MiB, ~2.7% for 1TiB)")] = None,
    disk_codec: Annotated[str | None, _opt(
        "codec the LMDB (and Redis) tier re-encodes blocks into (default none: every tier keeps blocks in the codec "
        "clients sent them in; clients decode)")] = None,
    eviction_policy: Annotated[str | None, _opt(
        "what the memory and LMDB tiers evict: prefix (default), arc, s3fifo or lru (compare them with "
        "`kvshelf replay`)")] = None,
    redis: Annotated[str | None, _opt("redis://HOST:PORT/DB or redis+cluster://HOST:PORT: the shared tier")] = None,
    tokens_file: Annotated[str | None, _opt("TOML \\[tokens] \"token\" = \"namespace\" (none: dev mode)")] = None,
    tls_cert: Annotated[str | None, _opt("PEM certificate (with --tls-key: serve TLS)")] = None,
    tls_key: Annotated[str | None, _opt("PEM private key")] = None,
    max_block: Annotated[str | None, _opt("largest block accepted, encoded or once decoded (default 256MiB)")] = None,
    max_call: Annotated[str | None, _opt("most bytes one PutBlocks call may carry (default 1GiB)")] = None,
    quota: Annotated[str | None, _opt("per-namespace byte quota, e.g. 10GiB (default none)")] = None,
    grace: Annotated[float | None, _opt("seconds to drain in-flight calls on SIGTERM (default 10)")] = None,
    workers: Annotated[int | None, _opt("RPC worker threads (default 32)")] = None,
    metrics_port: Annotated[int | None, _opt("serve Prometheus /metrics on this port (default off)")] = None,
    metrics_addr: Annotated[str | None, _opt(
        "address of the metrics endpoint (default 127.0.0.1; any other needs --metrics-token-file)")] = None,
    history_interval: Annotated[float | None, _opt("seconds between stats-history samples (default 10)")] = None,
    shared_memory: Annotated[bool | None, typer.Option(
        "--shared-memory/--no-shared-memory", show_default=False,
        help="same-host gets through /dev/shm arenas for loopback/Unix-socket clients (default on)")] = None,
    tenant_streams: Annotated[int | None, _opt("streaming calls one tenant may have open at once (default 8)")
                              ] = None,
    idle_timeout: Annotated[float | None, _opt("seconds a stream may make no progress (default 10)")] = None,
    min_rate: Annotated[str | None, _opt("slowest accepted upload per second, e.g. 1MiB (default 1MiB)")] = None,
    max_inflight: Annotated[str | None, _opt("put bytes buffered at once, all tenants (default 2 x max-call)")
                            ] = None,
    redis_timeout: Annotated[float | None, _opt("seconds one Redis call may take (default 1)")] = None,
    strike_burst: Annotated[int | None, _opt(
        "failed calls (the client's fault) at which a tenant's streams are refused (default 20; 0: off)")] = None,
    strike_rate: Annotated[float | None, _opt("failed calls per second a tenant is forgiven (default 5)")] = None,
    metrics_token_file: Annotated[str | None, _opt("file with the bearer token /metrics requires")] = None,
    metrics_namespaces: Annotated[str | None, _opt("comma-separated namespaces /metrics shows (default all)")
                                  ] = None,
    reset_disk: Annotated[bool | None, typer.Option(
        "--reset-disk", show_default=False,
        help="if the LMDB environment is damaged, move it aside (DIR/lmdb.damaged-<UTC time>, never deleted) "
             "and start an empty one; to keep its readable blocks run `kvshelf repair` instead")] = None,
    arena_sweep_interval: Annotated[float | None, _opt(
        "seconds between sweeps of dead clients' /dev/shm arenas (default 30)")] = None,
    events_log: Annotated[str | None, _opt(
        "bound of the KV event log in DATA_DIR/events, e.g. 64MiB (default): how far back a replay reaches")] = None,
    max_subscriptions: Annotated[int | None, _opt(
        "`kvshelf events` subscriptions open at once, all tenants; each has a thread of its own (default 8)")] = None,
    tenant_subscriptions: Annotated[int | None, _opt("event subscriptions one tenant may have open (default 2)")
                                    ] = None,
    subscriber_queue: Annotated[int | None, _opt(
        "events waiting for one subscriber before it is cut off as too slow (default 10000)")] = None,
    durability: Annotated[str | None, _opt(
        "fsync (default): a put is flushed to the disk before it is acknowledged; interval: committed to the OS "
        "before it is acknowledged (a server crash or SIGKILL loses nothing), flushed every --sync-interval "
        "seconds (an OS crash or power cut loses at most that)")] = None,
    sync_interval: Annotated[float | None, _opt("seconds between flushes with --durability interval (default 1)")
                             ] = None,
    config: Annotated[Path | None, _opt("TOML config file (or $KVSHELF_CONFIG)")] = None,
) -> None:
    """Run the gRPC KV service. Settings: flags > KVSHELF_* environment variables > --config TOML > defaults."""
    from kvshelf.service.serve import load_config
    from kvshelf.service.serve import serve as run_server

    flags = dict(listen=listen, data_dir=data_dir, memory=memory, max_disk=max_disk, disk_codec=disk_codec,
                 eviction_policy=eviction_policy, redis=redis, tokens_file=tokens_file, tls_cert=tls_cert,
                 tls_key=tls_key, max_block=max_block,
                 max_call=max_call, quota=quota, grace=grace, workers=workers, metrics_port=metrics_port,
                 metrics_addr=metrics_addr, history_interval=history_interval, shared_memory=shared_memory,
                 tenant_streams=tenant_streams, idle_timeout=idle_timeout, min_rate=min_rate,
                 max_inflight=max_inflight, redis_timeout=redis_timeout, strike_burst=strike_burst,
                 strike_rate=strike_rate, metrics_token_file=metrics_token_file,
                 metrics_namespaces=metrics_namespaces, reset_disk=reset_disk,
                 arena_sweep_interval=arena_sweep_interval, events_log=events_log,
                 max_subscriptions=max_subscriptions, tenant_subscriptions=tenant_subscriptions,
                 subscriber_queue=subscriber_queue, durability=durability, sync_interval=sync_interval)
    raise typer.Exit(run_server(load_config(flags, config_file=config)))


@app.command()
def repair(
    data_dir: Annotated[Path | None, typer.Option(
        help="store directory whose lmdb/ environment to repair (default: $KVSHELF_DATA_DIR or the cache)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only report what would be kept and dropped")] = False,
) -> None:
    """Salvage a damaged disk tier (LMDB): keep every readable block that verifies, drop the rest.

    When `kvshelf serve` refuses a damaged data directory, or its health reports the disk tier damaged:

    1. stop the server;

    2. `kvshelf repair --data-dir DIR --dry-run` shows what would be kept;

    3. `kvshelf repair --data-dir DIR` copies the kept blocks byte for byte into a new environment and keeps the
    damaged one as DIR/lmdb.damaged-<UTC time> (never deleted); dropped blocks are recomputed on their next miss.

    To start empty instead: `kvshelf serve --reset-disk`. Exit 0 when DIR/lmdb is usable.
    """
    from rich.progress import Progress

    from kvshelf.kvstore.embedded import default_data_dir
    from kvshelf.kvstore.lmdb_repair import repair as run_repair

    path = (data_dir or default_data_dir()) / "lmdb"
    err = Console(stderr=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("reading blocks", total=None)
        report = run_repair(path, dry_run=dry_run, total=lambda n: progress.update(task, total=n),
                            advance=lambda n: progress.advance(task, n))
    print(report.summary())


ReplayTrace = Annotated[Path, typer.Argument(
    help="request trace: one JSON object per line with hash_ids (see ../shared/data/traces/README.md)")]
ReplayCapacities = Annotated[str, typer.Option(
    help="comma-separated capacities: bare numbers are fractions in (0, 1] of the trace's distinct blocks, sizes "
         "with a unit (64GiB, 4096B) are bytes")]
ReplayPolicies = Annotated[str | None, typer.Option(
    help="comma-separated eviction policies (default: every known one); LRU and OPT are always computed; the "
         "table marks with * the default policy of `kvshelf serve` and open_embedded_store",
    show_default=False)]
ReplayBlockBytes = Annotated[str, typer.Option(
    help="bytes of one block's placeholder value (default: a 512-token SmolLM2-135M fp16 block)")]
ReplayTier = Annotated[str, typer.Option(
    help="tier class to drive: memory, or lmdb (in a temporary directory; it charges a value its whole 4 KiB pages: "
         "--block-bytes 65520 (16 pages less LMDB's 16-byte header) holds as many blocks as the memory tier)")]
ReplayWorkers = Annotated[int, typer.Option(help="processes replaying policies x capacities in parallel")]


@app.command()
def replay(
    trace: ReplayTrace,
    capacities: ReplayCapacities = "0.01,0.05,0.1,0.2,0.4",
    policies: ReplayPolicies = None,
    block_bytes: ReplayBlockBytes = "11796480",
    tier: ReplayTier = "memory",
    json_path: Annotated[Path | None, typer.Option("--json", help="write the results here as JSON")] = None,
    plot: Annotated[Path | None, typer.Option(help="draw hit rate vs capacity (one line per policy, OPT dashed) "
                                                    "to this PNG")] = None,
    workers: ReplayWorkers = 1,
) -> None:
    """Replay a request trace through the real tier and policy code (no model): each policy's prefix-hit rate at
    each capacity, next to Belady's OPT and LRU."""
    _run_replay(trace, capacities, policies, block_bytes, tier, json_path, plot, workers)


@bench_app.command("replay")
def bench_replay(
    trace: ReplayTrace,
    json_path: Annotated[Path, typer.Option("--json", help="write the results here")] = Path(
        "bench/results/replay.json"),
    capacities: ReplayCapacities = "0.01,0.05,0.1,0.2,0.4",
    policies: ReplayPolicies = None,
    block_bytes: ReplayBlockBytes = "11796480",
    tier: ReplayTier = "memory",
    plot: Annotated[Path | None, typer.Option(help="also draw the PNG plot here")] = None,
    workers: ReplayWorkers = 1,
) -> None:
    """`kvshelf replay` as a benchmark: the same table, JSON written to bench/results/replay.json by default."""
    _run_replay(trace, capacities, policies, block_bytes, tier, json_path, plot, workers)


@bench_app.command("eviction-bounds")
def bench_eviction_bounds(
    trace: ReplayTrace,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the results here")] = None,
    capacities: Annotated[str, typer.Option(help="comma-separated fractions of the trace's distinct blocks")
                          ] = "0.05,0.1",
) -> None:
    """Upper bounds for any eviction policy on a trace: OPT, LRU, and LRU / GreedyDual-frequency told by an
    oracle which blocks will never be used again (bench/eviction_bounds.py)."""
    from rich.table import Table

    from kvshelf.bench.eviction_bounds import bounds, write
    from kvshelf.kvstore.replay import parse_capacities
    from kvshelf.kvstore.trace import read_trace

    specs = parse_capacities(capacities)
    fractions = [spec.fraction for spec in specs if spec.fraction is not None]
    if len(fractions) != len(specs):
        raise KVShelfError("--capacities: the bounds take fractions of the trace's distinct blocks, not byte sizes")
    report = bounds(read_trace(trace), fractions)
    table = Table(title=f"eviction bounds: {trace}")
    for col in ("capacity", "OPT", "LRU", "oracle LRU", "oracle GDF", "LRU/OPT", "o.LRU/OPT", "o.GDF/OPT"):
        table.add_column(col, justify="right")
    for row in report["results"]:
        table.add_row(f"{row['capacity_fraction']:g}", *(f"{row[k]:.3f}" for k in (
            "opt", "lru", "dead_lru", "dead_gdf", "lru_vs_opt", "dead_lru_vs_opt", "dead_gdf_vs_opt")))
    console.print(table)
    if json_path is not None:
        console.print(f"wrote {write(report, json_path)}")


def _run_replay(trace_path: Path, capacities: str, policies: str | None, block_bytes: str, tier: str,
                json_path: Path | None, plot_path: Path | None, workers: int) -> None:
    from rich.progress import Progress

    from kvshelf.kvstore.replay import TIERS, check_block_bytes, check_policies, parse_capacities, replay
    from kvshelf.kvstore.trace import read_trace
    from kvshelf.service import replay_report

    # every setting is checked before the trace is read and the replay starts
    size = check_block_bytes(block_bytes)
    specs = parse_capacities(capacities)
    names = check_policies([p.strip() for p in policies.split(",") if p.strip()] if policies is not None else None)
    if workers < 1:
        raise KVShelfError(f"--workers must be at least 1, got {workers}")
    if tier not in TIERS:
        raise KVShelfError(f"--tier must be one of {', '.join(TIERS)}, got {tier!r}")
    for path, option in ((json_path, "--json"), (plot_path, "--plot")):
        if path is not None:
            replay_report.check_output(path, option)
    loaded = read_trace(trace_path)
    err = Console(stderr=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("replaying", total=None)
        report = replay(loaded, policies=names, capacities=specs, block_bytes=size, tier=tier, workers=workers,
                        total=lambda n: progress.update(task, total=n), progress=lambda n: progress.advance(task, n))
    console.print(replay_report.render(report))
    if json_path is not None:
        console.print(f"wrote {replay_report.write_json(report, json_path)}")
    if plot_path is not None:
        console.print(f"wrote {replay_report.plot(report, plot_path)}")


@bench_app.command("ttft")
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
    from kvshelf.bench.ttft import run
    from kvshelf.kvstore.codec import get_codec

    names = [name.strip() for value in (codec or ["raw"]) for name in value.split(",") if name.strip()] or ["raw"]
    if len(names) > 1 and not (remote or redis):
        raise KVShelfError(f"several codecs ({', '.join(names)}) need --remote or --redis (the disk modes take one)")
    if cold and (remote or redis):
        raise KVShelfError("--cold is a disk mode: it does not go with --remote/--redis")
    raw_params = _json_object(codec_params, "--codec-params")
    keyed = len(names) > 1 or (bool(raw_params) and set(raw_params) <= set(names)
                               and all(isinstance(v, dict) for v in raw_params.values()))
    if keyed and set(raw_params) - set(names):
        raise KVShelfError(f"--codec-params: {sorted(set(raw_params) - set(names))} are not among the codecs "
                           f"{names}; with several codecs give an object by codec name")
    chosen_params = [dict(raw_params.get(name, {})) if keyed else dict(raw_params) for name in names]
    for name, params in zip(names, chosen_params, strict=True):
        if not isinstance(params, dict):
            raise KVShelfError(f"--codec-params: the parameters of {name} must be a JSON object")
        # an unknown codec or parameter is a clear error before the model loads (xquant's "basis" is the adapter's)
        get_codec(name, {k: v for k, v in params.items() if not (name == "xquant" and k == "basis")})
    remote_modes = remote or redis  # the codecs go to the remote modes; the bench's own store stays raw
    disk, params = ("raw", {}) if remote_modes else (names[0], chosen_params[0])
    chosen = _corpus(corpus)
    parsed = _ints(lengths, "--lengths")
    _check_device(device, dtype)
    if any(n < block_size for n in parsed):
        raise KVShelfError(f"every length must be >= the block size {block_size}: {parsed}")
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None,
        lengths=parsed, runs=runs, model_name=model, block_size=block_size, console=console, disk_codec=disk,
        disk_codec_params=params, rounds=rounds, cold=cold, remote=remote, redis=redis,
        codecs=list(zip(names, chosen_params, strict=True)), dtype=dtype, device=device)


@app.command()
def precompute(
    paths: Annotated[list[Path], typer.Argument(help=".txt files or .jsonl files ({title, abstract} or {text})")],
    data_dir: Annotated[Path | None, typer.Option(
        help="embedded store directory (default: $KVSHELF_DATA_DIR, else store under $KVSHELF_CACHE)")] = None,
    model: ModelOpt = "smollm2-135m",
    namespace: Annotated[str, typer.Option(help="tenant namespace of the chunks")] = "default",
    chunk_size: Annotated[int, typer.Option(min=1, help="tokens per chunk")] = 256,
    overlap: Annotated[int, typer.Option(min=0, help="tokens shared by consecutive chunks")] = 0,
    pin: Annotated[bool, typer.Option(help="pin the chunks in the store")] = False,
    dtype: Annotated[str, typer.Option(
        help="model dtype: float32, bfloat16 or float16 (blocks are keyed by it: generate in the same dtype)")
    ] = "float32",
    prefix: Annotated[str | None, typer.Option(
        help="the shared prefix the generator will have (system prompt, chat template head), as text")] = None,
    prefix_file: Annotated[Path | None, typer.Option(help="read the shared prefix from this file")] = None,
    modes: Annotated[str, typer.Option(
        help="comma-separated RAG modes to prepare: reuse, reuse-blend, block-attention")
    ] = "reuse,reuse-blend,block-attention",
    blend_base: Annotated[str, typer.Option(help="reuse-blend's chunk KV: block (after the prefix) or chunk")
                          ] = "block",
) -> None:
    """RAG: chunk documents and store what each mode reads (position-0 chunks, blocks after the prefix, the
    prefix itself); resumable, with a progress bar; prints the summary."""
    from kvshelf.adapters.model import load_model, resolve_dtype
    from kvshelf.adapters.rag import precompute as run_precompute
    from kvshelf.kvstore.embedded import open_embedded_store

    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise KVShelfError(f"no such file(s): {', '.join(missing)}")
    if overlap >= chunk_size:
        raise KVShelfError(f"--overlap ({overlap}) must be smaller than --chunk-size ({chunk_size})")
    if prefix is not None and prefix_file is not None:
        raise KVShelfError("give the prefix as --prefix or --prefix-file, not both")
    if prefix_file is not None:
        if not prefix_file.is_file():
            raise KVShelfError(f"no such prefix file: {prefix_file}")
        prefix = prefix_file.read_text(encoding="utf-8")
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    allowed = ("reuse", "reuse-blend", "block-attention")
    if not chosen or any(m not in allowed for m in chosen):
        raise KVShelfError(f"--modes must be a comma-separated subset of {', '.join(allowed)}, got {modes!r}")
    if blend_base not in ("block", "chunk"):
        raise KVShelfError(f"--blend-base must be block or chunk, got {blend_base!r}")
    resolve_dtype(dtype)  # an unknown dtype is a clear error before the model loads
    loaded, tokenizer = load_model(model, dtype=dtype)
    store = open_embedded_store(data_dir)
    try:
        result = run_precompute(None, loaded, tokenizer, store, paths=paths, namespace=namespace,
                                chunk_size=chunk_size, overlap=overlap, pin=pin, prefix=prefix, modes=chosen,
                                blend_base=blend_base)
    finally:
        store.close()
    console.print_json(json.dumps(result.summary(), default=str))


@bench_app.command("rag")
def bench_rag(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    corpus: Annotated[Path | None, typer.Option(help="JSONL of {title, abstract}")] = None,
    cases: Annotated[int, typer.Option(min=1, help="needle QA cases")] = 40,
    runs: Annotated[int, typer.Option(min=1, help="runs per TTFT measurement (median)")] = 3,
    model: ModelOpt = "smollm2-135m",
) -> None:
    """Needle QA over 8 retrieved chunks: full vs reuse vs reuse-blend vs block attention; TTFT at 8x512."""
    from kvshelf.bench.rag import run

    chosen = _corpus(corpus)
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, cases=cases,
        runs=runs, model_name=model, console=console)


@bench_app.command("serve")
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

    chosen = _corpus(corpus)
    run(json_path=str(json_path) if json_path else None, corpus=str(chosen) if chosen else None, seconds=seconds,
        clients=clients, threads=threads, turns=turns, pool=pool, precompute_documents=precompute_documents,
        model_name=model, console=console)


@bench_app.command("pruning")
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

    chosen = _corpus(corpus)
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


@bench_app.command("codecs")
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

    chosen = _corpus(corpus)
    run(str(json_path) if json_path else None, str(chosen) if chosen else None, windows=windows,
        model_name=model, anchors=anchors, only=only, console=console)


@bench_app.command("mla")
def bench_mla(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    shape: Annotated[str, typer.Option(help="a shaped MLA model (adapters.shaped)")] = "deepseek-v3-shaped",
    tokens: Annotated[int, typer.Option(min=1, max=65536, help="tokens in the block")] = 256,
    codecs: Annotated[str, typer.Option(help="comma-separated codecs")] = "raw,fp16,bf16,zstd,int8",
    dtype: Annotated[str, typer.Option(help="the block's dtype")] = "bfloat16",
) -> None:
    """Bytes of an MLA block (the latent transformers caches) against the expanded keys and values it stands for."""
    from kvshelf.bench.mla import run

    chosen = tuple(c.strip() for c in codecs.split(",") if c.strip())
    if not chosen:
        raise KVShelfError("--codecs names no codec")
    run(json_path=str(json_path) if json_path else None, shape=shape, tokens=tokens, codecs=chosen, dtype=dtype,
        console=console)


@bench_app.command("lmdb")
def bench_lmdb(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    reps: Annotated[int, typer.Option(min=3, help="reads per path (median reported)")] = 50,
) -> None:
    """Read throughput of an 8 MiB block: LMDB tier and store vs raw LMDB."""
    from kvshelf.bench.lmdb_read import run

    run(json_path=str(json_path) if json_path else None, reps=reps, console=console)


@bench_app.command("lmdb-capacity")
def bench_lmdb_capacity(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    duration: Annotated[float, typer.Option(min=0.1, help="seconds of traffic")] = 600,
    capacity: Annotated[str, typer.Option(help="the tier's capacity, e.g. 256MiB")] = "256MiB",
    min_block: Annotated[str, typer.Option(help="smallest block put")] = "1MiB",
    max_block: Annotated[str, typer.Option(help="largest block put")] = "8MiB",
    durable: Annotated[bool, typer.Option(help="fsync every commit (as kvshelf serve does)")] = True,
    seed: Annotated[int, typer.Option(help="of the random traffic")] = 0,
    policy: Annotated[str, typer.Option(help="eviction policy of the tier")] = "lru",
    slack: Annotated[str | None, typer.Option(help="the tier's slack (default: lmdb_slack_bytes of the capacity)")]
    = None,
) -> None:
    """A bounded LMDB tier under random puts and gets: the file stays under capacity + slack, no errors, every
    get a correct block or a counted miss (exit code 1 if an invariant broke)."""
    from kvshelf.bench.lmdb_capacity import run
    from kvshelf.kvstore.embedded import parse_size

    sizes = [parse_size(v, flag) for v, flag in ((capacity, "--capacity"), (min_block, "--min-block"),
                                                 (max_block, "--max-block"))]
    if sizes[0] < 1 or not 32 <= sizes[1] <= sizes[2]:
        raise KVShelfError(f"need --capacity >= 1 byte and 32 bytes <= --min-block <= --max-block, got {sizes}")
    result = run(duration_s=duration, capacity=sizes[0], min_block=sizes[1], max_block=sizes[2], seed=seed,
                 durable=durable, policy=policy, slack=parse_size(slack, "--slack") if slack is not None else None,
                 json_path=str(json_path) if json_path else None, console=console)
    if not result["ok"]:
        raise typer.Exit(1)


@bench_app.command("store")
def bench_store(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    backends: Annotated[str, typer.Option(
        help="comma-separated: grpc (same-host default), grpc-wire, grpc-bare (a bare gRPC Python server: the "
             "wire's floor), redis, lmdb")] = "grpc,grpc-wire,grpc-bare,redis,lmdb",
    sizes: Annotated[str, typer.Option(help="block sizes in MiB")] = "1,8,32",
    clients: Annotated[str, typer.Option(help="concurrent clients")] = "1,8",
) -> None:
    """Put/get throughput and p50/p99 latency: the gRPC service vs raw redis-py vs raw LMDB."""
    from kvshelf.bench.store import BACKENDS, run

    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    unknown = sorted(set(chosen) - set(BACKENDS))
    if unknown:
        raise KVShelfError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    run(json_path=str(json_path) if json_path else None, backends={b: BACKENDS[b] for b in chosen},
        sizes=_ints(sizes, "--sizes"), clients=_ints(clients, "--clients"), console=console)


@bench_app.command("clear")
def bench_clear(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    other: Annotated[int, typer.Option(help="values of other namespaces in Redis")] = 1_000_000,
    ns_keys: Annotated[int, typer.Option("--ns-keys", help="values of the namespace cleared")] = 10_000,
    cluster: Annotated[bool, typer.Option(help="a local 3-primary Redis Cluster instead of one server")] = False,
    paths: Annotated[str, typer.Option(help="comma-separated: old (pre-issue-22 Clear, the anchor), new")] = "old,new",
    scan_count: Annotated[int | None, typer.Option(help="the new path's SCAN COUNT hint (default 1000)")] = None,
) -> None:
    """Clear(namespace) on a large Redis: seconds and Redis's SCAN calls, old path vs new (bench/clear.py)."""
    from kvshelf.bench.clear import run

    chosen = tuple(p.strip() for p in paths.split(",") if p.strip())
    if not chosen or set(chosen) - {"old", "new"}:
        raise KVShelfError(f"--paths takes old and/or new, got {paths!r}")
    if other < 0 or ns_keys <= 0 or (scan_count is not None and scan_count <= 0):
        raise KVShelfError("--other must be >= 0, --ns-keys and --scan-count > 0")
    run(json_path=str(json_path) if json_path else None, other=other, ns_keys=ns_keys, cluster=cluster,
        paths=chosen, scan_count=scan_count, console=console)


@bench_app.command("chaos")
def bench_chaos(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    seconds: Annotated[float, typer.Option(min=5, help="length of the run")] = 60,
    clients: Annotated[int, typer.Option(min=1, max=64)] = 8,
    redis_down: Annotated[float, typer.Option(min=0, help="seconds Redis stays down")] = 10,
    durability: Annotated[str, typer.Option(help="the server's --durability: fsync or interval")] = "fsync",
) -> None:
    """Reliability: mixed traffic while the server is SIGKILLed and restarted and Redis goes away."""
    from kvshelf.bench.chaos import run
    from kvshelf.service.serve import DURABILITY

    if durability not in DURABILITY:
        raise KVShelfError(f"--durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
    result = run(json_path=str(json_path) if json_path else None, seconds=seconds, clients=clients,
                 redis_down_s=redis_down, durability=durability, console=console)
    if not result["ok"]:
        raise typer.Exit(1)


@bench_app.command("abuse")
def bench_abuse(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    seconds: Annotated[float, typer.Option(min=4, help="length of the run (half alone, half under abuse)")] = 60,
    max_block: Annotated[str, typer.Option(help="the server's --max-block")] = "4MiB",
    max_call: Annotated[str, typer.Option(help="the server's --max-call (the per-call limit of the figures)")
                        ] = "32MiB",
    quota: Annotated[str, typer.Option(help="the server's per-namespace --quota")] = "16MiB",
    max_inflight: Annotated[str | None, _opt("the server's --max-inflight (default: the server's)")] = None,
    tenant_streams: Annotated[int | None, _opt("the server's --tenant-streams (default: the server's)")] = None,
    idle_timeout: Annotated[float | None, _opt("the server's --idle-timeout (default: the server's)")] = None,
    idle_streams: Annotated[int, typer.Option(min=0, help="idle PutBlocks streams the abuser holds open")] = 16,
    strike_burst: Annotated[int | None, _opt("the server's --strike-burst (default: the server's; 0: off)")] = None,
    attacks: Annotated[str, typer.Option(help="the abuser's attacks, comma-separated: streams (idle and slow), "
                                              "bad (oversized, bomb, malformed), memory (padded messages, the "
                                              "Hadamard bomb), quota")] = "streams,bad,memory,quota",
    disk_codec: Annotated[str | None, _opt("the server's --disk-codec (default: as sent; int8: the server "
                                           "decodes every put to re-encode it)")] = None,
) -> None:
    """Fairness: an honest tenant's p50/p99 alone and while another tenant abuses the server; RSS, INTERNALs."""
    from kvshelf.bench.abuse import AbuseSettings, run
    from kvshelf.bench.abuser import ATTACKS

    chosen = tuple(a.strip() for a in attacks.split(",") if a.strip())
    if not chosen or not set(chosen) <= set(ATTACKS):
        raise KVShelfError(f"--attacks must be a comma-separated subset of {', '.join(ATTACKS)}, got {attacks!r}")
    settings = AbuseSettings(seconds=seconds, max_block=max_block, max_call=max_call, quota=quota,
                             max_inflight=max_inflight, tenant_streams=tenant_streams, idle_timeout=idle_timeout,
                             idle_streams=idle_streams, attacks=chosen, strike_burst=strike_burst,
                             disk_codec=disk_codec)
    result = run(json_path=str(json_path) if json_path else None, settings=settings, console=console)
    if not result["ok"]:
        raise typer.Exit(1)


def _check_device(device: str, dtype: str) -> None:
    """A clear error for a device or dtype the bench cannot use, before the model loads."""
    import torch

    from kvshelf.adapters.model import resolve_dtype

    resolve_dtype(dtype)
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise KVShelfError(f"--device {device!r}: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise KVShelfError(f"--device {device}: CUDA is not available on this machine")


def _corpus(corpus: Path | None) -> Path | None:
    """The corpus to use: the given file (which must exist), else ../shared/data/abstracts.jsonl when present."""
    from kvshelf.bench.common import default_corpus

    if corpus is not None and not corpus.is_file():
        raise KVShelfError(f"corpus {corpus} does not exist")
    return corpus or default_corpus()


def _json_object(text: str | None, option: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object (``{}`` when None)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KVShelfError(f"{option} must be a JSON object, got {text!r}: {exc.msg}") from None
    if not isinstance(value, dict):
        raise KVShelfError(f"{option} must be a JSON object, got {text!r}")
    return value


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise KVShelfError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise KVShelfError(f"{option} must be positive integers, got {text!r}")
    return values


@app.command("prepare-model")
def prepare_model(name: Annotated[str, typer.Argument(help="bundled model name")] = "smollm2-135m") -> None:
    """Convert a bundled model to the safetensors cache once (``make install`` runs this)."""
    from kvshelf.adapters.model import BUNDLED_MODELS, convert_bundled

    if name not in BUNDLED_MODELS:
        raise KVShelfError(f"unknown bundled model {name!r}; bundled: {', '.join(sorted(BUNDLED_MODELS))}")
    console.print(f"{name}: {convert_bundled(name)}")


@app.command()
def stats(
    server: Annotated[str | None, typer.Option(help="HOST:PORT of a `kvshelf serve` server")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="or: an embedded store directory (what it holds)")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (servers with a tokens file)",
                                              envvar="KVSHELF_TOKEN")] = None,
    namespace: Annotated[str, typer.Option(help="namespace (dev-mode servers)")] = "default",
    tls_ca: Annotated[Path | None, typer.Option(help="CA certificate of a TLS server")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="refresh live until Ctrl-C")] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="seconds between refreshes with --watch")] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the raw stats as JSON")] = False,
    plot: Annotated[Path | None, typer.Option(help="draw hit rate and usage over time (server history) to PNG")] = None,
) -> None:
    """The admin view: hit rates (blocks and tokens), usage per tier, top namespaces and models, evictions."""
    from kvshelf.service.admin import plot as draw_plot
    from kvshelf.service.admin import render

    if (server is None) == (data_dir is None):
        raise KVShelfError("give exactly one of --server HOST:PORT or --data-dir DIR")
    fetch = _remote_stats(server, token, namespace, tls_ca) if server else _local_stats(data_dir)
    if plot is not None:
        history = fetch().get("history")
        if history is None:
            raise KVShelfError("--plot needs a server's history: the server must run in dev mode (no tokens file)")
        console.print(f"wrote {draw_plot(history, plot)}")
        return
    if as_json:
        print(json.dumps(fetch(), indent=2))
        return

    def view() -> Any:
        data = fetch()
        health = data.get("health", {})
        title = f"kvshelf {server or data_dir}" + (f" [{health['status']}]" if health else "")
        return render(data.get("store", data), title=title)

    if not watch:
        console.print(view())
        return
    from rich.live import Live

    with Live(view(), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(view())
        except KeyboardInterrupt:
            pass


@app.command()
def events(
    server: Annotated[str, typer.Option(help="HOST:PORT of a `kvshelf serve` server")],
    token: Annotated[str | None, typer.Option(help="bearer token (servers with a tokens file)",
                                              envvar="KVSHELF_TOKEN")] = None,
    namespace: Annotated[str, typer.Option(help="namespace (dev-mode servers)")] = "default",
    tls_ca: Annotated[Path | None, typer.Option(help="CA certificate of a TLS server")] = None,
    from_seq: Annotated[str, typer.Option(
        "--from-seq", help="replay the kept events from this sequence number first (0: live events only)")] = "0",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
    connect_timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for the server")] = 10.0,
) -> None:
    """Print the namespace's KV events live (BlockStored / BlockRemoved / AllBlocksCleared), one line each, until
    Ctrl-C (exit 0). Resume after a disconnect with --from-seq = the last seq printed + 1."""
    import threading

    import grpc

    from kvshelf.service.client import RemoteStore, RemoteStoreError
    from kvshelf.service.event_format import format_message

    try:
        start = int(from_seq)
    except ValueError:
        raise KVShelfError(f"--from-seq must be an integer >= 0, got {from_seq!r}") from None
    if start < 0:
        raise KVShelfError(f"--from-seq must be an integer >= 0, got {from_seq!r}")
    remote = RemoteStore(server, token=token, namespace=namespace, tls_ca=tls_ca, shared_memory=False,
                         connect_timeout_s=connect_timeout)
    current = [remote.subscribe_events(start)]
    stopping = threading.Event()
    failure: list[KVShelfError] = []

    def read() -> None:  # in a thread: the main one stays interruptible by Ctrl-C
        while True:
            subscription = current[0]
            try:
                for message in subscription:
                    for line in format_message(message, as_json=as_json):
                        print(line, flush=True)
                return
            except RemoteStoreError as exc:  # cut off as too slow (a slow terminal or pipe): resume where it stopped
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or "too slow" not in str(exc) or stopping.is_set():
                    failure.append(exc)
                    return
                resume = subscription.next_seq
                print(json.dumps({"type": "resumed", "from_seq": resume}) if as_json else
                      f"# fell behind: resuming from seq {resume}", flush=True)
                current[0] = remote.subscribe_events(resume)
            except KVShelfError as exc:
                failure.append(exc)
                return

    reader = threading.Thread(target=read, name="kvshelf-events", daemon=True)
    reader.start()
    try:
        while reader.is_alive():
            reader.join(0.2)
    except KeyboardInterrupt:
        stopping.set()
        current[0].cancel()
        reader.join(5)
        return
    finally:
        remote.close()
    if failure:
        raise failure[0]
    raise KVShelfError("the server ended the subscription")


def _remote_stats(server: str, token: str | None, namespace: str, tls_ca: Path | None) -> Callable[[], dict]:
    from kvshelf.service.client import RemoteStore

    remote = RemoteStore(server, token=token, namespace=namespace, tls_ca=tls_ca)
    return remote.stats


def _local_stats(data_dir: Path) -> Callable[[], dict]:
    from kvshelf.kvstore.lmdb_tier import LMDBTier
    from kvshelf.kvstore.store import TieredStore

    lmdb_dir = data_dir / "lmdb"
    if not lmdb_dir.is_dir():
        raise KVShelfError(f"no kvshelf store at {data_dir} (expected {lmdb_dir})")
    store = TieredStore([LMDBTier(lmdb_dir)])
    return store.stats


def main() -> None:
    """Entry point: our errors become one readable line and exit code 2."""
    try:
        app()
    except KVShelfError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/bold red] {exc}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
