"""``kvshelf precompute`` (store a corpus's chunks for RAG) and ``kvshelf prepare-model`` (convert a bundled
model once)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import ModelOpt, console


def precompute(
    paths: Annotated[list[Path], typer.Argument(help=".txt files or .jsonl files ({title, abstract} or {text})")],
    data_dir: Annotated[Path | None, typer.Option(
        help="embedded store directory (default: $KVSHELF_DATA_DIR, else store under $KVSHELF_CACHE)")] = None,
    model: ModelOpt = "smollm2-135m",
    namespace: Annotated[str, typer.Option(help="tenant namespace of the chunks")] = "default",
    chunk_size: Annotated[int, typer.Option(min=1, help="tokens per chunk")] = 256,
    overlap: Annotated[int, typer.Option(min=0, help="tokens shared by consecutive chunks")] = 0,
    pin: Annotated[bool, typer.Option(help="pin the chunks in the store")] = False,
    dtype: Annotated[str, typer.Option(
        help="model dtype: float32, bfloat16 or float16 (blocks are keyed by it: generate in the same dtype)")
    ] = "float32",
    prefix: Annotated[str | None, typer.Option(
        help="the shared prefix the generator will have (system prompt, chat template head), as text")] = None,
    prefix_file: Annotated[Path | None, typer.Option(help="read the shared prefix from this file")] = None,
    modes: Annotated[str, typer.Option(
        help="comma-separated RAG modes to prepare: reuse, reuse-blend, block-attention")
    ] = "reuse,reuse-blend,block-attention",
    blend_base: Annotated[str, typer.Option(help="reuse-blend's chunk KV: block (after the prefix) or chunk")
                          ] = "block",
) -> None:
    """RAG: chunk documents and store what each mode reads (position-0 chunks, blocks after the prefix, the
    prefix itself); resumable, with a progress bar; prints the summary."""
    from kvshelf.adapters.model import load_model, resolve_dtype
    from kvshelf.adapters.rag import precompute as run_precompute
    from kvshelf.kvstore.embedded import open_embedded_store
    from kvshelf.kvstore.errors import KVShelfError

    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise KVShelfError(f"no such file(s): {', '.join(missing)}")
    if overlap >= chunk_size:
        raise KVShelfError(f"--overlap ({overlap}) must be smaller than --chunk-size ({chunk_size})")
    if prefix is not None and prefix_file is not None:
        raise KVShelfError("give the prefix as --prefix or --prefix-file, not both")
    if prefix_file is not None:
        if not prefix_file.is_file():
            raise KVShelfError(f"no such prefix file: {prefix_file}")
        prefix = prefix_file.read_text(encoding="utf-8")
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    allowed = ("reuse", "reuse-blend", "block-attention")
    if not chosen or any(m not in allowed for m in chosen):
        raise KVShelfError(f"--modes must be a comma-separated subset of {', '.join(allowed)}, got {modes!r}")
    if blend_base not in ("block", "chunk"):
        raise KVShelfError(f"--blend-base must be block or chunk, got {blend_base!r}")
    resolve_dtype(dtype)  # an unknown dtype is a clear error before the model loads
    loaded, tokenizer = load_model(model, dtype=dtype)
    store = open_embedded_store(data_dir)
    try:
        result = run_precompute(None, loaded, tokenizer, store, paths=paths, namespace=namespace,
                                chunk_size=chunk_size, overlap=overlap, pin=pin, prefix=prefix, modes=chosen,
                                blend_base=blend_base)
    finally:
        store.close()
    console.print_json(json.dumps(result.summary(), default=str))



def prepare_model(name: Annotated[str, typer.Argument(help="bundled model name")] = "smollm2-135m") -> None:
    """Convert a bundled model to the safetensors cache once (``make install`` runs this)."""
    from kvshelf.adapters.model import BUNDLED_MODELS, convert_bundled
    from kvshelf.kvstore.errors import KVShelfError

    if name not in BUNDLED_MODELS:
        raise KVShelfError(f"unknown bundled model {name!r}; bundled: {', '.join(sorted(BUNDLED_MODELS))}")
    console.print(f"{name}: {convert_bundled(name)}")

