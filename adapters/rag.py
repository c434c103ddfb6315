"""RAG chunk caches (TurboRAG, Lu et al. 2024), Block-Attention (Sun et al. 2024), CacheBlend selective recompute
(Yao et al. 2025) and APE-style scaling (Yang et al. 2025) for HF models through a kvshelf store.

Offline, ``precompute`` chunks documents by tokens and stores each chunk's KV computed alone at position 0 under
its position-independent ``chunk_key``. At query time ``RAGGenerator.generate(chunks, question, mode=...)``:

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

A chunk is never used for another model: chunk keys include the model fingerprint, and a loaded block is checked
again. A chunk not stored for this model is recomputed (and stored) by default, or raises ``ChunkMissingError``
with ``on_missing="error"``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters import hf
from kvshelf.adapters.cache_bridge import blocks_from_cache
from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.prompts import prompt_ids
from kvshelf.adapters.reuse_engine import (
    Layout,
    check_engine,
    check_positions,
    embed,
    eos_ids,
    greedy_decode,
    last_logits,
    layer_kv,
    layer_windows,
    move_keys,
    prefill_rows,
    run_layers,
    write_kv,
)
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError
from kvshelf.kvstore.protocol import BlockStore, namespace_of
from kvshelf.reuse.blend import DEFAULT_RATIO, check_ratio, kv_deviation, select_recompute
from kvshelf.reuse.chunking import chunk_tokens
from kvshelf.reuse.errors import ChunkMissingError, ContextTooLongError, ForeignChunkError
from kvshelf.reuse.keys import prefixed_block_key, rag_chunk_key
from kvshelf.reuse.masks import PREFIX, block_mask

MODES = ("full", "reuse", "reuse-blend", "block-attention")
FEATURE = "RAG chunk reuse"  # what a refusal names (``UnsupportedModelError``)
PRECOMPUTE_FEATURE = "RAG precompute"
BLEND_BASES = ("block", "chunk")
BLEND_GROUP_ROWS = 64  # reuse-blend: queries per causal attention group (see ``run_layers``)
Text = str | Sequence[int]


def _ids(tokenizer: PreTrainedTokenizerBase | None, text: Text) -> list[int]:
    """Token ids of a document, chunk, prefix or question: text goes inside the prompt (no special tokens)."""
    return prompt_ids(text, tokenizer, add_special_tokens=False)


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
    return block


def precompute(
    documents: Iterable[str] | None,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    store: BlockStore,
    *,
    paths: Sequence[str | os.PathLike[str]] = (),
    namespace: str | None = None,
    chunk_size: int = 256,
    overlap: int = 0,
    pin: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Chunk documents (texts and/or files) by tokens and store each chunk's KV at position 0 (TurboRAG).

    Resumable: chunks already in the store (for this model and namespace) are skipped, and each chunk is stored
    as soon as it is computed, so an interrupted run loses at most one chunk. Returns a summary:
    ``{"documents", "chunks", "computed", "skipped", "tokens", "computed_tokens", "seconds", "dtype"}``: the
    chunks are keyed by the model's dtype (``dtype``; choose it when loading the model, ``load_model(...,
    dtype=...)`` or ``kvshelf precompute --dtype``), so generate with the model in that dtype to reuse them.
    """
    rotaries = check_engine(model, PRECOMPUTE_FEATURE)  # chunks no RAG mode could use are never stored
    namespace = namespace_of(store, namespace)
    texts = list(documents or []) + read_documents(paths)
    fingerprint = model_fingerprint(model)
    chunks = [c for text in texts for c in chunk_tokens(_ids(tokenizer, text), chunk_size, overlap)]
    check_positions(model, rotaries, max(map(len, chunks), default=0), PRECOMPUTE_FEATURE)
    started = time.perf_counter()
    computed = skipped = computed_tokens = 0
    for ids in tqdm(chunks, desc="precompute chunks", unit="chunk", disable=not progress):
        key = rag_chunk_key(fingerprint, namespace, ids)
        if store.contains_many([key], namespace=namespace, model=fingerprint) == 1:
            skipped += 1
            continue
        store.put_many([(key, compute_chunk(model, ids, fingerprint, namespace))], pin=pin)
        computed += 1
        computed_tokens += len(ids)
    return {"documents": len(texts), "chunks": len(chunks), "computed": computed, "skipped": skipped,
            "tokens": sum(len(c) for c in chunks), "computed_tokens": computed_tokens,
            "seconds": round(time.perf_counter() - started, 3), "dtype": str(model.dtype).removeprefix("torch.")}


@dataclass(frozen=True)
class RAGResult:
    """One ``RAGGenerator.generate`` call."""

    mode: str
    new_ids: list[int]
    text: str | None
    prompt_tokens: int
    reused_chunks: int  # chunks (or blocks) whose KV came from the store
    computed_chunks: int  # chunks computed by this call (missing in the store)
    recomputed_tokens: int  # reuse-blend: chunk tokens recomputed through the upper layers
    ttft_s: float
    total_s: float
    first_logits: torch.Tensor = field(repr=False)  # [vocab] float32


class RAGGenerator:
    """Query-time assembly of cached chunks.

    Args:
        model, tokenizer, store: the HF model, its tokenizer (for string inputs), a kvshelf store (``None``:
            every chunk is computed per call).
        prefix: an optional shared prefix (system prompt) placed before the chunks; cached as a chunk at 0.
        recompute_ratio: ``reuse-blend``'s share of chunk tokens recomputed (CacheBlend's r, default 0.15).
        select_layer: the layer at which ``reuse-blend`` measures KV deviation (default 1; layer 0's K/V do not
            depend on context, so it cannot be 0).
        blend_base: the chunk KV ``reuse-blend`` starts from: ``"block"`` (default; each chunk encoded after the
            shared prefix, the Block-Attention blocks) or ``"chunk"`` (each chunk alone at position 0, TurboRAG's).
            Chunks encoded alone make their first token an attention sink and miss the prefix's instructions; the
            needle benchmark (``kvshelf bench rag``) measures both.
        ape: ``(temperature, scale)``: APE-style attention for parallel chunks: later tokens' logits on chunk keys
            are divided by ``temperature`` and shifted by ``log(scale)``. Off by default (see the README).
        on_missing: ``"recompute"`` (default) or ``"error"`` for a chunk not stored for this model.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None,
        store: BlockStore | None = None, *, namespace: str | None = None, prefix: Text | None = None,
        recompute_ratio: float = DEFAULT_RATIO, select_layer: int = 1, blend_base: str = "block",
        ape: tuple[float, float] | None = None, on_missing: str = "recompute",
    ) -> None:
        check_engine(model, FEATURE)  # refuses unsupported families and length-dependent RoPE now
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.namespace = namespace_of(store, namespace)
        self.prefix = _ids(tokenizer, prefix) if prefix is not None else []
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

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint now: it follows the model's dtype and weights (``model_fingerprint``). A call
        reads it once and uses that value throughout (the ``fingerprint`` arguments below)."""
        return model_fingerprint(self.model)

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

    def _missing(self, what: str, fingerprint: str) -> None:
        if self.on_missing == "error":
            raise ChunkMissingError(
                f"{what} is not stored for model {fingerprint} in namespace {self.namespace!r} (never "
                f"precomputed, evicted, or stored by another model); run precompute, or use on_missing='recompute'"
            )

    def chunk_blocks(self, chunks: list[list[int]], fingerprint: str | None = None) -> tuple[list[KVBlock], int]:
        """Each chunk's KV at position 0, from the store or computed (and stored); returns (blocks, computed)."""
        fingerprint = fingerprint or self.fingerprint
        check_positions(self.model, check_engine(self.model, FEATURE), max(map(len, chunks), default=0), FEATURE)
        keys = [rag_chunk_key(fingerprint, self.namespace, ids) for ids in chunks]
        blocks = self._load(keys, chunks, fingerprint)
        computed = 0
        for i, (block, ids) in enumerate(zip(blocks, chunks, strict=True)):
            if block is None:
                self._missing(f"chunk {i} ({len(ids)} tokens)", fingerprint)
                blocks[i] = compute_chunk(self.model, ids, fingerprint, self.namespace)
                if self.store is not None:
                    self.store.put_many([(keys[i], blocks[i])])
                computed += 1
        return blocks, computed  # type: ignore[return-value]

    def _prefix_block(self, fingerprint: str | None = None) -> KVBlock | None:
        if not self.prefix:
            return None
        fingerprint = fingerprint or self.fingerprint
        key = rag_chunk_key(fingerprint, self.namespace, self.prefix)
        (block,) = self._load([key], [self.prefix], fingerprint)
        if block is None:
            block = compute_chunk(self.model, self.prefix, fingerprint, self.namespace)
            if self.store is not None:
                self.store.put_many([(key, block)])
        return block

    def block_attention_blocks(self, chunks: list[list[int]], prefix_block: KVBlock | None,
                               fingerprint: str | None = None) -> tuple[list[KVBlock], int]:
        """Each chunk encoded after the prefix only (Block-Attention), at positions ``len(prefix)...``; missing
        ones are computed together in one forward under a block-diagonal mask and stored."""
        p = len(self.prefix)
        fingerprint = fingerprint or self.fingerprint
        keys = [prefixed_block_key(fingerprint, self.namespace, self.prefix, ids) for ids in chunks]
        blocks = self._load(keys, chunks, fingerprint)
        missing = [i for i, b in enumerate(blocks) if b is None]
        if missing:
            for i in missing:
                self._missing(f"block {i} ({len(chunks[i])} tokens, after a {p}-token prefix)", fingerprint)
            total = p + sum(len(chunks[i]) for i in missing)
            layout = Layout.empty(self.model, total)
            if prefix_block is not None:
                layout.fill(0, prefix_block.keys, prefix_block.values)
            segments = torch.full((total,), PREFIX, dtype=torch.long)
            ids, positions, starts, row = [], [], [], p
            for n, i in enumerate(missing):
                segments[row : row + len(chunks[i])] = n
                ids += chunks[i]
                positions += list(range(p, p + len(chunks[i])))
                starts.append(row)
                row += len(chunks[i])
            rows = torch.arange(p, total)
            hidden = embed(self.model, ids)
            run_layers(self.model, layout, hidden, torch.tensor(positions), rows,
                       block_mask(rows, segments, self.model.dtype), range(self.model.config.num_hidden_layers))
            for n, i in enumerate(missing):
                k, v = layout.take(torch.arange(starts[n], starts[n] + len(chunks[i])))
                blocks[i] = KVBlock(k, v, tuple(chunks[i]), p, fingerprint, self.namespace)
                if self.store is not None:
                    self.store.put_many([(keys[i], blocks[i])])
        return blocks, len(missing)  # type: ignore[return-value]

    # -- generation -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, chunks: Sequence[Text], question: Text, *, mode: str = "reuse", max_new_tokens: int = 32,
        eos_token_id: int | Sequence[int] | None | str = "default",
    ) -> RAGResult:
        """Answer ``question`` over ``chunks`` (in this order) after the prefix; greedy decoding."""
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; use one of {MODES}")
        started = time.perf_counter()
        chunk_ids = [_ids(self.tokenizer, c) for c in chunks]
        if any(not c for c in chunk_ids):
            raise ConfigError("a chunk is empty")
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
        if mode != "full":  # before any work: a length-dependent RoPE must stay static over the whole context
            check_positions(self.model, check_engine(self.model, FEATURE), total + max_new_tokens, FEATURE)
        reused = computed = recomputed = 0
        bias = None
        if mode == "full":
            ids = self.prefix + [t for c in chunk_ids for t in c] + q_ids
            out = self.model(input_ids=torch.tensor([ids], device=self.model.device), use_cache=True,
                             past_key_values=DynamicCache(config=self.model.config), logits_to_keep=1)
            cache, first = out.past_key_values, out.logits[0, -1].float()
        else:
            fingerprint = self.fingerprint  # this call's
            prefix_block = self._prefix_block(fingerprint)
            if mode == "block-attention" or (mode == "reuse-blend" and self.blend_base == "block"):
                blocks, computed = self.block_attention_blocks(chunk_ids, prefix_block, fingerprint)
            else:
                blocks, computed = self.chunk_blocks(chunk_ids, fingerprint)
            reused = len(blocks) - computed
            layout = Layout.empty(self.model, total, zero=False)  # every row is filled or computed below
            if prefix_block is not None:
                layout.fill(0, prefix_block.keys, prefix_block.values)
            row, rotaries = p, check_engine(self.model, FEATURE)  # each layer's RoPE as the model has it now
            for block in blocks:
                layout.fill(row, move_keys(block.keys, row - block.start_pos, rotaries), block.values)
                row += block.num_tokens
            q_rows = list(range(p + c_total, total))
            if mode == "reuse-blend":
                first, recomputed = self._blend(layout, chunk_ids, q_ids)
            else:
                bias = self._apply_ape(layout, p, p + c_total)
                first = prefill_rows(self.model, layout, q_ids, q_rows, q_rows, column_bias=bias)
            cache = layout.to_cache(self.model)
        decoded = greedy_decode(self.model, cache, first, total, max_new_tokens,
                                eos=eos_ids(self.model, eos_token_id), column_bias=bias)
        text = self.tokenizer.decode(decoded.new_ids, skip_special_tokens=True) if self.tokenizer else None
        return RAGResult(mode, decoded.new_ids, text, total, reused, computed, recomputed,
                         decoded.first_token_at - started, decoded.finished_at - started, first)

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
        """CacheBlend (Yao et al., EuroSys 2025) selective recompute over the assembled ``layout``.

        1. The whole prompt goes through layers ``0..select_layer-1`` (one layer by default) as a plain causal
           prefill; their fresh KV replaces the reused KV for every token.
        2. Layer ``select_layer``'s K/V projections of those outputs (no attention, no MLP) give every token's
           fresh KV there; the ``ratio`` of chunk tokens whose KV deviates most from the reused KV are chosen.
        3. Only the chosen tokens and the question run through the remaining layers, in causal groups over the
           blended cache; at the last layer the chosen tokens need only their K/V, the question the whole layer.
        """
        p = len(self.prefix)
        c_ids = [t for c in chunk_ids for t in c]
        n_chunk, total, sel = len(c_ids), layout.rows, self.select_layer
        last = self.model.config.num_hidden_layers - 1
        rows = torch.arange(total)
        hidden = run_layers(self.model, layout, embed(self.model, self.prefix + c_ids + q_ids), rows, rows, None,
                            range(sel))
        new_k, new_v = layer_kv(self.model, sel, hidden, rows)
        span = slice(p, p + n_chunk)
        deviation = kv_deviation(layout.keys[sel][:, :, span], layout.values[sel][:, :, span], new_k[:, :, span],
                                 new_v[:, :, span])
        write_kv(layout, sel, rows, new_k, new_v)
        chosen = select_recompute(deviation, self.ratio) + p  # layout rows
        keep = torch.cat([chosen, torch.arange(p + n_chunk, total)])
        hidden = run_layers(self.model, layout, hidden[:, keep], keep, keep, None, range(sel, last),
                            group_rows=BLEND_GROUP_ROWS)
        n_sel = int(chosen.numel())
        if n_sel and sel < last:
            k, v = layer_kv(self.model, last, hidden[:, :n_sel], chosen)
            write_kv(layout, last, chosen, k, v)
        hidden = run_layers(self.model, layout, hidden[:, n_sel:], keep[n_sel:], keep[n_sel:], None,
                            range(max(sel, last), last + 1))
        return last_logits(self.model, hidden), n_sel
