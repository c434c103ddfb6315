"""``kvshelf serve`` (the gRPC KV service) and ``kvshelf repair`` (salvage its damaged disk tier)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvshelf.cli.common import opt


def serve(
    listen: Annotated[str | None, opt("HOST:PORT to listen on (default 127.0.0.1:50051)")] = None,
    data_dir: Annotated[str | None, opt("store directory (CPU memory + LMDB)")] = None,
    memory: Annotated[str | None, opt("memory tier capacity, e.g. 2GiB (0: none)")] = None,
    max_disk: Annotated[str | None, opt(
        "LMDB tier capacity, e.g. 100GiB (default 1TiB): it evicts to stay under it; the file may pass it by a "
        "documented slack for LMDB's own pages (39.25MiB for 256MiB, ~2.7% for 1TiB)")] = None,
    disk_codec: Annotated[str | None, opt(
        "codec the LMDB (and Redis) tier re-encodes blocks into (default none: every tier keeps blocks in the codec "
        "clients sent them in; clients decode)")] = None,
    eviction_policy: Annotated[str | None, opt(
        "what the memory and LMDB tiers evict: prefix (default), arc, s3fifo or lru (compare them with "
        "`kvshelf replay`)")] = None,
    redis: Annotated[str | None, opt("redis://HOST:PORT/DB or redis+cluster://HOST:PORT: the shared tier")] = None,
    tokens_file: Annotated[str | None, opt("TOML \\[tokens] \"token\" = \"namespace\" (none: dev mode)")] = None,
    tls_cert: Annotated[str | None, opt("PEM certificate (with --tls-key: serve TLS)")] = None,
    tls_key: Annotated[str | None, opt("PEM private key")] = None,
    max_block: Annotated[str | None, opt("largest block accepted, encoded or once decoded (default 256MiB)")] = None,
    max_call: Annotated[str | None, opt("most bytes one PutBlocks call may carry (default 1GiB)")] = None,
    quota: Annotated[str | None, opt("per-namespace byte quota, e.g. 10GiB (default none)")] = None,
    grace: Annotated[float | None, opt("seconds to drain in-flight calls on SIGTERM (default 10)")] = None,
    workers: Annotated[int | None, opt("RPC worker threads (default 32)")] = None,
    metrics_port: Annotated[int | None, opt("serve Prometheus /metrics on this port (default off)")] = None,
    metrics_addr: Annotated[str | None, opt(
        "address of the metrics endpoint (default 127.0.0.1; any other needs --metrics-token-file)")] = None,
    history_interval: Annotated[float | None, opt("seconds between stats-history samples (default 10)")] = None,
    shared_memory: Annotated[bool | None, typer.Option(
        "--shared-memory/--no-shared-memory", show_default=False,
        help="same-host gets through /dev/shm arenas for loopback/Unix-socket clients (default on)")] = None,
    tenant_streams: Annotated[int | None, opt("streaming calls one tenant may have open at once (default 8)")
                              ] = None,
    idle_timeout: Annotated[float | None, opt("seconds a stream may make no progress (default 10)")] = None,
    min_rate: Annotated[str | None, opt("slowest accepted upload per second, e.g. 1MiB (default 1MiB)")] = None,
    max_inflight: Annotated[str | None, opt("put bytes buffered at once, all tenants (default 2 x max-call)")
                            ] = None,
    redis_timeout: Annotated[float | None, opt("seconds one Redis call may take (default 1)")] = None,
    strike_burst: Annotated[int | None, opt(
        "failed calls (the client's fault) at which a tenant's streams are refused (default 20; 0: off)")] = None,
    strike_rate: Annotated[float | None, opt("failed calls per second a tenant is forgiven (default 5)")] = None,
    metrics_token_file: Annotated[str | None, opt("file with the bearer token /metrics requires")] = None,
    metrics_namespaces: Annotated[str | None, opt("comma-separated namespaces /metrics shows (default all)")
                                  ] = None,
    reset_disk: Annotated[bool | None, typer.Option(
        "--reset-disk", show_default=False,
        help="if the LMDB environment is damaged, move it aside (DIR/lmdb.damaged-<UTC time>, never deleted) "
             "and start an empty one; to keep its readable blocks run `kvshelf repair` instead")] = None,
    arena_sweep_interval: Annotated[float | None, opt(
        "seconds between sweeps of dead clients' /dev/shm arenas (default 30)")] = None,
    events_log: Annotated[str | None, opt(
        "bound of the KV event log in DATA_DIR/events, e.g. 64MiB (default): how far back a replay reaches")] = None,
    max_subscriptions: Annotated[int | None, opt(
        "`kvshelf events` subscriptions open at once, all tenants; each has a thread of its own (default 8)")] = None,
    tenant_subscriptions: Annotated[int | None, opt("event subscriptions one tenant may have open (default 2)")
                                    ] = None,
    subscriber_queue: Annotated[int | None, opt(
        "events waiting for one subscriber before it is cut off as too slow (default 10000)")] = None,
    durability: Annotated[str | None, opt(
        "fsync (default): a put is flushed to the disk before it is acknowledged; interval: committed to the OS "
        "before it is acknowledged (a server crash or SIGKILL loses nothing), flushed every --sync-interval "
        "seconds (an OS crash or power cut loses at most that)")] = None,
    sync_interval: Annotated[float | None, opt("seconds between flushes with --durability interval (default 1)")
                             ] = None,
    config: Annotated[Path | None, opt("TOML config file (or $KVSHELF_CONFIG)")] = None,
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
    from kvshelf.kvstore.lmdb_tier.repair import repair as run_repair

    path = (data_dir or default_data_dir()) / "lmdb"
    err = Console(stderr=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("reading blocks", total=None)
        report = run_repair(path, dry_run=dry_run, total=lambda n: progress.update(task, total=n),
                            advance=lambda n: progress.advance(task, n))
    print(report.summary())

