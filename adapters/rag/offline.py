"""``precompute``: the offline step of RAG reuse. Documents are chunked by tokens (``reuse.chunking.chunk_tokens``)
and what each query-time mode reads is stored (``registry.needed_kinds``): each chunk's KV alone at position 0
(``rag_chunk_key``; TurboRAG, Lu et al. 2024), each chunk's KV encoded after the shared prefix
(``prefixed_block_key``; Block-Attention, Sun et al. 2024) and the prefix itself. Returns ``ChunkHandle`` s that
``RAGGenerator`` takes as chunks."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.rag.chunks import (
    BLOCK,
    CHUNK,
    DEFAULT_CHUNK_SIZE,
    PREFIX_KIND,
    ChunkHandle,
    Text,
    compute_blocks,
    compute_chunk,
    decoded,
    prefix_ids,
    text_ids,
)
from kvshelf.adapters.rag.modes.registry import PRECOMPUTE_MODES, needed_kinds
from kvshelf.adapters.reuse_engine import check_engine, check_positions
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.protocol import BlockStore, namespace_of
from kvshelf.reuse.chunking import check_chunking, chunk_spans
from kvshelf.reuse.keys import prefix_digest, prefixed_block_key, rag_chunk_key

PRECOMPUTE_FEATURE = "RAG precompute"
BLEND_BASES = ("block", "chunk")


def read_documents(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Documents from files: a ``.jsonl`` gives one per line (``text``, or ``title`` + ``abstract``); any other
    file is one document."""
    docs: list[str] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"document file {p} does not exist")
        if p.suffix == ".jsonl":
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{p}: line {n} is not JSON: {exc}") from None
                text = record.get("text") or f"{record.get('title', '')}. {record.get('abstract', '')}"
                docs.append(text)
        else:
            docs.append(p.read_text(encoding="utf-8"))
    return docs


@dataclass(frozen=True)
class PrecomputeResult:
    """What ``precompute`` did. ``chunks`` are the handles, in document order. ``result[key]`` and ``summary()``
    give the summary: ``documents``, ``chunks`` (how many), ``computed`` (chunks for which something was computed
    and stored now), ``skipped`` (chunks the store held all of already), ``tokens`` (of all chunks),
    ``computed_tokens`` (tokens run through the model, the prefix's included), ``seconds``, ``dtype`` (blocks are
    keyed by it: generate with the model in that dtype), ``modes``, ``prefix_tokens``, ``prefix_digest`` and
    ``kinds``: per kind of stored KV (``chunk``: alone at position 0, ``block``: after the prefix, ``prefix``),
    how many were computed and how many were found stored."""

    chunks: list[ChunkHandle]
    documents: int
    computed: int
    skipped: int
    tokens: int
    computed_tokens: int
    seconds: float
    dtype: str
    modes: tuple[str, ...]
    prefix_tokens: int
    prefix_digest: str | None
    kinds: dict[str, dict[str, int]]

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["chunks"] = len(self.chunks)
        out["modes"] = list(self.modes)
        return out

    def __getitem__(self, key: str) -> Any:
        return self.summary()[key]

    def keys(self) -> list[str]:
        return list(self.summary())


class _Writer:
    """Computes and stores each kind of KV one chunk needs, skipping what the store holds (an uncounted ``held``
    probe); counts per kind and the tokens run through the model."""

    def __init__(self, model: PreTrainedModel, store: BlockStore, namespace: str, prefix: list[int],
                 kinds: set[str], pin: bool) -> None:
        self.model, self.store, self.namespace, self.prefix, self.kinds, self.pin = (
            model, store, namespace, prefix, kinds, pin)
        self.fingerprint = model_fingerprint(model)
        self.counts = {kind: {"computed": 0, "skipped": 0} for kind in sorted(kinds)}
        self.computed_tokens = 0
        self.prefix_block: KVBlock | None = None

    def _held(self, kind: str, key: bytes) -> bool:
        held = bool(self.store.held([key], namespace=self.namespace)[0])
        self.counts[kind]["skipped"] += held
        return held

    def _put(self, kind: str, key: bytes, block: KVBlock, tokens: int) -> None:
        self.store.put_many([(key, block)], pin=self.pin)
        self.counts[kind]["computed"] += 1
        self.computed_tokens += tokens

    def _chunk(self, ids: list[int]) -> KVBlock:
        return compute_chunk(self.model, ids, self.fingerprint, self.namespace)

    def prefix_kv(self) -> None:
        """The prefix's own KV at position 0 (when there is a prefix and something to store)."""
        if not self.prefix or not self.kinds:
            return
        key = rag_chunk_key(self.fingerprint, self.namespace, self.prefix)
        if not self._held(PREFIX_KIND, key):
            self.prefix_block = self._chunk(self.prefix)
            self._put(PREFIX_KIND, key, self.prefix_block, len(self.prefix))

    def chunk(self, ids: list[int]) -> bool:
        """Store what ``ids`` needs; whether anything was computed."""
        before = sum(c["computed"] for c in self.counts.values())
        at_zero: KVBlock | None = None
        if CHUNK in self.kinds:
            key = rag_chunk_key(self.fingerprint, self.namespace, ids)
            if not self._held(CHUNK, key):
                at_zero = self._chunk(ids)
                self._put(CHUNK, key, at_zero, len(ids))
        if BLOCK in self.kinds:
            self._block(ids, at_zero)
        return sum(c["computed"] for c in self.counts.values()) > before

    def _block(self, ids: list[int], at_zero: KVBlock | None) -> None:
        key = prefixed_block_key(self.fingerprint, self.namespace, self.prefix, ids)
        if self._held(BLOCK, key):
            return
        if not self.prefix:  # after an empty prefix a block is the chunk alone at position 0
            self._put(BLOCK, key, at_zero or self._chunk(ids), 0 if at_zero is not None else len(ids))
            return
        if self.prefix_block is None:
            (self.prefix_block,) = self.store.get_many([rag_chunk_key(self.fingerprint, self.namespace, self.prefix)],
                                                       fingerprint=self.fingerprint, namespace=self.namespace)
            if self.prefix_block is None:  # evicted since the probe
                self.prefix_block = self._chunk(self.prefix)
        (block,) = compute_blocks(self.model, self.prefix, self.prefix_block, [ids], self.fingerprint,
                                  self.namespace)
        self._put(BLOCK, key, block, len(ids))


def _handles(texts: list[Text], tokenizer: PreTrainedTokenizerBase, fingerprint: str, namespace: str,
             chunk_size: int, overlap: int) -> list[ChunkHandle]:
    handles: list[ChunkHandle] = []
    for d, text in enumerate(texts):
        ids = text_ids(tokenizer, text)
        for i, (start, end) in enumerate(chunk_spans(len(ids), chunk_size, overlap)):
            handles.append(ChunkHandle(d, i, start, end, tuple(ids[start:end]), decoded(tokenizer, ids[start:end]),
                                       fingerprint, namespace, chunk_size, overlap))
    return handles


def _check_modes(modes: tuple[str, ...], blend_base: str) -> set[str]:
    if not modes or "full" in modes:
        raise ConfigError(f"modes must be a non-empty subset of {PRECOMPUTE_MODES} ('full' reuses nothing), "
                          f"got {list(modes)}")
    if blend_base not in BLEND_BASES:
        raise ConfigError(f"blend_base must be one of {BLEND_BASES}, got {blend_base!r}")
    return needed_kinds(modes, blend_base)


def precompute(
    documents: Iterable[Text] | None,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    store: BlockStore,
    *,
    paths: Sequence[str | os.PathLike[str]] = (),
    namespace: str | None = None,
    prefix: Text | None = None,
    modes: Sequence[str] = PRECOMPUTE_MODES,
    blend_base: str = "block",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overlap: int = 0,
    pin: bool = False,
    progress: bool = True,
) -> PrecomputeResult:
    """Chunk documents (texts or token-id lists, and/or files) by tokens and store what ``modes`` need to reuse
    every chunk.

    ``reuse`` (and ``reuse-blend`` with ``blend_base="chunk"``) read each chunk's KV alone at position 0
    (TurboRAG); ``block-attention`` and ``reuse-blend`` (``blend_base="block"``, the default) read each chunk's
    KV encoded after ``prefix`` (Block-Attention), so give the ``prefix`` the generator will have (a system prompt,
    a chat template's head: ``RAGGenerator(prefix=...)``; both tokenize it with ``prefix_ids``). With a prefix, the
    prefix's own KV is stored too. Without a prefix, a block is the position-0 chunk's KV (computed once, stored
    under both keys).

    Each document is split by ``reuse.chunking.chunk_tokens(ids, chunk_size, overlap)``, the function
    ``RAGGenerator`` splits a longer chunk with (give it the same ``chunk_size`` and ``overlap``). Resumable: what
    the store holds already (for this model, dtype, namespace and prefix) is skipped (an uncounted ``held`` probe),
    and each block is stored as soon as it is computed, so an interrupted run loses at most one chunk.
    """
    rotaries = check_engine(model, PRECOMPUTE_FEATURE)  # chunks no RAG mode could use are never stored
    modes = tuple(dict.fromkeys(modes))
    kinds = _check_modes(modes, blend_base)
    check_chunking(chunk_size, overlap)
    namespace = namespace_of(store, namespace)
    texts = list(documents or []) + read_documents(paths)
    prefix_tokens = prefix_ids(tokenizer, prefix)
    writer = _Writer(model, store, namespace, prefix_tokens, kinds, pin)
    handles = _handles(texts, tokenizer, writer.fingerprint, namespace, chunk_size, overlap)
    longest = max((h.num_tokens for h in handles), default=0)
    check_positions(model, rotaries, longest + (len(prefix_tokens) if BLOCK in kinds else 0), PRECOMPUTE_FEATURE)
    started = time.perf_counter()
    writer.prefix_kv()
    computed = sum(writer.chunk(list(handle.token_ids)) for handle in
                   tqdm(handles, desc="precompute chunks", unit="chunk", disable=not progress))
    return PrecomputeResult(
        chunks=handles, documents=len(texts), computed=computed, skipped=len(handles) - computed,
        tokens=sum(h.num_tokens for h in handles),
        computed_tokens=writer.computed_tokens, seconds=round(time.perf_counter() - started, 3),
        dtype=str(model.dtype).removeprefix("torch."), modes=modes, prefix_tokens=len(prefix_tokens),
        prefix_digest=prefix_digest(prefix_tokens) if prefix_tokens else None, kinds=writer.counts)
