"""The ``kvshelf`` command line: demo, server, benchmarks, model preparation and the store admin view.

The top of the house: this package may import every other part (service, bench, adapters, ...) and no part
imports it (``tests/test_dependencies.py``). Each module holds one group of commands as plain functions; the
list below makes them commands, in the order ``kvshelf --help`` shows them. The modules import typer and rich at
the top and everything heavy (torch, transformers, grpc, the store) inside the command that needs it, so
``kvshelf --help`` and a command's ``--help`` start in a fraction of a second (``tests/test_cli_imports.py``).
Run it as ``kvshelf ...`` (the console script) or ``python -m kvshelf.cli ...``.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from kvshelf.cli import bench_models, bench_store, dashboard, demo, events, explain, model, replay, serve, stats

app = typer.Typer(help="kvshelf: KV-cache management and context reuse for transformer LLMs.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Benchmarks (each writes JSON and prints a table).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _print_version(value: bool) -> None:
    if value:
        from kvshelf import __version__

        print(f"kvshelf {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="print the version (kvshelf X.Y.Z) and exit")
                                ] = False) -> None:
    """kvshelf: KV-cache management and context reuse for transformer LLMs."""

app.command()(demo.demo)
app.command()(serve.serve)
app.command()(serve.repair)
app.command()(replay.replay)
app.command()(model.precompute)
app.command("prepare-model")(model.prepare_model)
app.command()(stats.stats)
app.command()(events.events)
app.command()(dashboard.dashboard)
app.command()(explain.explain)

for _name, _command in (
    ("replay", replay.bench_replay),
    ("eviction-bounds", replay.bench_eviction_bounds),
    ("ttft", bench_models.bench_ttft),
    ("rag", bench_models.bench_rag),
    ("rag-chain", bench_models.bench_rag_chain),
    ("serve", bench_models.bench_serve),
    ("pruning", bench_models.bench_pruning),
    ("longctx", bench_models.bench_longctx),
    ("codecs", bench_models.bench_codecs),
    ("mla", bench_models.bench_mla),
    ("gpu", bench_models.bench_gpu),
    ("vllm", bench_models.bench_vllm),
    ("lmdb", bench_store.bench_lmdb),
    ("lmdb-capacity", bench_store.bench_lmdb_capacity),
    ("store", bench_store.bench_store),
    ("clear", bench_store.bench_clear),
    ("kv-events", bench_store.bench_kv_events),
    ("dashboard", bench_store.bench_dashboard),
    ("chaos", bench_store.bench_chaos),
    ("abuse", bench_store.bench_abuse),
):
    bench_app.command(_name)(_command)


def main() -> None:
    """Entry point: our errors become one readable line and exit code 2; help that is not a terminal is not cut
    at rich's 80 columns."""
    from kvshelf.cli.common import PIPE_HELP_WIDTH, width_unset

    if width_unset():
        import typer.rich_utils

        typer.rich_utils.MAX_WIDTH = PIPE_HELP_WIDTH
    try:
        app()
    except Exception as exc:
        # One of ours was raised only if kvshelf.kvstore.errors is loaded: looked up there, not imported (which
        # would load the store, and torch, for every run of the command line).
        errors = sys.modules.get("kvshelf.kvstore.errors")
        if errors is None or not isinstance(exc, errors.KVShelfError):
            raise
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/bold red] {exc}", highlight=False)
        sys.exit(2)
