"""RAG chunk caches (TurboRAG, Lu et al. 2024), Block-Attention (Sun et al. 2024), CacheBlend selective recompute
(Yao et al. 2025) and APE-style scaling (Yang et al. 2025) for HF models through a kvshelf store.

Offline, ``precompute(documents, ..., prefix=...)`` chunks documents by tokens (``reuse.chunking.chunk_tokens``)
and stores what each query-time mode needs (``modes``, all by default): each chunk's KV computed alone at position
0 (``rag_chunk_key``: ``reuse``, and ``reuse-blend`` with ``blend_base="chunk"``), each chunk's KV encoded after
the shared prefix (``prefixed_block_key``: ``block-attention``, and ``reuse-blend`` with the default
``blend_base="block"``) and the prefix itself. It returns ``ChunkHandle``s (document, span, token ids, text) that
``RAGGenerator`` takes as chunks. At query time ``RAGGenerator.generate(chunks, question, mode=...)``:

* ``full``: no reuse; the prefix, the chunks and the question are prefilled together (the reference);
* ``reuse``: the chunks' KV is loaded in the given order, keys re-rotated to their new positions, and only the
  question is prefilled (TurboRAG);
* ``reuse-blend``: independently encoded chunks (by default the Block-Attention blocks below, each encoded after
  the shared prefix, as CacheBlend's reference code encodes every chunk after the prompt's opening tokens;
  ``blend_base="chunk"``: TurboRAG's position-0 chunks), then every token is recomputed through layers
  ``0..select_layer-1`` (one layer by default) and only the K/V projections of layer ``select_layer``; the
  ``ratio`` (default 15%) of chunk tokens whose KV deviates most there go on through the remaining layers, and
  their fresh KV is blended in (CacheBlend);
* ``block-attention``: each chunk is encoded after the shared prefix only (a block-diagonal mask) and cached
  under a key that includes the prefix; the question (the last block) attends to everything.

Every mode decodes through HF ``model.generate`` (``adapters.decode``): the reuse modes hand it the assembled
cache of every prompt row and the last row's logits, both computed by the engine, as its prefill
(``decode.generate_prefilled``), so no forward over the prompt runs in ``generate`` and sampling arguments, logits
processors and streamers work on every mode (APE alone keeps a greedy loop). ``stream(...)`` iterates the new
tokens; ``generate_batch`` answers several questions in one call.

The prefix is tokenized the same way at precompute and query time (``prefix_ids``), and a chunk longer than the
generator's ``chunk_size`` is split by the same function as at precompute, so a document given at query time as it
was given to ``precompute`` hits. A chunk is never used for another model: chunk keys include the model
fingerprint, and a loaded block is checked again. A chunk not stored for this model is recomputed (and stored) by
default, or raises ``ChunkMissingError`` with ``on_missing="error"``, naming the chunk, the kind of block, the
mode and why it is missing.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters import hf
from kvshelf.adapters.cache_bridge import blocks_from_cache
from kvshelf.adapters.decode import (
    EOS_DEFAULT,
    Generated,
    eos_set,
    generate_from_cache,
    generate_prefilled,
    greedy_with_bias,
)
from kvshelf.adapters.fingerprint import model_fingerprint, other_dtype_fingerprints
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.lifecycle import Closable
from kvshelf.adapters.model_label import label_blocks
from kvshelf.adapters.prompts import prompt_ids
from kvshelf.adapters.reuse_engine import (
    Layout,
    check_engine,
    check_positions,
    embed,
    folded_attention,
    last_logits,
    layer_kv,
    layer_windows,
    prefill_rows,
    run_layers,
    write_kv,
)
from kvshelf.adapters.streaming import TokenStream
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError
from kvshelf.kvstore.protocol import BlockStore, namespace_of
from kvshelf.reuse.blend import DEFAULT_RATIO, check_ratio, kv_deviation, select_recompute
from kvshelf.reuse.chunking import check_chunking, chunk_spans, chunk_tokens
from kvshelf.reuse.errors import ChunkMissingError, ContextTooLongError, ForeignChunkError
from kvshelf.reuse.keys import prefix_digest, prefixed_block_key, rag_chunk_key
from kvshelf.reuse.masks import PREFIX, block_mask

MODES = ("full", "reuse", "reuse-blend", "block-attention")
PRECOMPUTE_MODES = MODES[1:]  # what ``precompute`` can prepare (``full`` reuses nothing)
FEATURE = "RAG chunk reuse"  # what a refusal names (``UnsupportedModelError``)
PRECOMPUTE_FEATURE = "RAG precompute"
BLEND_BASES = ("block", "chunk")
BLEND_GROUP_ROWS = 64  # reuse-blend: queries per causal attention group (see ``run_layers``)
DEFAULT_CHUNK_SIZE = 256  # tokens per chunk, at precompute and at query time
CHUNK, BLOCK, PREFIX_KIND = "chunk", "block", "prefix"  # kinds of stored KV (see ``needed_kinds``)
Text = str | Sequence[int]


def _ids(tokenizer: PreTrainedTokenizerBase | None, text: Text) -> list[int]:
    """Token ids of a document, chunk, prefix or question: text goes inside the prompt (no special tokens)."""
    return prompt_ids(text, tokenizer, add_special_tokens=False)


def prefix_ids(tokenizer: PreTrainedTokenizerBase | None, prefix: Text | None) -> list[int]:
    """The shared prefix's token ids, as both ``precompute`` and ``RAGGenerator`` make them (no special tokens
    added: a chat template's head already holds its own); ``None`` is no prefix."""
    return [] if prefix is None else _ids(tokenizer, prefix)


def needed_kinds(modes: Iterable[str], blend_base: str = "block") -> set[str]:
    """The kinds of stored KV the ``modes`` read: ``"chunk"`` (alone at position 0), ``"block"`` (after the
    prefix), and ``"prefix"`` (the prefix's own KV, read by every mode but ``full`` when there is a prefix)."""
    kinds: set[str] = set()
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; use one of {MODES}")
        if mode == "reuse" or (mode == "reuse-blend" and blend_base == "chunk"):
            kinds.add(CHUNK)
        elif mode in ("block-attention", "reuse-blend"):
            kinds.add(BLOCK)
    return kinds | ({PREFIX_KIND} if kinds else set())


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


@torch.inference_mode()
def compute_chunk(model: PreTrainedModel, ids: Sequence[int], fingerprint: str, namespace: str) -> KVBlock:
    """The KV of ``ids`` computed alone at position 0: a block ``[layers, kv_heads, len(ids), head_dim]``."""
    input_ids = torch.tensor([list(ids)], device=model.device)
    cache = DynamicCache(config=model.config)
    hf.keep_sliding_history(cache)  # a sliding-window layer keeps every token for the block (attention unchanged)
    out = model(input_ids=input_ids, use_cache=True, past_key_values=cache, logits_to_keep=1)
    (block,) = blocks_from_cache(out.past_key_values, ids, start=0, end=len(ids), block_size=len(ids),
                                 fingerprint=fingerprint, namespace=namespace)
    return label_blocks([block], model)[0]


@torch.inference_mode()
def compute_blocks(model: PreTrainedModel, prefix: Sequence[int], prefix_block: KVBlock | None,
                   chunks: Sequence[Sequence[int]], fingerprint: str, namespace: str) -> list[KVBlock]:
    """Each chunk encoded after the prefix only (Block-Attention, Sun et al. 2024), at positions
    ``len(prefix)...``: all in one forward under a block-diagonal mask. Blocks ``[layers, kv_heads, n, head_dim]``
    with ``start_pos = len(prefix)``; ``prefix_block`` is the prefix's KV at 0 (``None`` without a prefix)."""
    p = len(prefix)
    total = p + sum(len(c) for c in chunks)
    layout = Layout.empty(model, total)
    if prefix_block is not None:
        layout.fill(0, prefix_block.keys, prefix_block.values)
    segments = torch.full((total,), PREFIX, dtype=torch.long)
    ids: list[int] = []
    positions: list[int] = []
    starts: list[int] = []
    row = p
    for n, chunk in enumerate(chunks):
        segments[row : row + len(chunk)] = n
        ids += chunk
        positions += list(range(p, p + len(chunk)))
        starts.append(row)
        row += len(chunk)
    rows = torch.arange(p, total)
    run_layers(model, layout, embed(model, ids), torch.tensor(positions), rows,
               block_mask(rows, segments, model.dtype), range(model.config.num_hidden_layers))
    out = []
    for start, chunk in zip(starts, chunks, strict=True):
        k, v = layout.take(torch.arange(start, start + len(chunk)))
        out.append(KVBlock(k, v, tuple(int(t) for t in chunk), p, fingerprint, namespace))
    return label_blocks(out, model)


@dataclass(frozen=True)
class ChunkHandle:
    """A chunk made by ``precompute``: ``RAGGenerator`` takes it as a chunk (its exact token ids, never
    re-tokenized). ``document`` is the document's index in the call (texts first, then files), ``index`` the
    chunk's index in its document, ``[start, end)`` its token span there; ``text`` the decoded chunk (``None``
    without a tokenizer that decodes). ``fingerprint`` and ``namespace`` name the model and tenant it was stored
    for: a generator of another refuses it (``ForeignChunkError``)."""

    document: int
    index: int
    start: int
    end: int
    token_ids: tuple[int, ...]
    text: str | None
    fingerprint: str
    namespace: str
    chunk_size: int
    overlap: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


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


def _decoded(tokenizer: PreTrainedTokenizerBase | None, ids: Sequence[int]) -> str | None:
    decode = getattr(tokenizer, "decode", None)
    return decode(list(ids), skip_special_tokens=False) if callable(decode) else None


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
    if not modes or "full" in modes:
        raise ConfigError(f"modes must be a non-empty subset of {PRECOMPUTE_MODES} ('full' reuses nothing), "
                          f"got {list(modes)}")
    if blend_base not in BLEND_BASES:
        raise ConfigError(f"blend_base must be one of {BLEND_BASES}, got {blend_base!r}")
    kinds = needed_kinds(modes, blend_base)
    check_chunking(chunk_size, overlap)
    namespace = namespace_of(store, namespace)
    texts = list(documents or []) + read_documents(paths)
    fingerprint = model_fingerprint(model)
    prefix_tokens = prefix_ids(tokenizer, prefix)
    handles: list[ChunkHandle] = []
    for d, text in enumerate(texts):
        ids = _ids(tokenizer, text)
        for i, (start, end) in enumerate(chunk_spans(len(ids), chunk_size, overlap)):
            handles.append(ChunkHandle(d, i, start, end, tuple(ids[start:end]), _decoded(tokenizer, ids[start:end]),
                                       fingerprint, namespace, chunk_size, overlap))
    longest = max((h.num_tokens for h in handles), default=0)
    check_positions(model, rotaries, longest + (len(prefix_tokens) if BLOCK in kinds else 0), PRECOMPUTE_FEATURE)
    started = time.perf_counter()
    counts = {kind: {"computed": 0, "skipped": 0} for kind in sorted(kinds)}
    computed_tokens = 0

    def held(key: bytes) -> bool:
        return bool(store.held([key], namespace=namespace)[0])

    def put(kind: str, key: bytes, block: KVBlock) -> None:
        store.put_many([(key, block)], pin=pin)
        counts[kind]["computed"] += 1

    prefix_block: KVBlock | None = None
    if prefix_tokens and kinds:
        key = rag_chunk_key(fingerprint, namespace, prefix_tokens)
        if held(key):
            counts[PREFIX_KIND]["skipped"] += 1
        else:
            prefix_block = compute_chunk(model, prefix_tokens, fingerprint, namespace)
            computed_tokens += len(prefix_tokens)
            put(PREFIX_KIND, key, prefix_block)
    chunks_computed = 0
    for handle in tqdm(handles, desc="precompute chunks", unit="chunk", disable=not progress):
        ids = list(handle.token_ids)
        before = sum(c["computed"] for c in counts.values())
        at_zero: KVBlock | None = None
        if CHUNK in kinds:
            key = rag_chunk_key(fingerprint, namespace, ids)
            if held(key):
                counts[CHUNK]["skipped"] += 1
            else:
                at_zero = compute_chunk(model, ids, fingerprint, namespace)
                computed_tokens += len(ids)
                put(CHUNK, key, at_zero)
        if BLOCK in kinds:
            key = prefixed_block_key(fingerprint, namespace, prefix_tokens, ids)
            if held(key):
                counts[BLOCK]["skipped"] += 1
            elif not prefix_tokens:  # after an empty prefix a block is the chunk alone at position 0
                block = at_zero or compute_chunk(model, ids, fingerprint, namespace)
                computed_tokens += 0 if at_zero is not None else len(ids)
                put(BLOCK, key, block)
            else:
                if prefix_block is None:
                    (prefix_block,) = store.get_many([rag_chunk_key(fingerprint, namespace, prefix_tokens)],
                                                     fingerprint=fingerprint, namespace=namespace)
                    if prefix_block is None:  # evicted since the probe above
                        prefix_block = compute_chunk(model, prefix_tokens, fingerprint, namespace)
                (block,) = compute_blocks(model, prefix_tokens, prefix_block, [ids], fingerprint, namespace)
                computed_tokens += len(ids)
                put(BLOCK, key, block)
        chunks_computed += sum(c["computed"] for c in counts.values()) > before
    return PrecomputeResult(
        chunks=handles, documents=len(texts), computed=chunks_computed, skipped=len(handles) - chunks_computed,
        tokens=sum(h.num_tokens for h in handles),
        computed_tokens=computed_tokens, seconds=round(time.perf_counter() - started, 3),
        dtype=str(model.dtype).removeprefix("torch."), modes=modes, prefix_tokens=len(prefix_tokens),
        prefix_digest=prefix_digest(prefix_tokens) if prefix_tokens else None, kinds=counts)


@dataclass(frozen=True)
class RAGResult:
    """One answer of ``RAGGenerator.generate``."""

    mode: str
    new_ids: list[int]
    text: str | None
    prompt_tokens: int
    reused_chunks: int  # chunks (or blocks) whose KV came from the store (or from an earlier row of the batch)
    computed_chunks: int  # chunks computed by this call (missing in the store)
    recomputed_tokens: int  # reuse-blend: chunk tokens recomputed through the upper layers
    ttft_s: float
    total_s: float
    first_logits: torch.Tensor = field(repr=False)  # [vocab] float32, raw (before any logits processor)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # all_logits=True: [vocab] per new token
    chunks: int = 0  # chunks after splitting (a text longer than chunk_size counts its pieces)


@dataclass
class _Chunk:
    """A chunk of one call: its token ids and how to name it in a message."""

    index: int
    ids: list[int]
    label: str


class RAGGenerator(Closable):
    """Query-time assembly of cached chunks.

    Args:
        model, tokenizer, store: the HF model, its tokenizer (for string inputs), a kvshelf store (``None``:
            every chunk is computed per call).
        prefix: an optional shared prefix (system prompt, a chat template's head) placed before the chunks, as
            text or ids (tokenized by ``prefix_ids``, as ``precompute`` does); its KV is cached as a chunk at 0.
        recompute_ratio: ``reuse-blend``'s share of chunk tokens recomputed (CacheBlend's r, default 0.15).
        select_layer: the layer at which ``reuse-blend`` measures KV deviation (default 1; layer 0's K/V do not
            depend on context, so it cannot be 0).
        blend_base: the chunk KV ``reuse-blend`` starts from: ``"block"`` (default; each chunk encoded after the
            shared prefix, the Block-Attention blocks) or ``"chunk"`` (each chunk alone at position 0, TurboRAG's).
            Chunks encoded alone make their first token an attention sink and miss the prefix's instructions; the
            needle benchmark (``kvshelf bench rag``) measures both.
        ape: ``(temperature, scale)``: APE-style attention for parallel chunks: later tokens' logits on chunk keys
            are divided by ``temperature`` and shifted by ``log(scale)``. Off by default (see the README). Greedy
            only (its bias cannot go through ``model.generate``).
        on_missing: ``"recompute"`` (default) or ``"error"`` for a chunk not stored for this model
            (``ChunkMissingError`` naming the chunk, the kind of block, the mode and why).
        chunk_size, overlap: a text or id list longer than ``chunk_size`` tokens is split exactly as ``precompute``
            splits a document (``reuse.chunking.chunk_tokens``), so a document given here as it was given to
            ``precompute`` (with the same ``chunk_size`` and ``overlap``) reuses its chunks; ``chunk_size=None``
            takes every chunk whole. A ``ChunkHandle`` is always taken whole (its own token ids).

    ``close()`` (or leaving a ``with`` block) ends the generator: any later call raises ``ConfigError``. The store
    is the caller's and stays open.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None,
        store: BlockStore | None = None, *, namespace: str | None = None, prefix: Text | None = None,
        recompute_ratio: float = DEFAULT_RATIO, select_layer: int = 1, blend_base: str = "block",
        ape: tuple[float, float] | None = None, on_missing: str = "recompute",
        chunk_size: int | None = DEFAULT_CHUNK_SIZE, overlap: int = 0,
    ) -> None:
        check_engine(model, FEATURE)  # refuses unsupported families and length-dependent RoPE now
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.namespace = namespace_of(store, namespace)
        self.prefix = prefix_ids(tokenizer, prefix)
        self.ratio = check_ratio(recompute_ratio)
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        if not 1 <= select_layer < layers:
            raise ConfigError(f"select_layer must be in [1, {layers - 1}], got {select_layer}")
        self.select_layer = select_layer
        if blend_base not in BLEND_BASES:
            raise ConfigError(f"blend_base must be one of {BLEND_BASES}, got {blend_base!r}")
        self.blend_base = blend_base
        if ape is not None and (ape[0] <= 0 or ape[1] <= 0):
            raise ConfigError(f"ape=(temperature, scale) must both be > 0, got {ape}")
        if ape is not None and any(w is not None for w in layer_windows(model)):
            raise UnsupportedModelError(f"model type {hf.model_type(model)!r}: APE scaling ({FEATURE}) is not "
                                        "supported on sliding-window layers")
        self.ape = ape
        if on_missing not in ("recompute", "error"):
            raise ConfigError(f"on_missing must be 'recompute' or 'error', got {on_missing!r}")
        self.on_missing = on_missing
        if chunk_size is not None:
            check_chunking(chunk_size, overlap)
        elif overlap:
            raise ConfigError("overlap needs a chunk_size")
        self.chunk_size, self.overlap = chunk_size, overlap

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint now: it follows the model's dtype and weights (``model_fingerprint``). A call
        reads it once and uses that value throughout (the ``fingerprint`` arguments below)."""
        return model_fingerprint(self.model)

    # -- inputs ---------------------------------------------------------------------------------------

    def _label(self, ids: Sequence[int]) -> str:
        text = _decoded(self.tokenizer, ids[:12])
        head = " ".join(map(str, ids[:6])) if text is None else " ".join(text.split())[:40]
        return f"{len(ids)} tokens: '{head}...'"

    def split(self, chunks: Sequence[Text | ChunkHandle], fingerprint: str | None = None) -> list[list[int]]:
        """The token ids of each chunk as a call uses them: texts and id lists longer than ``chunk_size`` split
        as ``precompute`` splits them, handles whole (after checking their model and namespace)."""
        return [c.ids for c in self._chunks(chunks, fingerprint or self.fingerprint)]

    def _chunks(self, chunks: Sequence[Text | ChunkHandle], fingerprint: str) -> list[_Chunk]:
        if isinstance(chunks, (str, ChunkHandle)):
            raise ConfigError("chunks must be a list of texts, token-id lists or ChunkHandles, not one "
                              f"{type(chunks).__name__}")
        out: list[_Chunk] = []
        for n, chunk in enumerate(chunks):
            if isinstance(chunk, ChunkHandle):
                if chunk.fingerprint != fingerprint or chunk.namespace != self.namespace:
                    raise ForeignChunkError(self._foreign(n, chunk, fingerprint))
                label = (f"chunk {len(out)} (document {chunk.document} chunk {chunk.index}, "
                         f"{self._label(chunk.token_ids)})")
                out.append(_Chunk(len(out), list(chunk.token_ids), label))
                continue
            try:
                ids = _ids(self.tokenizer, chunk)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"chunk {n} is neither text, token ids nor a ChunkHandle: {exc}") from None
            if not ids:
                raise ConfigError(f"chunk {n} is empty")
            pieces = [ids] if self.chunk_size is None else chunk_tokens(ids, self.chunk_size, self.overlap)
            for k, piece in enumerate(pieces):
                where = f"input {n}" + (f" piece {k + 1} of {len(pieces)}" if len(pieces) > 1 else "")
                out.append(_Chunk(len(out), piece, f"chunk {len(out)} ({where}, {self._label(piece)})"))
        return out

    def _foreign(self, n: int, handle: ChunkHandle, fingerprint: str) -> str:
        why = []
        if handle.fingerprint != fingerprint:
            dtypes = {fp: dtype for dtype, fp in other_dtype_fingerprints(self.model).items()}
            same = (f" (the same weights in {dtypes[handle.fingerprint].removeprefix('torch.')})"
                    if handle.fingerprint in dtypes else "")
            why.append(f"model {handle.fingerprint}{same}, this generator's model is {fingerprint} "
                       f"({str(self.model.dtype).removeprefix('torch.')})")
        if handle.namespace != self.namespace:
            why.append(f"namespace {handle.namespace!r}, this generator's is {self.namespace!r}")
        return (f"chunk {n} is a ChunkHandle (document {handle.document} chunk {handle.index}) precomputed for "
                f"{' and '.join(why)}; precompute it for this model and namespace, or pass its text")

    # -- chunk KV -------------------------------------------------------------------------------------

    def _load(self, keys: list[bytes], token_lists: list[list[int]], fingerprint: str) -> list[KVBlock | None]:
        if self.store is None or not keys:
            return [None] * len(keys)
        blocks = self.store.get_many(keys, fingerprint=fingerprint, namespace=self.namespace, copy=False,
                                     tokens=[len(t) for t in token_lists])
        for block, ids in zip(blocks, token_lists, strict=True):
            if block is not None and (block.fingerprint != fingerprint or list(block.token_ids) != ids):
                raise ForeignChunkError(
                    f"the store returned a chunk of model {block.fingerprint} / {len(block.token_ids)} tokens for "
                    f"model {fingerprint} / {len(ids)} tokens; it is never used"
                )
        return blocks

    def _key(self, kind: str, ids: Sequence[int], fingerprint: str) -> bytes:
        if kind == BLOCK:
            return prefixed_block_key(fingerprint, self.namespace, self.prefix, ids)
        return rag_chunk_key(fingerprint, self.namespace, ids)

    def _why_missing(self, kind: str, ids: Sequence[int], mode: str) -> tuple[str, str]:
        """``(reason, explanation)`` of a missing block, from uncounted ``held`` probes of the other kind and of
        the same weights' other dtypes (``other_dtype_fingerprints``)."""
        if self.store is None:
            return "no-store", "this generator has no store"
        fingerprint = self.fingerprint
        held = lambda key: bool(self.store.held([key], namespace=self.namespace)[0])  # noqa: E731
        p = len(self.prefix)
        if kind == BLOCK and held(self._key(CHUNK, ids, fingerprint)):
            return "other-kind", (f"its position-0 chunk is stored, but not its block after this {p}-token prefix "
                                  f"{prefix_digest(self.prefix)}: precompute with this prefix and modes including "
                                  f"{mode!r}")
        if kind == CHUNK and held(self._key(BLOCK, ids, fingerprint)):
            return "other-kind", (f"its block after the prefix is stored, but not the position-0 chunk {mode!r} "
                                  f"reads: precompute with modes including {mode!r}")
        for dtype, other in other_dtype_fingerprints(self.model).items():
            if held(self._key(kind, ids, other)):
                own = str(self.model.dtype).removeprefix("torch.")
                return "other-dtype", (f"it is stored for the same weights in {dtype.removeprefix('torch.')}, and "
                                       f"this model is {own}: load the model in that dtype, or precompute in {own}")
        after = " (or after another prefix)" if kind == BLOCK else ""
        split = ("" if self.chunk_size is None else
                 f", or chunked with another chunk_size / overlap than this generator's {self.chunk_size} / "
                 f"{self.overlap}")
        return "absent", (f"never precomputed for this model and namespace{after}, evicted, or stored by another "
                          f"model{split}")

    def _missing(self, kind: str, missing: list[_Chunk], mode: str, fingerprint: str) -> None:
        """Raise ``ChunkMissingError`` (``on_missing="error"``) for the first of ``missing``."""
        if self.on_missing != "error" or not missing:
            return
        first = missing[0]
        p = len(self.prefix)
        if kind == PREFIX_KIND:
            what = f"the {p}-token prefix {prefix_digest(self.prefix)} (its KV at position 0)"
        elif kind == BLOCK:
            what = f"{first.label} as a block after the {p}-token prefix" + (
                f" {prefix_digest(self.prefix)}" if p else "")
        else:
            what = f"{first.label} as a position-0 chunk"
        reason, why = self._why_missing(kind, first.ids, mode)
        more = f" (and {len(missing) - 1} more chunks)" if len(missing) > 1 else ""
        index = None if kind == PREFIX_KIND else first.index
        raise ChunkMissingError(
            f"mode {mode!r}: {what}{more} is not stored for model {fingerprint} in namespace {self.namespace!r}: "
            f"{why}; run precompute(..., prefix=<this generator's prefix>, modes=[{mode!r}]), or use "
            "on_missing='recompute'", index=index, kind=kind, mode=mode, reason=reason)

    def _fetch(self, kind: str, chunks: list[_Chunk], mode: str, fingerprint: str, prefix_block: KVBlock | None,
               memo: dict[bytes, KVBlock] | None) -> tuple[list[KVBlock], int]:
        """Each chunk's KV of ``kind`` (``"chunk"`` or ``"block"``): from ``memo`` (an earlier row of a batch), the
        store, or computed (and stored); returns (blocks, computed)."""
        memo = {} if memo is None else memo
        keys = [self._key(kind, c.ids, fingerprint) for c in chunks]
        blocks: list[KVBlock | None] = [memo.get(k) for k in keys]
        wanted = [i for i, b in enumerate(blocks) if b is None]
        wanted = [i for n, i in enumerate(wanted) if keys[i] not in {keys[j] for j in wanted[:n]}]  # once each
        for i, block in zip(wanted, self._load([keys[i] for i in wanted], [chunks[i].ids for i in wanted],
                                               fingerprint), strict=True):
            if block is not None:
                memo[keys[i]] = block
        missing = [i for i in wanted if keys[i] not in memo]
        self._missing(kind, [chunks[i] for i in missing], mode, fingerprint)
        if missing:
            ids = [chunks[i].ids for i in missing]
            if kind == BLOCK:
                made = compute_blocks(self.model, self.prefix, prefix_block, ids, fingerprint, self.namespace)
            else:
                made = [compute_chunk(self.model, c, fingerprint, self.namespace) for c in ids]
            for i, block in zip(missing, made, strict=True):
                memo[keys[i]] = block
                if self.store is not None:
                    self.store.put_many([(keys[i], block)])
        return [memo[k] for k in keys], len(missing)

    def chunk_blocks(self, chunks: list[list[int]], fingerprint: str | None = None, *,
                     mode: str = "reuse") -> tuple[list[KVBlock], int]:
        """Each chunk's KV at position 0, from the store or computed (and stored); returns (blocks, computed)."""
        self._check_open()
        fingerprint = fingerprint or self.fingerprint
        check_positions(self.model, check_engine(self.model, FEATURE), max(map(len, chunks), default=0), FEATURE)
        items = [_Chunk(i, list(c), f"chunk {i} ({self._label(c)})") for i, c in enumerate(chunks)]
        return self._fetch(CHUNK, items, mode, fingerprint, None, None)

    def _prefix_block(self, fingerprint: str | None = None, mode: str = "reuse") -> KVBlock | None:
        if not self.prefix:
            return None
        fingerprint = fingerprint or self.fingerprint
        key = rag_chunk_key(fingerprint, self.namespace, self.prefix)
        (block,) = self._load([key], [self.prefix], fingerprint)
        if block is None:
            self._missing(PREFIX_KIND, [_Chunk(-1, self.prefix, "prefix")], mode, fingerprint)
            block = compute_chunk(self.model, self.prefix, fingerprint, self.namespace)
            if self.store is not None:
                self.store.put_many([(key, block)])
        return block

    def block_attention_blocks(self, chunks: list[list[int]], prefix_block: KVBlock | None,
                               fingerprint: str | None = None, *,
                               mode: str = "block-attention") -> tuple[list[KVBlock], int]:
        """Each chunk encoded after the prefix only (Block-Attention), at positions ``len(prefix)...``; missing
        ones are computed together in one forward under a block-diagonal mask and stored."""
        self._check_open()
        fingerprint = fingerprint or self.fingerprint
        items = [_Chunk(i, list(c), f"chunk {i} ({self._label(c)})") for i, c in enumerate(chunks)]
        return self._fetch(BLOCK, items, mode, fingerprint, prefix_block, None)

    # -- generation -----------------------------------------------------------------------------------

    def generate(
        self, chunks: Sequence[Text | ChunkHandle], question: Text, *, mode: str = "reuse",
        max_new_tokens: int = 32, eos_token_id: int | Sequence[int] | None | str = EOS_DEFAULT,
        streamer: BaseStreamer | None = None, all_logits: bool = False, **generate_kwargs: Any,
    ) -> RAGResult:
        """Answer ``question`` over ``chunks`` (texts, token-id lists or ``ChunkHandle``s, in this order) after
        the prefix.

        Decoding is HF ``model.generate``'s: greedy by default; ``generate_kwargs`` (``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``logits_processor``...) go to it on every mode (APE: greedy only,
        ``ConfigError``). ``streamer`` (a HF ``BaseStreamer``) receives the prompt, then each new token; TTFT is
        measured all the same. ``eos_token_id``: ``"default"`` (the model's), ``None`` or ids. ``all_logits``: keep
        every step's raw logits in ``RAGResult.logits``.
        """
        return self._generate(chunks, question, mode=mode, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                              streamer=streamer, all_logits=all_logits, memo=None, **generate_kwargs)

    def stream(self, chunks: Sequence[Text | ChunkHandle], question: Text, **kwargs: Any) -> TokenStream[RAGResult]:
        """``generate`` as an iterator of new token ids (``streaming.TokenStream``: ``.texts()``, ``.result``);
        keyword arguments as ``generate`` (a ``streamer`` of your own is not taken here)."""
        self._check_open()
        if "streamer" in kwargs:
            raise ConfigError("stream() makes its own streamer; use generate(streamer=...) to pass one")
        return TokenStream(lambda streamer: self.generate(chunks, question, streamer=streamer, **kwargs),
                           self.tokenizer)

    def generate_batch(
        self, rows: Sequence[tuple[Sequence[Text | ChunkHandle], Text]], *, mode: str = "reuse",
        **kwargs: Any,
    ) -> list[RAGResult]:
        """Answer several ``(chunks, question)`` rows; keyword arguments as ``generate`` (one ``streamer`` sees
        every row in turn). Rows run one after another, sharing chunk loads: a chunk (or block) used by several
        rows is read from the store, or computed, once per call. Each row's answer is that of ``generate`` on the
        row alone (greedy: the same tokens; ``full`` and the modes' exact cases equal plain HF). The rows are not
        decoded as one padded batch: a padded batch's attention is not bit-identical to a single row's. Its
        ``reused_chunks`` counts a chunk another row of the call computed as reused."""
        self._check_open()
        if isinstance(rows, tuple) and len(rows) == 2 and isinstance(rows[1], str):
            raise ConfigError("generate_batch takes a list of (chunks, question) rows, not one row")
        rows = list(rows)
        if not rows:
            raise ConfigError("generate_batch needs at least one (chunks, question) row")
        for n, row in enumerate(rows):
            if not (isinstance(row, (tuple, list)) and len(row) == 2):
                raise ConfigError(f"row {n} of generate_batch is not a (chunks, question) pair")
        memo: dict[bytes, KVBlock] = {}
        return [self._generate(chunks, question, mode=mode, memo=memo, **kwargs) for chunks, question in rows]

    @torch.inference_mode()
    def _generate(
        self, chunks: Sequence[Text | ChunkHandle], question: Text, *, mode: str, memo: dict[bytes, KVBlock] | None,
        max_new_tokens: int = 32, eos_token_id: int | Sequence[int] | None | str = EOS_DEFAULT,
        streamer: BaseStreamer | None = None, all_logits: bool = False, **generate_kwargs: Any,
    ) -> RAGResult:
        self._check_open()
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; use one of {MODES}")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        started = time.perf_counter()
        fingerprint = self.fingerprint  # this call's
        items = self._chunks(chunks, fingerprint)
        if not items:
            raise ConfigError("no chunks given; pass at least one chunk")
        chunk_ids = [c.ids for c in items]
        q_ids = _ids(self.tokenizer, question)
        if not q_ids:
            raise ConfigError("the question is empty")
        p, c_total = len(self.prefix), sum(len(c) for c in chunk_ids)
        total = p + c_total + len(q_ids)
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions and total + max_new_tokens > max_positions:
            raise ContextTooLongError(
                f"prefix {p} + chunks {c_total} + question {len(q_ids)} + {max_new_tokens} new tokens = "
                f"{total + max_new_tokens} positions, over the model's {max_positions}"
            )
        all_ids = self.prefix + [t for c in chunk_ids for t in c] + q_ids
        decode = {"max_new_tokens": max_new_tokens, "tokenizer": self.tokenizer, "eos_token_id": eos_token_id,
                  "streamer": streamer, "all_logits": all_logits, **generate_kwargs}
        reused = computed = recomputed = 0
        if mode == "full":
            generated, _ = generate_from_cache(self.model, all_ids, None, None, **decode)
        else:  # before any work: a length-dependent RoPE must stay static over the whole context
            rotaries = check_engine(self.model, FEATURE)  # each layer's RoPE as the model has it now
            check_positions(self.model, rotaries, total + max_new_tokens, FEATURE)
            prefix_block = self._prefix_block(fingerprint, mode)
            kind = BLOCK if mode == "block-attention" or (mode == "reuse-blend" and self.blend_base == "block") \
                else CHUNK
            blocks, computed = self._fetch(kind, items, mode, fingerprint, prefix_block, memo)
            reused = len(blocks) - computed
            # every prompt row is the engine's, the last one included: model.generate takes its logits and the
            # cache as its prefill (decode.generate_prefilled) and runs no forward over the prompt
            layout = Layout.empty(self.model, total, zero=False, headroom=max_new_tokens + 1)
            if prefix_block is not None:
                layout.fill(0, prefix_block.keys, prefix_block.values)
            row = p
            for block in blocks:
                layout.fill_moved(self.model, row, block.keys, block.values, row - block.start_pos, rotaries)
                row += block.num_tokens
            q_rows = list(range(p + c_total, total))
            if mode == "reuse-blend":
                first, recomputed = self._blend(layout, chunk_ids, q_ids)
                generated = generate_prefilled(self.model, layout, all_ids, first, None, **decode)
            elif self.ape is not None:
                bias = self._apply_ape(layout, p, p + c_total)
                first = prefill_rows(self.model, layout, q_ids, q_rows, q_rows, column_bias=bias)
                generated = greedy_with_bias(
                    self.model, layout.to_cache(self.model), all_ids, first, total, max_new_tokens,
                    eos=eos_set(self.model, eos_token_id), column_bias=bias, streamer=streamer, all_logits=all_logits,
                    **generate_kwargs)
            else:
                first = prefill_rows(self.model, layout, q_ids, q_rows, q_rows)
                generated = generate_prefilled(self.model, layout, all_ids, first, None, **decode)
        return self._result(mode, generated, total, reused, computed, recomputed, started, len(items))

    def _result(self, mode: str, generated: Generated, total: int, reused: int, computed: int, recomputed: int,
                started: float, chunks: int) -> RAGResult:
        text = self.tokenizer.decode(generated.new_ids, skip_special_tokens=True) if self.tokenizer else None
        return RAGResult(mode, generated.new_ids, text, total, reused, computed, recomputed,
                         generated.first_token_at - started, generated.finished_at - started, generated.first_logits,
                         generated.logits, chunks)

    def _apply_ape(self, layout: Layout, start: int, end: int) -> torch.Tensor | None:
        """APE-style: chunk keys scaled by ``1 / temperature`` (logits / T) and a ``log(scale)`` column bias."""
        if self.ape is None:
            return None
        temperature, scale = self.ape
        for keys in layout.keys:
            keys[:, :, start:end] /= temperature
        bias = torch.zeros(layout.rows, dtype=torch.float32)
        bias[start:end] = math.log(scale)
        return bias

    def _blend(self, layout: Layout, chunk_ids: list[list[int]], q_ids: list[int]) -> tuple[torch.Tensor, int]:
        """CacheBlend (Yao et al., EuroSys 2025) selective recompute over the assembled ``layout`` (the prefix, the
        chunks and the question ``q_ids``).

        1. The whole prompt goes through layers ``0..select_layer-1`` (one layer by default) as a plain causal
           prefill; their fresh KV replaces the reused KV for every token.
        2. Layer ``select_layer``'s K/V projections of those outputs (no attention, no MLP) give every token's
           fresh KV there; the ``ratio`` of chunk tokens whose KV deviates most from the reused KV are chosen.
        3. Only the chosen tokens and the question run through the remaining layers, in causal groups over the
           blended cache; at the last layer all but the last prompt token need only their K/V, the last one the
           whole layer (its logits start decoding).

        Returns the last prompt token's next-token logits ``[vocab]`` and how many chunk tokens were chosen."""
        p = len(self.prefix)
        c_ids = [t for c in chunk_ids for t in c]
        n_chunk, total, sel = len(c_ids), layout.rows, self.select_layer
        last = self.model.config.num_hidden_layers - 1
        rows = torch.arange(total)
        with folded_attention(self.model):  # once for every pass below
            hidden = run_layers(self.model, layout, embed(self.model, self.prefix + c_ids + q_ids), rows, rows, None,
                                range(sel))
            new_k, new_v = layer_kv(self.model, sel, hidden, rows)
            span = slice(p, p + n_chunk)
            deviation = kv_deviation(layout.keys[sel][:, :, span], layout.values[sel][:, :, span],
                                     new_k[:, :, span], new_v[:, :, span])
            write_kv(layout, sel, rows, new_k, new_v)
            chosen = select_recompute(deviation, self.ratio) + p  # layout rows
            keep = torch.cat([chosen, torch.arange(p + n_chunk, total)])  # the question's rows last
            hidden = hidden[:, keep]
            if sel < last:
                hidden = run_layers(self.model, layout, hidden, keep, keep, None, range(sel, last),
                                    group_rows=BLEND_GROUP_ROWS)
                if keep.numel() > 1:
                    k, v = layer_kv(self.model, last, hidden[:, :-1], keep[:-1])
                    write_kv(layout, last, keep[:-1], k, v)
            hidden = run_layers(self.model, layout, hidden[:, -1:], keep[-1:], keep[-1:], None, range(last, last + 1))
        return last_logits(self.model, hidden), int(chosen.numel())
