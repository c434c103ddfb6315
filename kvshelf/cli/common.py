"""What the command modules share: the console, the options several commands take, and the checks of their
values. Light on purpose: ``kvshelf --help`` imports this and typer, nothing of torch or transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions

#: the width of output that is not a terminal (a pipe, a file, CI) when ``$COLUMNS`` names none: rich's own 80
#: squeezes tables' cells into ``196… MiB``; tables take only the width their cells need, so this one never cuts them
PIPE_WIDTH = 1000
#: the width of ``--help`` that is not a terminal (its panels fill the width they are given)
PIPE_HELP_WIDTH = 160


def width_unset() -> bool:
    """Whether nothing names the output's width: not a terminal, and no ``$COLUMNS`` (or typer's
    ``$TERMINAL_WIDTH``)."""
    return not Console().is_terminal and not os.environ.get("COLUMNS") and not os.environ.get("TERMINAL_WIDTH")


class _LiveWidthConsole(Console):
    """A console whose width is decided at each print, not when it was made (the module's ``console`` is made at
    import): ``$COLUMNS`` when set, else the terminal's, else ``PIPE_WIDTH``."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit():
            return ConsoleDimensions(int(columns), dims.height)
        if self.is_terminal:
            return dims
        return ConsoleDimensions(PIPE_WIDTH, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def make_console(*, stderr: bool = False) -> Console:
    """A console as wide as ``$COLUMNS`` or its terminal, or ``PIPE_WIDTH`` when the output is not a terminal and
    names no width, as they are when it prints."""
    return _LiveWidthConsole(stderr=stderr)


console = make_console()

ModelOpt = Annotated[str, typer.Option(help="bundled name (smollm2-135m), local directory, or cached HF id")]
ThreadsOpt = Annotated[int | None, typer.Option(
    min=1, show_default=False, help="torch threads for this command and the processes it starts (default: torch's, "
    "one per core); on a small machine shared with other work, 1 keeps them from spinning against each other")]


def opt(help_text: str) -> Any:
    """An option shown without a default: None leaves the setting to the environment, a config file or the built-in
    default, which ``help_text`` states."""
    return typer.Option(help=help_text, show_default=False)


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads for this process, and ``$OMP_NUM_THREADS`` for the processes it starts (None:
    torch's default)."""
    if threads is None:
        return
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def check_device(device: str, dtype: str) -> None:
    """A clear error for a device or dtype the bench cannot use, before the model loads."""
    import torch

    from kvshelf.adapters.dtypes import resolve_dtype
    from kvshelf.kvstore.errors import KVShelfError

    resolve_dtype(dtype)
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise KVShelfError(f"--device {device!r}: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise KVShelfError(f"--device {device}: CUDA is not available on this machine")


def open_remote(address: str, flag: str, *, token: str | None, namespace: str, tls_ca: Path | None,
                connect_timeout: float) -> Any:
    """A ``RemoteStore`` of the server at ``address`` (no blocks move: no shared memory), after the address is
    checked (a ``ConfigError`` for a malformed one) and a TCP connection to it opened: an unknown host, a refused
    connection or an unreachable network is a ``TierUnavailableError`` at once, no answer one after
    ``connect_timeout`` seconds (``service.address.probe_server``)."""
    from kvshelf.service.address import probe_server
    from kvshelf.service.client import RemoteStore  # light: no torch (the admin calls move no blocks)

    probe_server(address, flag, connect_timeout)
    return RemoteStore(address, token=token, namespace=namespace, tls_ca=tls_ca, shared_memory=False,
                       connect_timeout_s=connect_timeout)


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

