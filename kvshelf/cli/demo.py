"""``kvshelf demo``: long-document QA with the embedded store, cold vs warm."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import ModelOpt, ThreadsOpt, console, set_threads


def demo(
    model: ModelOpt = "smollm2-135m",
    documents: Annotated[int, typer.Option(min=1, max=8, help="how many documents")] = 2,
    tokens: Annotated[int, typer.Option(min=300, max=7000, help="approximate tokens per document")] = 1800,
    data_dir: Annotated[Path | None, typer.Option(help="store directory (default: a temporary one)")] = None,
    remote: Annotated[str | None, typer.Option(help="use a `kvshelf serve` server at HOST:PORT instead")] = None,
    threads: ThreadsOpt = None,
) -> None:
    """Long-document QA with the embedded store: cold vs warm (memory, and disk in a new process) TTFT."""
    if remote is not None:
        from kvshelf.service.address import probe_server

        probe_server(remote, "--remote", 10.0)  # a bad or unreachable address: one line now, not after the model
    set_threads(threads)
    from kvshelf.cli.views.demo_job import run_demo

    run_demo(model_name=model, documents=documents, tokens=tokens,
             data_dir=str(data_dir) if data_dir else None, console=console, remote=remote)

