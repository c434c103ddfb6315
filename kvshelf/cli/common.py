"""What the command modules share: the console, the options several commands take, and the checks of their
values. Light on purpose: ``kvshelf --help`` imports this and typer, nothing of torch or transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

console = Console()

ModelOpt = Annotated[str, typer.Option(help="bundled name (smollm2-135m), local directory, or cached HF id")]


def opt(help_text: str) -> Any:
    """An option shown without a default: None leaves the setting to the environment, a config file or the built-in
    default, which ``help_text`` states."""
    return typer.Option(help=help_text, show_default=False)


def check_device(device: str, dtype: str) -> None:
    """A clear error for a device or dtype the bench cannot use, before the model loads."""
    import torch

    from kvshelf.adapters.model import resolve_dtype
    from kvshelf.kvstore.errors import KVShelfError

    resolve_dtype(dtype)
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise KVShelfError(f"--device {device!r}: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise KVShelfError(f"--device {device}: CUDA is not available on this machine")


def corpus_path(corpus: Path | None) -> Path | None:
    """The corpus to use: the given file (which must exist), else ../shared/data/abstracts.jsonl when present."""
    from kvshelf.bench.common import default_corpus
    from kvshelf.kvstore.errors import KVShelfError

    if corpus is not None and not corpus.is_file():
        raise KVShelfError(f"corpus {corpus} does not exist")
    return corpus or default_corpus()


def json_object(text: str | None, option: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object (``{}`` when None)."""
    from kvshelf.kvstore.errors import KVShelfError

    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KVShelfError(f"{option} must be a JSON object, got {text!r}: {exc.msg}") from None
    if not isinstance(value, dict):
        raise KVShelfError(f"{option} must be a JSON object, got {text!r}")
    return value


def ints(text: str, option: str) -> tuple[int, ...]:
    """``text`` as comma-separated positive integers (``--lengths 1024,2048``)."""
    from kvshelf.kvstore.errors import KVShelfError

    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise KVShelfError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise KVShelfError(f"{option} must be positive integers, got {text!r}")
    return values

