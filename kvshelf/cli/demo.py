"""``kvshelf demo``: long-document QA with the embedded store, cold vs warm."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import ModelOpt, console


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

