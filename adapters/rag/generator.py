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

Where the parts live (``kvshelf.adapters.rag``): ``RAGGenerator`` here; the modes are classes behind
``modes.base.RAGMode``, named in ``modes.registry``; chunks and the computing of their KV in ``chunks``; where a
call's chunk KV comes from (memo, store, computed; ``on_missing``) in ``kv``; the offline step (``precompute``) in
``offline``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters.decode import EOS_DEFAULT, Generated
from kvshelf.adapters.fingerprint import model_fingerprint, other_dtype_fingerprints
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.lifecycle import Closable
from kvshelf.adapters.rag.chunks import (
    BLOCK,
    CHUNK,
    DEFAULT_CHUNK_SIZE,
    Chunk,
    ChunkHandle,
    Text,
    decoded,
    prefix_ids,
    text_ids,
)
from kvshelf.adapters.rag.kv import ChunkKV
from kvshelf.adapters.rag.modes.ape import ApeScaling
from kvshelf.adapters.rag.modes.base import FEATURE, RAGQuery, RAGSettings
from kvshelf.adapters.rag.modes.registry import get_mode
from kvshelf.adapters.rag.offline import BLEND_BASES
from kvshelf.adapters.reuse_engine import check_engine, check_positions
from kvshelf.adapters.streaming import TokenStream
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.protocol import BlockStore, namespace_of
from kvshelf.reuse.blend import DEFAULT_RATIO, check_ratio
from kvshelf.reuse.chunking import check_chunking, chunk_tokens
from kvshelf.reuse.errors import ContextTooLongError, ForeignChunkError


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
        if ape is not None:
            ApeScaling.check(model)
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
        text = decoded(self.tokenizer, ids[:12])
        head = " ".join(map(str, ids[:6])) if text is None else " ".join(text.split())[:40]
        return f"{len(ids)} tokens: '{head}...'"

    def split(self, chunks: Sequence[Text | ChunkHandle], fingerprint: str | None = None) -> list[list[int]]:
        """The token ids of each chunk as a call uses them: texts and id lists longer than ``chunk_size`` split
        as ``precompute`` splits them, handles whole (after checking their model and namespace)."""
        return [c.ids for c in self._chunks(chunks, fingerprint or self.fingerprint)]

    def _chunks(self, chunks: Sequence[Text | ChunkHandle], fingerprint: str) -> list[Chunk]:
        if isinstance(chunks, (str, ChunkHandle)):
            raise ConfigError("chunks must be a list of texts, token-id lists or ChunkHandles, not one "
                              f"{type(chunks).__name__}")
        out: list[Chunk] = []
        for n, chunk in enumerate(chunks):
            if isinstance(chunk, ChunkHandle):
                if chunk.fingerprint != fingerprint or chunk.namespace != self.namespace:
                    raise ForeignChunkError(self._foreign(n, chunk, fingerprint))
                label = (f"chunk {len(out)} (document {chunk.document} chunk {chunk.index}, "
                         f"{self._label(chunk.token_ids)})")
                out.append(Chunk(len(out), list(chunk.token_ids), label))
                continue
            try:
                ids = text_ids(self.tokenizer, chunk)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"chunk {n} is neither text, token ids nor a ChunkHandle: {exc}") from None
            if not ids:
                raise ConfigError(f"chunk {n} is empty")
            pieces = [ids] if self.chunk_size is None else chunk_tokens(ids, self.chunk_size, self.overlap)
            for k, piece in enumerate(pieces):
                where = f"input {n}" + (f" piece {k + 1} of {len(pieces)}" if len(pieces) > 1 else "")
                out.append(Chunk(len(out), piece, f"chunk {len(out)} ({where}, {self._label(piece)})"))
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

    def _kv(self) -> ChunkKV:
        """Where this generator's chunk KV comes from (its settings now)."""
        return ChunkKV(self.model, self.store, self.namespace, self.prefix, self.on_missing, self.chunk_size,
                       self.overlap)

    def _settings(self) -> RAGSettings:
        return RAGSettings(self.ratio, self.select_layer, self.blend_base, self.ape)

    def chunk_blocks(self, chunks: list[list[int]], fingerprint: str | None = None, *,
                     mode: str = "reuse") -> tuple[list[KVBlock], int]:
        """Each chunk's KV at position 0, from the store or computed (and stored); returns (blocks, computed)."""
        self._check_open()
        fingerprint = fingerprint or self.fingerprint
        check_positions(self.model, check_engine(self.model, FEATURE), max(map(len, chunks), default=0), FEATURE)
        items = [Chunk(i, list(c), f"chunk {i} ({self._label(c)})") for i, c in enumerate(chunks)]
        return self._kv().fetch(CHUNK, items, mode, fingerprint, None, None)

    def block_attention_blocks(self, chunks: list[list[int]], prefix_block: KVBlock | None,
                               fingerprint: str | None = None, *,
                               mode: str = "block-attention") -> tuple[list[KVBlock], int]:
        """Each chunk encoded after the prefix only (Block-Attention), at positions ``len(prefix)...``; missing
        ones are computed together in one forward under a block-diagonal mask and stored."""
        self._check_open()
        fingerprint = fingerprint or self.fingerprint
        items = [Chunk(i, list(c), f"chunk {i} ({self._label(c)})") for i, c in enumerate(chunks)]
        return self._kv().fetch(BLOCK, items, mode, fingerprint, prefix_block, None)

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
    @torch.inference_mode()
    def _generate(
        self, chunks: Sequence[Text | ChunkHandle], question: Text, *, mode: str, memo: dict[bytes, KVBlock] | None,
        max_new_tokens: int = 32, eos_token_id: int | Sequence[int] | None | str = EOS_DEFAULT,
        streamer: BaseStreamer | None = None, all_logits: bool = False, **generate_kwargs: Any,
    ) -> RAGResult:
        self._check_open()
        rag_mode = get_mode(mode)
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        started = time.perf_counter()
        fingerprint = self.fingerprint  # this call's
        items = self._chunks(chunks, fingerprint)
        if not items:
            raise ConfigError("no chunks given; pass at least one chunk")
        q_ids = text_ids(self.tokenizer, question)
        if not q_ids:
            raise ConfigError("the question is empty")
        query = RAGQuery(self.model, self.tokenizer, mode, fingerprint, self.prefix, items, q_ids, self._kv(), memo,
                         self._settings(), max_new_tokens, eos_token_id, streamer, all_logits, generate_kwargs)
        self._check_length(query)
        answer = rag_mode.answer(query)
        return self._result(mode, answer.generated, query.total, answer.reused, answer.computed, answer.recomputed,
                            started, len(items))

    def _check_length(self, query: RAGQuery) -> None:
        """``ContextTooLongError`` for a prompt and answer past the model's positions."""
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions and query.total + query.max_new_tokens > max_positions:
            c_total = query.total - len(query.prefix) - len(query.question)
            raise ContextTooLongError(
                f"prefix {len(query.prefix)} + chunks {c_total} + question {len(query.question)} + "
                f"{query.max_new_tokens} new tokens = {query.total + query.max_new_tokens} positions, over the "
                f"model's {max_positions}"
            )

    def _result(self, mode: str, generated: Generated, total: int, reused: int, computed: int, recomputed: int,
                started: float, chunks: int) -> RAGResult:
        text = self.tokenizer.decode(generated.new_ids, skip_special_tokens=True) if self.tokenizer else None
        return RAGResult(mode, generated.new_ids, text, total, reused, computed, recomputed,
                         generated.first_token_at - started, generated.finished_at - started, generated.first_logits,
                         generated.logits, chunks)
