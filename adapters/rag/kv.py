"""``ChunkKV``: where one RAG call's chunk KV comes from: an earlier row of the same batch (``memo``), the store,
or computed now (and stored); a chunk not stored for this model is recomputed, or raises ``ChunkMissingError``
(``on_missing="error"``) naming the chunk, the kind of block, the mode and why it is missing. A loaded block of
another model or other tokens is never used (``ForeignChunkError``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel

from kvshelf.adapters.fingerprint import model_fingerprint, other_dtype_fingerprints
from kvshelf.adapters.rag.chunks import BLOCK, CHUNK, PREFIX_KIND, Chunk, compute_blocks, compute_chunk
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.protocol import BlockStore
from kvshelf.reuse.errors import ChunkMissingError, ForeignChunkError
from kvshelf.reuse.keys import prefix_digest, prefixed_block_key, rag_chunk_key


@dataclass(frozen=True)
class ChunkKV:
    """The chunk KV source of a ``RAGGenerator`` (its model, store, namespace, prefix ids and settings)."""

    model: PreTrainedModel
    store: BlockStore | None
    namespace: str
    prefix: list[int]
    on_missing: str
    chunk_size: int | None
    overlap: int

    def key(self, kind: str, ids: Sequence[int], fingerprint: str) -> bytes:
        """The store key of ``ids``'s KV of ``kind`` (``"block"``: after the prefix; else alone at 0)."""
        if kind == BLOCK:
            return prefixed_block_key(fingerprint, self.namespace, self.prefix, ids)
        return rag_chunk_key(fingerprint, self.namespace, ids)

    def load(self, keys: list[bytes], token_lists: list[list[int]], fingerprint: str) -> list[KVBlock | None]:
        """The stored blocks of ``keys`` (``None``: not stored); ``ForeignChunkError`` for another model's."""
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

    def prefix_block(self, fingerprint: str, mode: str) -> KVBlock | None:
        """The prefix's KV at position 0 (stored as a chunk), loaded or computed (and stored); ``None`` without a
        prefix."""
        if not self.prefix:
            return None
        key = rag_chunk_key(fingerprint, self.namespace, self.prefix)
        (block,) = self.load([key], [self.prefix], fingerprint)
        if block is None:
            self.missing(PREFIX_KIND, [Chunk(-1, self.prefix, "prefix")], mode, fingerprint)
            block = compute_chunk(self.model, self.prefix, fingerprint, self.namespace)
            if self.store is not None:
                self.store.put_many([(key, block)])
        return block

    def fetch(self, kind: str, chunks: list[Chunk], mode: str, fingerprint: str, prefix_block: KVBlock | None,
              memo: dict[bytes, KVBlock] | None) -> tuple[list[KVBlock], int]:
        """Each chunk's KV of ``kind`` (``"chunk"`` or ``"block"``): from ``memo`` (an earlier row of a batch), the
        store, or computed (and stored); returns (blocks, computed)."""
        memo = {} if memo is None else memo
        keys = [self.key(kind, c.ids, fingerprint) for c in chunks]
        blocks: list[KVBlock | None] = [memo.get(k) for k in keys]
        wanted = [i for i, b in enumerate(blocks) if b is None]
        wanted = [i for n, i in enumerate(wanted) if keys[i] not in {keys[j] for j in wanted[:n]}]  # once each
        for i, block in zip(wanted, self.load([keys[i] for i in wanted], [chunks[i].ids for i in wanted],
                                              fingerprint), strict=True):
            if block is not None:
                memo[keys[i]] = block
        missing = [i for i in wanted if keys[i] not in memo]
        self.missing(kind, [chunks[i] for i in missing], mode, fingerprint)
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

    def missing(self, kind: str, missing: list[Chunk], mode: str, fingerprint: str) -> None:
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
        reason, why = self.why_missing(kind, first.ids, mode)
        more = f" (and {len(missing) - 1} more chunks)" if len(missing) > 1 else ""
        index = None if kind == PREFIX_KIND else first.index
        raise ChunkMissingError(
            f"mode {mode!r}: {what}{more} is not stored for model {fingerprint} in namespace {self.namespace!r}: "
            f"{why}; run precompute(..., prefix=<this generator's prefix>, modes=[{mode!r}]), or use "
            "on_missing='recompute'", index=index, kind=kind, mode=mode, reason=reason)

    def why_missing(self, kind: str, ids: Sequence[int], mode: str) -> tuple[str, str]:
        """``(reason, explanation)`` of a missing block, from uncounted ``held`` probes of the other kind and of
        the same weights' other dtypes (``other_dtype_fingerprints``)."""
        if self.store is None:
            return "no-store", "this generator has no store"
        fingerprint = model_fingerprint(self.model)
        p = len(self.prefix)
        if kind == BLOCK and self._held(self.key(CHUNK, ids, fingerprint)):
            return "other-kind", (f"its position-0 chunk is stored, but not its block after this {p}-token prefix "
                                  f"{prefix_digest(self.prefix)}: precompute with this prefix and modes including "
                                  f"{mode!r}")
        if kind == CHUNK and self._held(self.key(BLOCK, ids, fingerprint)):
            return "other-kind", (f"its block after the prefix is stored, but not the position-0 chunk {mode!r} "
                                  f"reads: precompute with modes including {mode!r}")
        for dtype, other in other_dtype_fingerprints(self.model).items():
            if self._held(self.key(kind, ids, other)):
                own = str(self.model.dtype).removeprefix("torch.")
                return "other-dtype", (f"it is stored for the same weights in {dtype.removeprefix('torch.')}, and "
                                       f"this model is {own}: load the model in that dtype, or precompute in {own}")
        after = " (or after another prefix)" if kind == BLOCK else ""
        split = ("" if self.chunk_size is None else
                 f", or chunked with another chunk_size / overlap than this generator's {self.chunk_size} / "
                 f"{self.overlap}")
        return "absent", (f"never precomputed for this model and namespace{after}, evicted, or stored by another "
                          f"model{split}")

    def _held(self, key: bytes) -> bool:
        return bool(self.store.held([key], namespace=self.namespace)[0])
