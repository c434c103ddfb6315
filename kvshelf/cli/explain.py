"""``kvshelf explain``: why a prompt misses in an embedded store, one line per finding (``adapters.miss``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import ModelOpt, ThreadsOpt, console, set_threads


def explain(
    prompt_file: Annotated[Path, typer.Option(help="the prompt, as UTF-8 text (tokenized as generate does)")],
    model: ModelOpt = "smollm2-135m",
    namespace: Annotated[str, typer.Option(help="the namespace the prompt is looked up in")] = "default",
    data_dir: Annotated[Path | None, typer.Option(
        help="embedded store directory (default: $KVSHELF_DATA_DIR, else store under $KVSHELF_CACHE)")] = None,
    dtype: Annotated[str, typer.Option(help="model dtype: float32, bfloat16 or float16")] = "float32",
    block_size: Annotated[int, typer.Option(min=1, help="tokens per prefix block, as the generator cuts them")
                          ] = 256,
    other_namespace: Annotated[list[str] | None, typer.Option(
        help="another namespace to look in (repeatable); the store's known ones are tried too")] = None,
    threads: ThreadsOpt = None,
) -> None:
    """Why a prompt misses: its blocks, how many the store holds, and each reason found for the rest (evicted,
    another dtype, block size, namespace or model, a chunk, other token ids, never stored). Exit code 0 when it
    explains; 2 with one line for bad input."""
    from kvshelf.kvstore.embedded import default_data_dir, open_embedded_store
    from kvshelf.kvstore.errors import KVShelfError

    if not prompt_file.is_file():
        raise KVShelfError(f"no such prompt file: {prompt_file}")
    try:
        text = prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KVShelfError(f"cannot read prompt file {prompt_file}: {exc}") from None
    if not text:
        raise KVShelfError(f"prompt file {prompt_file} is empty")
    directory = data_dir if data_dir is not None else default_data_dir()
    if not (directory / "lmdb").is_dir():
        raise KVShelfError(f"no kvshelf store at {directory} (expected {directory / 'lmdb'})")
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model, resolve_dtype

    resolve_dtype(dtype)  # an unknown dtype is a clear error before the model loads
    set_threads(threads)
    loaded, tokenizer = load_model(model, dtype=dtype)
    store = open_embedded_store(directory, memory_bytes=None, namespace=namespace)
    try:
        with CachedGenerator(loaded, tokenizer, store, block_size=block_size, write_behind=False) as gen:
            report = gen.explain(text, namespaces=other_namespace or ())
    finally:
        store.close()
    for line in report.lines():
        console.print(line, markup=False, highlight=False, soft_wrap=True)
