"""Prefix reuse for hybrid models: KV blocks of the attention layers plus state snapshots at block boundaries.

``HybridPrefixLoader`` is ``CachedGenerator``'s ``PrefixLoader`` (``prefix_load``) for a model with recurrent-state
layers (``states.has_state_layers``), and takes and stores its snapshots:

- **Load** (``load``): of the cached full blocks (``lookup_prefix``), the deepest boundary that ends at most at
  the prompt's last-but-one token and has a valid snapshot is loaded: its blocks into the attention layers, its
  snapshot into the state layers. A state cannot be cut back, so the reused length is always a boundary. A
  boundary whose snapshot is missing (evicted), damaged, foreign (another model, dtype or namespace: the record's
  header), stored in a lossy codec not chosen, or whose layout does not match the model is skipped (counted in
  ``CachedGenerator.snapshot_stats``), and the next shallower one is tried; none: everything is prefilled. KV is
  never loaded without its state.
- **Store** (``prefill``, ``turn_snapshot``): snapshots are taken where the boundary's state exists during the
  call: the prompt is prefilled in segments ending at the chosen boundaries (every ``snapshot_every`` -th block
  boundary, and the end of ``cacheable_prefix``), each followed by a copy of the state; ``model.generate`` then
  prefills the rest. With ``store_generated`` the cache after generating holds exactly the stored sequence, so
  the end of the chat turn gets its snapshot too. A boundary at the prompt's very end (without
  ``store_generated``) has no snapshot: its state only exists inside ``generate``'s prefill.

Segment-wise prefill equals one prefill within fp32 summation order on the families of ``states.STATE_FAMILIES``
(their kernels continue from a cached conv and recurrent state).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
from transformers import PreTrainedModel

from kvshelf.adapters import hf
from kvshelf.adapters import states as st
from kvshelf.adapters.cache_bridge import cache_from_prepared
from kvshelf.adapters.prefix_load import Row
from kvshelf.kvstore.encoding import decode_block, encode_block, read_header
from kvshelf.kvstore.errors import ConfigError, KVShelfError
from kvshelf.kvstore.keys import BlockSpan, prefix_block_spans, state_key
from kvshelf.kvstore.protocol import BlockStore
from kvshelf.kvstore.snapshot import StateSnapshot, pack, unpack

#: default: a snapshot every 4th block boundary (plus the end of ``cacheable_prefix`` and of each chat turn)
DEFAULT_SNAPSHOT_EVERY = 4
#: codecs a snapshot may be written in (``raw`` exact; ``fp16`` / ``bf16`` opt in to rounding the state)
SNAPSHOT_CODECS = ("raw", "zstd", "fp16", "bf16")
Taken = list[tuple[BlockSpan, Any]]  # snapshots taken during a call: (boundary span, states.capture's snapshot)


def check_settings(snapshot_every: int, snapshot_codec: str) -> None:
    if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 0:
        raise ConfigError(f"snapshot_every must be an int >= 0 (0: only at cacheable_prefix and turn ends), got "
                          f"{snapshot_every!r}")
    if snapshot_codec not in SNAPSHOT_CODECS:
        raise ConfigError(f"snapshot_codec must be one of {list(SNAPSHOT_CODECS)}, got {snapshot_codec!r}")


_STATS = threading.Lock()  # a generator may be shared by threads


def new_stats() -> Counter:
    return Counter({"taken": 0, "stored": 0, "failed": 0, "hits": 0, "fallbacks": 0, "rejected": 0})


class HybridPrefixLoader:
    """Prefix reuse of a hybrid model (module docstring): loads blocks with their boundary's snapshot, takes
    snapshots while prefilling and stores them. ``stats`` (``new_stats``) counts snapshots taken, stored, failed
    (not stored: the answer stands), loaded (``hits``), ``rejected`` (damaged, foreign, lossy or mismatched: a miss,
    never a state) and ``fallbacks`` (loads that reused less than the cached blocks); ``last_error`` says why the
    last one was rejected or failed."""

    def __init__(self, model: PreTrainedModel, store: BlockStore | None, namespace: str, block_size: int,
                 snapshot_every: int, snapshot_codec: str, stats: Counter) -> None:
        self.model, self.store, self.namespace, self.block_size = model, store, namespace, block_size
        self.snapshot_every, self.snapshot_codec, self.stats = snapshot_every, snapshot_codec, stats
        self.last_error: str | None = None
        self._layouts: dict[str, tuple] = {}

    def _count(self, name: str, n: int = 1) -> None:
        with _STATS:
            self.stats[name] += n

    def _expected_layout(self, fingerprint: str) -> tuple:
        """The snapshot layout this model produces (one token through a fresh cache, once per fingerprint)."""
        if fingerprint not in self._layouts:
            cache = hf.new_cache(self.model.config)
            with torch.inference_mode():
                self.model(input_ids=torch.tensor([[0]], device=self.model.device), past_key_values=cache,
                           use_cache=True)
            self._layouts[fingerprint] = st.capture(cache, 1).layout()
        return self._layouts[fingerprint]

    def _snapshot(self, span: BlockSpan, last_token: int, fingerprint: str) -> StateSnapshot | None:
        """The valid snapshot of boundary ``span`` (counted get), or ``None`` (counted in ``stats``)."""
        key = state_key(span.key)
        try:
            (value,) = self.store.get_encoded_many([key], fingerprint=fingerprint, namespace=self.namespace)
            if value is None:  # held a moment ago: dropped since (damaged, or evicted)
                raise KVShelfError("it is no longer readable")
            header = read_header(value)
            if header.codec not in st.LOSSLESS_CODECS | {self.snapshot_codec}:
                raise KVShelfError(f"stored in codec {header.codec!r}, lossy for a state")
            block = decode_block(value, expected_key=key, expected_fingerprint=fingerprint,
                                 expected_namespace=self.namespace)
            snapshot = unpack(block)
            if snapshot.tokens != span.end or block.token_ids != (last_token,):
                raise KVShelfError(f"taken after token {snapshot.tokens}, not at the boundary {span.end}")
            if snapshot.layout() != self._expected_layout(fingerprint):
                raise KVShelfError("its state shapes or dtypes do not match the model's")
        except KVShelfError as exc:
            self._count("rejected", 1)
            self.last_error = f"snapshot at token {span.end}: {type(exc).__name__}: {exc}"
            return None
        return snapshot

    def load(self, row: Row, spans: list[BlockSpan], tokens: list[int], found: int, fingerprint: str) -> Row:
        """``row`` with the deepest cached boundary (blocks and snapshot) loaded, or nothing (module docstring)."""
        limit = len(row.ids) - 1
        depths = [depth for depth in range(found, 0, -1) if spans[depth - 1].end <= limit]
        held = (self.store.held([state_key(spans[d - 1].key) for d in depths], namespace=self.namespace)
                if depths else [])
        for rank, (depth, present) in enumerate(zip(depths, held, strict=True)):
            if not present:  # never taken at this boundary, or evicted
                continue
            span = spans[depth - 1]
            snapshot = self._snapshot(span, row.ids[span.end - 1], fingerprint)
            if snapshot is None:
                continue
            blocks = self.store.get_prepared_many([s.key for s in spans[:depth]], fingerprint=fingerprint,
                                                  namespace=self.namespace, tokens=tokens[:depth])
            if any(block is None for block in blocks):  # a block vanished: only a shallower boundary can serve
                continue
            cache = cache_from_prepared(blocks, self.model.config, device=self.model.device, dtype=self.model.dtype)
            st.restore(cache, snapshot, device=self.model.device)
            self._count("hits", 1)
            self._count("fallbacks", rank > 0)
            row.loaded = row.reused = span.end
            row.cache = cache
            return row
        self._count("fallbacks", bool(depths))
        return row

    def boundaries(self, ids: list[int], reused: int, cacheable_prefix: int | None,
                   fingerprint: str) -> list[BlockSpan]:
        """The stored spans of the prompt whose end gets a snapshot during prefill: past ``reused``, before the
        prompt's last token, every ``snapshot_every`` -th boundary and the end of ``cacheable_prefix``."""
        partial = cacheable_prefix is not None
        spans = prefix_block_spans(fingerprint, self.namespace, ids[: cacheable_prefix or len(ids)],
                                   self.block_size, partial=partial)
        every = self.snapshot_every
        chosen = []
        for i, span in enumerate(spans):
            if not reused < span.end < len(ids):
                continue
            if (every and (i + 1) % every == 0) or (partial and i == len(spans) - 1):
                chosen.append(span)
        return chosen

    def prefill(self, row: Row, cut: list[BlockSpan], cache: Any = None) -> tuple[Any, Taken]:
        """Prefill ``row.ids`` past ``row.reused`` into ``cache`` (default: a new one) segment by segment up to
        each boundary of ``cut``, snapshotting the state after each: the cache (holding the last boundary's
        tokens) and ``(span, snapshot)`` s."""
        cache = cache if cache is not None else hf.new_cache(self.model.config)
        start, taken = row.reused, []
        for span in cut:
            segment = torch.tensor([row.ids[start:span.end]], device=self.model.device)
            self.model(input_ids=segment, past_key_values=cache, use_cache=True)
            taken.append((span, st.capture(cache, span.end)))
            start = span.end
        self._count("taken", len(taken))
        return cache, taken

    def turn_snapshot(self, seq: list[int], cache: Any, reused: int, fingerprint: str) -> Taken:
        """The snapshot at the end of a chat turn: ``cache`` after ``generate`` holds ``seq`` (prompt and
        generated tokens but the last) exactly; its last (partial) stored block's boundary gets the state."""
        held = cache.get_seq_length()
        if held != len(seq) or held <= reused:
            return []
        span = prefix_block_spans(fingerprint, self.namespace, seq, self.block_size, partial=True)[-1]
        self._count("taken", 1)
        return [(span, st.capture(cache, held))]

    def put(self, taken: Taken, ids: list[int], fingerprint: str) -> int:
        """Store snapshots (now, in ``snapshot_codec``): the count stored."""
        if not taken or self.store is None:
            return 0
        items = []
        for span, snapshot in taken:
            record = pack(snapshot, last_token=ids[span.end - 1], fingerprint=fingerprint, namespace=self.namespace)
            key = state_key(span.key)
            items.append((key, encode_block(record, key, self.snapshot_codec)))
        try:
            stored = int(self.store.put_encoded_many(items))
        except KVShelfError as exc:  # the answer stands; a snapshot not stored is a later prefill, never wrong output
            self._count("failed", len(items))
            self.last_error = f"storing {len(items)} snapshots: {type(exc).__name__}: {exc}"
            return 0
        self._count("stored", stored)
        self._count("failed", len(items) - stored)  # not taken (a tier too small for one)
        return stored
