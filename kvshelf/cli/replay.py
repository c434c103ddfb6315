"""``kvshelf replay``, ``kvshelf bench replay`` and ``kvshelf bench eviction-bounds``: request traces through the
real tier and eviction code, no model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvshelf.cli.common import console

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


def bench_eviction_bounds(
    trace: ReplayTrace,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the results here")] = None,
    capacities: Annotated[str, typer.Option(help="comma-separated fractions of the trace's distinct blocks")
                          ] = "0.05,0.1",
) -> None:
    """Upper bounds for any eviction policy on a trace: OPT, LRU, and LRU / GreedyDual-frequency told by an
    oracle which blocks will never be used again (bench/eviction_bounds.py)."""
    from kvshelf.bench.eviction_bounds import bounds, results_table, write
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.kvstore.replay import parse_capacities
    from kvshelf.kvstore.trace import read_trace

    specs = parse_capacities(capacities)
    fractions = [spec.fraction for spec in specs if spec.fraction is not None]
    if len(fractions) != len(specs):
        raise KVShelfError("--capacities: the bounds take fractions of the trace's distinct blocks, not byte sizes")
    report = bounds(read_trace(trace), fractions)
    console.print(results_table(report))
    if json_path is not None:
        console.print(f"wrote {write(report, json_path)}")


def _run_replay(trace_path: Path, capacities: str, policies: str | None, block_bytes: str, tier: str,
                json_path: Path | None, plot_path: Path | None, workers: int) -> None:
    from rich.progress import Progress

    from kvshelf.bench import replay_report
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.kvstore.replay import TIERS, check_block_bytes, check_policies, parse_capacities, replay
    from kvshelf.kvstore.trace import read_trace

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

