"""``kvshelf serve`` (the gRPC KV service) and ``kvshelf repair`` (salvage its damaged disk tier)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvshelf.cli.common import opt
from kvshelf.service.config import SETTINGS, Setting  # light: the standard library only (service/config.py)

_TYPES: dict[str, Any] = {"bool": bool | None, "int": int | None, "float": float | None}


def _option(spec: Setting) -> inspect.Parameter:
    """The option of one setting, from its metadata: flag, type, help (with its default)."""
    shown = spec.shown_default()
    help_text = f"{spec.help} (default {shown})" if shown else spec.help
    help_text = help_text.replace("[", "\\[")  # rich markup
    if spec.kind == "bool":
        decls = [f"{spec.flag}/--no-{spec.flag[2:]}" if spec.negatable else spec.flag]
        option = typer.Option(*decls, help=help_text, show_default=False)
    else:
        option = typer.Option(spec.flag, help=help_text, show_default=False)
    return inspect.Parameter(spec.key, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[_TYPES.get(spec.kind, str | None), option])


def serve(**settings: Any) -> None:
    """Run the gRPC KV service. Settings: flags > KVSHELF_* environment variables > --config TOML > defaults
    (docs/configuration.md)."""
    from kvshelf.service.config import load_config

    config_file = settings.pop("config", None)
    config = load_config(settings, config_file=config_file)  # bad settings refused before the store (and torch) load
    from kvshelf.service.serve import serve as run_server

    raise typer.Exit(run_server(config))


# the options come from the settings' metadata (service/config.py), then --config
_CONFIG_OPTION = inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=Annotated[Path | None, opt("TOML config file (or $KVSHELF_CONFIG)")])
serve.__signature__ = inspect.Signature([*map(_option, SETTINGS), _CONFIG_OPTION])  # type: ignore[attr-defined]
serve.__annotations__ = {p.name: p.annotation for p in serve.__signature__.parameters.values()}  # type: ignore


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

