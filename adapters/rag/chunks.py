"""RAG chunks and their KV: token ids of chunks and prefixes, the chunk a call uses (``Chunk``) or ``precompute``
made (``ChunkHandle``), and the two ways a chunk's KV is computed: alone at position 0 (TurboRAG, Lu et al. 2024)
and after a shared prefix under a block-diagonal mask (Block-Attention, Sun et al. 2024).

Kinds of stored KV: ``"chunk"`` (alone at position 0, ``rag_chunk_key``), ``"block"`` (after the prefix,
``prefixed_block_key``) and ``"prefix"`` (the prefix's own KV at position 0, stored as a chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters import hf
from kvshelf.adapters.cache_bridge import blocks_from_cache
from kvshelf.adapters.model_label import label_blocks
from kvshelf.adapters.prompts import prompt_ids
from kvshelf.adapters.reuse_engine import Layout, embed, run_layers
from kvshelf.kvstore.block import KVBlock
from kvshelf.reuse.masks import PREFIX, block_mask

DEFAULT_CHUNK_SIZE = 256  # tokens per chunk, at precompute and at query time
CHUNK, BLOCK, PREFIX_KIND = "chunk", "block", "prefix"  # kinds of stored KV
Text = str | Sequence[int]


def text_ids(tokenizer: PreTrainedTokenizerBase | None, text: Text) -> list[int]:
    """Token ids of a document, chunk, prefix or question: text goes inside the prompt (no special tokens)."""
    return prompt_ids(text, tokenizer, add_special_tokens=False)


def prefix_ids(tokenizer: PreTrainedTokenizerBase | None, prefix: Text | None) -> list[int]:
    """The shared prefix's token ids, as both ``precompute`` and ``RAGGenerator`` make them (no special tokens
    added: a chat template's head already holds its own); ``None`` is no prefix."""
    return [] if prefix is None else text_ids(tokenizer, prefix)


def decoded(tokenizer: PreTrainedTokenizerBase | None, ids: Sequence[int]) -> str | None:
    """``ids`` as text, or ``None`` without a tokenizer that decodes."""
    decode = getattr(tokenizer, "decode", None)
    return decode(list(ids), skip_special_tokens=False) if callable(decode) else None


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


@dataclass
class Chunk:
    """A chunk of one call: its index in the call, its token ids and how to name it in a message."""

    index: int
    ids: list[int]
    label: str


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
