"""The benchmarks of the store and the service: ``kvshelf bench lmdb | lmdb-capacity | store | clear | kv-events |
dashboard | chaos | abuse``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import console, ints, opt


def bench_lmdb(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    reps: Annotated[int, typer.Option(min=3, help="reads per path (median reported)")] = 50,
) -> None:
    """Read throughput of an 8 MiB block: LMDB tier and store vs raw LMDB."""
    from kvshelf.bench.lmdb_read import run

    run(json_path=str(json_path) if json_path else None, reps=reps, console=console)


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
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.kvstore.sizes import parse_size

    sizes = [parse_size(v, flag) for v, flag in ((capacity, "--capacity"), (min_block, "--min-block"),
                                                 (max_block, "--max-block"))]
    if sizes[0] < 1 or not 32 <= sizes[1] <= sizes[2]:
        raise KVShelfError(f"need --capacity >= 1 byte and 32 bytes <= --min-block <= --max-block, got {sizes}")
    result = run(duration_s=duration, capacity=sizes[0], min_block=sizes[1], max_block=sizes[2], seed=seed,
                 durable=durable, policy=policy, slack=parse_size(slack, "--slack") if slack is not None else None,
                 json_path=str(json_path) if json_path else None, console=console)
    if not result["ok"]:
        raise typer.Exit(1)


def bench_store(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    backends: Annotated[str, typer.Option(
        help="comma-separated: grpc (same-host default), grpc-wire (a remote client's default: the bulk data "
             "path), grpc-wire-fsync (the same, fsync per put), grpc-http2 (every byte over gRPC), grpc-bare (a bare "
             "gRPC Python server: the gRPC wire's floor), socket-floor (a bare Python socket server: this "
             "machine's limit), disk-floor (each value pwritten to a file of its own: the limit of writing values "
             "to this disk), redis, lmdb")] =
        "grpc,grpc-wire,grpc-wire-fsync,grpc-http2,grpc-bare,socket-floor,disk-floor,redis,lmdb",
    sizes: Annotated[str, typer.Option(help="block sizes in MiB")] = "1,8,32",
    clients: Annotated[str, typer.Option(help="concurrent clients")] = "1,8",
    durability: Annotated[str, typer.Option(
        help="the kvshelf servers' --durability (interval: as Redis runs, no fsync per write; fsync); "
             "grpc-wire-fsync always fsyncs")] = "interval",
) -> None:
    """Put/get throughput and p50/p99 latency: the gRPC service vs raw redis-py vs raw LMDB."""
    from kvshelf.bench.store import BACKENDS, chosen_backends, run
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.service.config import DURABILITY

    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    unknown = sorted(set(chosen) - set(BACKENDS))
    if unknown:
        raise KVShelfError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    if durability not in DURABILITY:
        raise KVShelfError(f"--durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
    run(json_path=str(json_path) if json_path else None, backends=chosen_backends(chosen, durability),
        sizes=ints(sizes, "--sizes"), clients=ints(clients, "--clients"), console=console, durability=durability)


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
    from kvshelf.kvstore.errors import KVShelfError

    chosen = tuple(p.strip() for p in paths.split(",") if p.strip())
    if not chosen or set(chosen) - {"old", "new"}:
        raise KVShelfError(f"--paths takes old and/or new, got {paths!r}")
    if other < 0 or ns_keys <= 0 or (scan_count is not None and scan_count <= 0):
        raise KVShelfError("--other must be >= 0, --ns-keys and --scan-count > 0")
    run(json_path=str(json_path) if json_path else None, other=other, ns_keys=ns_keys, cluster=cluster,
        paths=chosen, scan_count=scan_count, console=console)


def bench_kv_events(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    puts: Annotated[int, typer.Option(min=1, help="blocks put (one event each)")] = 10_000,
    tokens: Annotated[int, typer.Option(min=1, max=65_536, help="token ids per block")] = 16,
    rounds: Annotated[int, typer.Option(min=1, help="rounds of each mode (the fastest kept)")] = 3,
) -> None:
    """vLLM-format KV events: server time per event and delay to a ZeroMQ subscriber (bench/kv_events.py)."""
    from kvshelf.bench.kv_events import run

    run(json_path=str(json_path) if json_path else None, puts=puts, tokens=tokens, rounds=rounds, console=console)


def bench_dashboard(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    calls: Annotated[int, typer.Option(min=10, help="data calls timed")] = 500,
) -> None:
    """The admin dashboard's data endpoint: server time per call (bench/dashboard.py)."""
    from kvshelf.bench.dashboard import run

    run(json_path=str(json_path) if json_path else None, calls=calls, console=console)


def bench_chaos(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    seconds: Annotated[float, typer.Option(min=5, help="length of the run")] = 60,
    clients: Annotated[int, typer.Option(min=1, max=64)] = 8,
    redis_down: Annotated[float, typer.Option(min=0, help="seconds Redis stays down")] = 10,
    durability: Annotated[str, typer.Option(help="the server's --durability: fsync or interval")] = "fsync",
) -> None:
    """Reliability: mixed traffic while the server is SIGKILLed and restarted and Redis goes away."""
    from kvshelf.bench.chaos import run
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.service.serve import DURABILITY

    if durability not in DURABILITY:
        raise KVShelfError(f"--durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
    result = run(json_path=str(json_path) if json_path else None, seconds=seconds, clients=clients,
                 redis_down_s=redis_down, durability=durability, console=console)
    if not result["ok"]:
        raise typer.Exit(1)


def bench_abuse(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    seconds: Annotated[float, typer.Option(
        min=4, help="length of the run (half alone, half under abuse; --elsewhere adds a half)")] = 60,
    max_block: Annotated[str, typer.Option(help="the server's --max-block")] = "4MiB",
    max_call: Annotated[str, typer.Option(help="the server's --max-call (the per-call limit of the figures)")
                        ] = "32MiB",
    quota: Annotated[str, typer.Option(help="the server's per-namespace --quota")] = "16MiB",
    max_inflight: Annotated[str | None, opt("the server's --max-inflight (default: the server's)")] = None,
    tenant_streams: Annotated[int | None, opt("the server's --tenant-streams (default: the server's)")] = None,
    idle_timeout: Annotated[float | None, opt("the server's --idle-timeout (default: the server's)")] = None,
    idle_streams: Annotated[int, typer.Option(min=0, help="idle PutBlocks streams the abuser holds open")] = 16,
    strike_burst: Annotated[int | None, opt("the server's --strike-burst (default: the server's; 0: off)")] = None,
    attacks: Annotated[str, typer.Option(help="the abuser's attacks, comma-separated: streams (idle and slow), "
                                              "bad (oversized, bomb, malformed), memory (padded messages, the "
                                              "Hadamard bomb), quota; only when named: dupkeys (one key many "
                                              "times in a get), silentdata (silent data-path connections), "
                                              "slowhttp (silent and slow /metrics and dashboard connections), "
                                              "labels (made-up model names as metric labels), subscriptions "
                                              "(KV events: subscription floods, oversized frames), replay (KV "
                                              "events: replay requests never read, floods, bursts, no topic); "
                                              "or cpu alone, a control: the abuser process burns --cpu-share of "
                                              "a core and calls nothing"
                                        )] = "streams,bad,memory,quota",
    cpu_share: Annotated[float, typer.Option(min=0.05, max=1.0, help="with --attacks cpu: the share of one core "
                                             "the abuser burns (the four attacks cost it about 0.6)")] = 0.6,
    disk_codec: Annotated[str | None, opt("the server's --disk-codec (default: as sent; int8: the server "
                                           "decodes every put to re-encode it)")] = None,
    elsewhere: Annotated[bool, typer.Option(help="a control phase before the abuse: the same abuser against a "
                                                 "second server on this machine (what sharing the machine's "
                                                 "cores costs the honest tenant)")] = False,
) -> None:
    """Fairness: an honest tenant's p50/p99 alone and while another tenant abuses the server; RSS, INTERNALs."""
    from kvshelf.bench.abuse import AbuseSettings, run
    from kvshelf.bench.abuser import ATTACKS, CONTROLS
    from kvshelf.kvstore.errors import KVShelfError

    chosen = tuple(a.strip() for a in attacks.split(",") if a.strip())
    if chosen != CONTROLS and (not chosen or not set(chosen) <= set(ATTACKS)):
        raise KVShelfError(f"--attacks must be a comma-separated subset of {', '.join(ATTACKS)}, or "
                           f"{', '.join(CONTROLS)} alone, got {attacks!r}")
    settings = AbuseSettings(seconds=seconds, max_block=max_block, max_call=max_call, quota=quota,
                             max_inflight=max_inflight, tenant_streams=tenant_streams, idle_timeout=idle_timeout,
                             idle_streams=idle_streams, attacks=chosen, strike_burst=strike_burst,
                             disk_codec=disk_codec, cpu_share=cpu_share, elsewhere=elsewhere)
    result = run(json_path=str(json_path) if json_path else None, settings=settings, console=console)
    if not result["ok"]:
        raise typer.Exit(1)

