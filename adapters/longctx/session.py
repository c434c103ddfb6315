"""One long context under tier-backed sparse attention: segmented prefill to the store, sparse question and decode.

The context's KV lives in a ``BlockStore`` (LMDB, Redis, remote), one record per (layer, block of
``block_tokens`` tokens) so a layer fetches only what it attends to. In memory stay, per managed layer, the
first ``sinks`` tokens and a recent tail of ``window`` to ``window + block_tokens + segment`` tokens (an
``OwnedLayer``'s buffer), Quest min/max summaries of every stored block (``summary.BlockSummaries``), and a
byte-bounded LRU of hot decoded blocks (``hot.HotBlocks``). Each attention call (a prefill segment, the
question, a decode step, a scored chunk) selects, per layer and KV head, the ``top_blocks`` stored blocks of
highest vote, fetches their union (hot blocks first, the rest with one ``get_many``), and attends to sinks +
selected blocks + tail. With every block selected it is exact (full attention, up to float rounding).

After LeoAM, ShadowKV and "Exploiting sparsity for long context inference: million-token contexts on commodity
GPUs" (KV in a lower tier, only the blocks each step needs fetched), InfLLM (segmented prefill over a bounded
window with retrieved blocks), Quest (block bounds) and TokenSelect (per-head soft vote).

Shapes: ``h`` KV heads, ``g`` query heads per KV head, ``q`` queries, ``B`` block tokens, ``d`` head dim.
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.hf import OwnedLayer, cache_of_layers
from kvshelf.adapters.longctx.errors import BlockLostError, LongContextError, ResidentBudgetError
from kvshelf.adapters.longctx.hot import HotBlocks
from kvshelf.adapters.longctx.summary import BlockSummaries
from kvshelf.adapters.model_label import label_blocks
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.keys import block_key, layer_block_key
from kvshelf.kvstore.protocol import BlockStore, namespace_of
from kvshelf.kvstore.sizes import parse_size
from kvshelf.reuse.errors import ContextTooLongError

if TYPE_CHECKING:
    from kvshelf.adapters.longctx.settings import SparseSettings


@dataclass
class SparseStats:
    """What a session measured. Bytes are of the context's KV (keys + values) held in this process."""

    full_kv_bytes: int = 0  # the whole context's KV in the managed layers, at the model's dtype
    resident_peak_bytes: int = 0  # the most held at once: tails + summaries + hot blocks + one layer's fetch
    resident_limit_bytes: int = 0  # the setting it stays under
    kv_fraction: float = 1.0  # of the context's tokens, those each head attends per step (sinks + window + top-k)
    prefill_s: float = 0.0  # the context's segmented prefill
    ttft_s: float = 0.0  # the question's prefill to its first token
    tpot_s: float = 0.0  # mean time per output token after the first
    fetched_blocks: int = 0  # (layer, block) records read from the store
    hot_hits: int = 0  # (layer, block) records served from the hot blocks
    stored_blocks: int = 0  # (layer, block) records written
    top1_hits: int = 0  # tokens of the last ``nll`` call that were the model's top-1 prediction


@dataclass
class _Mark:
    """What ``SparseSession.rewind`` restores: the tokens seen, the blocks stored per layer, each managed layer's
    in-memory sinks + tail (copies of their filled part), the unmanaged layers' own caches (bounded: sliding
    windows) and the logits of the last token."""

    tokens: int
    stored: int
    tails: list[tuple[int, torch.Tensor, torch.Tensor]]
    others: dict[int, Any]
    last_logits: torch.Tensor | None
    nbytes: int
    taken: int  # of the nbytes, those the hot blocks gave up


def _partial(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax statistics of ``query [h, r, d]`` (float32) over ``keys``/``values`` ``[h, n, d]`` (``mask
    [r, n]``, ``True`` = attend): the row max ``[h, r, 1]``, the sum of ``exp(logit - max)`` ``[h, r, 1]`` and
    the unnormalized output ``[h, r, d_v]``."""
    logits = (query @ keys.float().transpose(1, 2)) * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    best = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp(logits - best)
    return best, weights.sum(dim=-1, keepdim=True), weights @ values.float()


class _Tail:
    """One managed layer's memory: a ``[1, h, capacity, d]`` key and value buffer, sinks then the tail."""

    def __init__(self, kv_heads: int, head_dim: int, value_dim: int, capacity: int, dtype: torch.dtype) -> None:
        self.keys = torch.empty(1, kv_heads, capacity, head_dim, dtype=dtype)
        self.values = torch.empty(1, kv_heads, capacity, value_dim, dtype=dtype)
        self.filled = 0  # positions of the buffer in use
        self.seen = 0  # tokens of the layer so far (absolute)
        self.stored = 0  # blocks moved to the store

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class SparseSession:
    """A context held in ``store`` with a bounded memory; made by ``TierSparse.session``."""

    def __init__(self, method: SparseSettings, model: Any, store: BlockStore, layers: list[int], *,
                 namespace: str | None = None) -> None:
        self.method, self.model, self.store = method, model, store
        self.namespace = namespace_of(store, namespace)
        self.fingerprint = model_fingerprint(model)
        self.layers = layers  # cache layer index of each managed (full-attention) layer
        self._slot = {layer: i for i, layer in enumerate(layers)}
        config = model.config.get_text_config(decoder=True)
        self.max_tokens = int(method.max_tokens or getattr(config, "max_position_embeddings", 0) or 0)
        if self.max_tokens <= 0:
            raise LongContextError("the model's config names no max_position_embeddings: give TierSparse(max_tokens=)")
        self.dtype = next(model.parameters()).dtype
        self.store_dtype = method.store_dtype or self.dtype
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        b = method.block_tokens
        self.capacity = method.sinks + method.window + b + method.segment
        self.max_blocks = max(1, -(-(self.max_tokens - method.sinks) // b))
        self._tails = [_Tail(self.kv_heads, self.head_dim, self.head_dim, self.capacity, self.dtype) for _ in layers]
        self.summaries = BlockSummaries(len(layers), self.kv_heads, self.head_dim, self.max_blocks,
                                        kind=method.summary)
        self._held_bytes = sum(t.nbytes for t in self._tails) + self.summaries.nbytes  # preallocated: fixed
        fixed = self._held_bytes + self._working_set_bytes()
        self.stats = SparseStats(resident_limit_bytes=method.resident_limit)
        if fixed > method.resident_limit:
            raise ResidentBudgetError(
                f"resident_bytes={method.resident_limit:,} cannot hold the sinks ({method.sinks}), window "
                f"({method.window}), segment ({method.segment}) and block summaries of {len(layers)} layers up to "
                f"{self.max_tokens:,} tokens plus one layer's fetch: they need {fixed:,} bytes; raise resident_bytes "
                "or lower window / segment / top_blocks / max_tokens")
        left = method.resident_limit - fixed
        if method.hot_bytes is not None:
            left = min(left, parse_size(method.hot_bytes, "hot_bytes"))
        self.hot = HotBlocks(left)
        self._fixed = fixed
        self._tokens: list[int] = []  # every token the layers have seen
        self._chain: list[bytes] = []  # chained key of each block (block i: tokens after the sinks)
        self._root: bytes | None = None
        self._last_logits: torch.Tensor | None = None
        self._prefilling = False
        self._mark: _Mark | None = None
        self._top_blocks = method.top_blocks
        self._context_tokens = 0
        self.cache = cache_of_layers(self._cache_layers(model))
        self._tag = hashlib.blake2b(method.tag().encode(), digest_size=16).digest()

    # -- memory accounting ------------------------------------------------------------------------------

    def _block_bytes(self, dtype: torch.dtype) -> int:
        return 2 * self.kv_heads * self.method.block_tokens * self.head_dim * dtype.itemsize

    def _working_set_bytes(self) -> int:
        """One layer's fetch at most: the union of every head's top blocks (store dtype) and their gathered copy."""
        m = self.method
        if m.per_head:  # the union of every head's top blocks, and their gathered copy
            top = min(max(m.top_blocks, m.prefill_top_blocks or 0), self.max_blocks)
            union = min(self.kv_heads * top, self.max_blocks)
            return union * self._block_bytes(self.store_dtype) + top * self._block_bytes(self.dtype)
        chunk = min(m.fetch_blocks, self.max_blocks)  # one chunk fetched, and its float32 copy
        return chunk * (self._block_bytes(self.store_dtype) + self._block_bytes(torch.float32))

    def _note_resident(self, transient: int) -> None:
        held = self._held_bytes + self.hot.bytes + transient
        self.stats.resident_peak_bytes = max(self.stats.resident_peak_bytes, held)

    def _cache_layers(self, model: Any) -> list[Any]:
        from kvshelf.adapters.hf import new_cache  # the model's own layers for the unmanaged ones (sliding)

        layers = list(new_cache(model.config).layers)
        for index in self.layers:
            layers[index] = OwnedLayer(self, index)
        return layers

    # -- LayerOwner ------------------------------------------------------------------------------------

    def seen(self, layer: int) -> int:
        return self._tails[self._slot[layer]].seen

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens' ``keys``/``values`` ``[1, h, q, d]`` in; the layer's in-memory sinks + tail out."""
        slot = self._slot[layer]
        tail = self._tails[slot]
        self._spill(layer, slot, tail)
        q = keys.shape[2]
        if tail.filled + q > self.capacity:
            raise LongContextError(f"{q} new tokens in one call exceed the segment ({self.method.segment}): feed "
                                   "the session through prefill / generate / nll")
        tail.keys[:, :, tail.filled:tail.filled + q].copy_(keys)
        tail.values[:, :, tail.filled:tail.filled + q].copy_(values)
        tail.filled += q
        tail.seen += q
        return tail.keys[:, :, :tail.filled], tail.values[:, :, :tail.filled]

    def _spill(self, layer: int, slot: int, tail: _Tail) -> None:
        """Move the tail's oldest full blocks beyond the window to the store (and their summaries, hot copies)."""
        m = self.method
        entries = []
        while tail.filled - m.sinks - m.block_tokens >= m.window:
            lo, hi = m.sinks, m.sinks + m.block_tokens
            index = tail.stored
            keys = tail.keys[0, :, lo:hi].to(self.store_dtype).clone()  # [h, B, d]
            values = tail.values[0, :, lo:hi].to(self.store_dtype).clone()
            self.summaries.add(slot, index, tail.keys[0, :, lo:hi])
            key = self._layer_key(layer, index)
            start = m.sinks + index * m.block_tokens
            entries.append((key, KVBlock(keys=keys.unsqueeze(0), values=values.unsqueeze(0),
                                         token_ids=tuple(self._tokens[start:start + m.block_tokens]),
                                         start_pos=start, fingerprint=self.fingerprint, namespace=self.namespace)))
            self.hot.put((slot, index), keys, values)
            rest = tail.filled - hi
            tail.keys[:, :, lo:lo + rest] = tail.keys[:, :, hi:tail.filled].clone()
            tail.values[:, :, lo:lo + rest] = tail.values[:, :, hi:tail.filled].clone()
            tail.filled -= m.block_tokens
            tail.stored += 1
        if entries:
            label_blocks([block for _, block in entries], self.model)
            self.store.put_many(entries)
            self.stats.stored_blocks += len(entries)
            self._note_resident(0)

    # -- keys ------------------------------------------------------------------------------------------

    def _chain_key(self, index: int) -> bytes:
        m = self.method
        if self._root is None:
            self._root = block_key(self.fingerprint, self.namespace, self._tag, self._tokens[: m.sinks])
        while len(self._chain) <= index:
            i = len(self._chain)
            start = m.sinks + i * m.block_tokens
            parent = self._chain[-1] if self._chain else self._root
            self._chain.append(block_key(self.fingerprint, self.namespace, parent,
                                         self._tokens[start:start + m.block_tokens]))
        return self._chain[index]

    def _layer_key(self, layer: int, index: int) -> bytes:
        return layer_block_key(self._chain_key(index), layer)

    # -- attention -------------------------------------------------------------------------------------

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """``query [1, h*g, q, d]`` (the last ``q`` tokens) over sinks + selected blocks + tail (``keys``/``values``
        ``[1, h, m, d]``, as ``update`` returned them): ``[1, q, h*g, d]``."""
        slot = self._slot[layer]
        tail = self._tails[slot]
        m = self.method
        blocks = tail.stored
        if not blocks:
            return self._dense(query, keys, values, scaling)
        if self._prefilling and m.prefill_top_blocks is None:  # an exact prefill: every block, a chunk at a time
            return self._streamed(layer, slot, list(range(blocks)), query, keys, values, scaling)
        top = m.prefill_top_blocks if self._prefilling and m.prefill_top_blocks is not None else self._top_blocks
        k = min(top, blocks)
        votes = self.summaries.votes(slot, blocks, query[0], scaling)  # [h, blocks]
        if not m.per_head:  # one top k for the layer (the heads' votes summed)
            chosen = torch.topk(votes.sum(0), k).indices.sort().values.tolist()
            return self._streamed(layer, slot, chosen, query, keys, values, scaling)
        chosen_h = torch.topk(votes, k, dim=-1).indices.sort(dim=-1).values  # [h, k]: each head its own
        union = torch.unique(chosen_h)  # sorted; the union is fetched
        fetched_k, fetched_v = self._fetch(layer, slot, union.tolist())  # [u, h, B, d]
        where = torch.searchsorted(union, chosen_h)  # [h, k]
        heads = torch.arange(self.kv_heads).unsqueeze(1)
        sel_k = fetched_k[where, heads].to(self.dtype).reshape(1, self.kv_heads, k * m.block_tokens, -1)
        sel_v = fetched_v[where, heads].to(self.dtype).reshape(1, self.kv_heads, k * m.block_tokens, -1)
        self._note_resident(fetched_k.nbytes + fetched_v.nbytes + sel_k.nbytes + sel_v.nbytes)
        s = min(m.sinks, keys.shape[2])
        all_k = torch.cat([keys[:, :, :s], sel_k, keys[:, :, s:]], dim=2)
        all_v = torch.cat([values[:, :, :s], sel_v, values[:, :, s:]], dim=2)
        return self._dense(query, all_k, all_v, scaling)

    @staticmethod
    def _dense(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        """sdpa of ``query [1, h*g, q, d]`` over ``keys``/``values`` ``[1, h, n, d]`` whose last ``q`` are the
        queries' own (causal there): ``[1, q, h*g, d]``."""
        q, n = query.shape[2], keys.shape[2]
        mask = torch.ones(q, n, dtype=torch.bool).tril(n - q) if q > 1 else None
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)

    def _streamed(self, layer: int, slot: int, chosen: list[int], query: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention over the stored blocks ``chosen`` (fetched ``fetch_blocks`` at a time) and the in-memory sinks
        + tail, merged by their softmax statistics (the online softmax of FlashAttention), so one layer never
        holds more than ``fetch_blocks`` fetched blocks: ``[1, q, h*g, d]``."""
        h, (_, hq, q, _) = self.kv_heads, query.shape
        grouped = query[0].float().reshape(h, (hq // h) * q, -1)  # [h, g*q, d] (rows: group head, then query)
        n = keys.shape[2]
        causal = torch.ones(q, n, dtype=torch.bool).tril(n - q).repeat(hq // h, 1)  # [g*q, n]
        best, total, acc = _partial(grouped, keys[0], values[0], scaling, causal)
        step = self.method.fetch_blocks
        for at in range(0, len(chosen), step):
            fetched_k, fetched_v = self._fetch(layer, slot, chosen[at:at + step])  # [c, h, B, d]
            c = fetched_k.shape[0]
            ks = fetched_k.transpose(0, 1).reshape(h, c * self.method.block_tokens, -1)
            vs = fetched_v.transpose(0, 1).reshape(h, c * self.method.block_tokens, -1)
            self._note_resident(fetched_k.nbytes + fetched_v.nbytes + 2 * ks.nbytes * 4 // ks.element_size())
            best2, total2, acc2 = _partial(grouped, ks, vs, scaling, None)
            merged = torch.maximum(best, best2)
            a, b = torch.exp(best - merged), torch.exp(best2 - merged)
            best, total, acc = merged, total * a + total2 * b, acc * a + acc2 * b
        out = (acc / total).reshape(h, hq // h, q, -1).reshape(hq, q, -1)  # [h*g, q, d_v]
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype)

    def _fetch(self, layer: int, slot: int, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``indices`` of ``layer``: hot first, the rest from the store in one ``get_many``;
        ``[u, h, B, d]`` keys and values at the store dtype. ``BlockLostError`` when one is gone."""
        found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        missing = []
        for index in indices:
            hit = self.hot.get((slot, index))
            if hit is None:
                missing.append(index)
            else:
                found[index] = hit
        self.stats.hot_hits += len(indices) - len(missing)
        if missing:
            keys = [self._layer_key(layer, i) for i in missing]
            blocks = self.store.get_many(keys, fingerprint=self.fingerprint, namespace=self.namespace)
            for index, key, block in zip(missing, keys, blocks, strict=True):
                start = self.method.sinks + index * self.method.block_tokens
                if block is None or block.start_pos != start or block.num_layers != 1 \
                        or tuple(block.keys.shape[1:]) != (self.kv_heads, self.method.block_tokens, self.head_dim):
                    why = "missing, damaged or another model's" if block is None else "of another shape or position"
                    raise BlockLostError(f"tier-backed attention: block {index} (tokens {start}.."
                                         f"{start + self.method.block_tokens}) of layer {layer} is {why} in the store "
                                         f"(key {key.hex()}); the context must be prefilled again")
                pair = (block.keys[0].to(self.store_dtype), block.values[0].to(self.store_dtype))
                found[index] = pair
                self.hot.put((slot, index), *pair)
            self.stats.fetched_blocks += len(missing)
        keys_out = torch.stack([found[i][0] for i in indices])
        values_out = torch.stack([found[i][1] for i in indices])
        return keys_out, values_out

    # -- driving the model -----------------------------------------------------------------------------

    def _forward(self, ids: list[int], *, all_logits: bool = False) -> torch.Tensor:
        """Run ``ids`` (at most ``segment`` tokens) after what the session has seen; logits ``[q, vocab]`` (the
        last position only unless ``all_logits``)."""
        start = len(self._tokens)
        if start + len(ids) > self.max_tokens:
            raise ContextTooLongError(f"{start + len(ids):,} tokens exceed the model's {self.max_tokens:,} positions")
        self._tokens.extend(ids)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                             past_key_values=self.cache, use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits[0].float()

    def _run(self, ids: list[int], *, all_logits: bool = False) -> torch.Tensor:
        """``ids`` in segments; the logits of every position (``all_logits``) or of the last one ``[1, vocab]``."""
        seg = self.method.segment
        outs = [self._forward(ids[i:i + seg], all_logits=all_logits) for i in range(0, len(ids), seg)]
        return torch.cat(outs) if all_logits else outs[-1]

    def prefill(self, context: list[int]) -> None:
        """Prefill ``context`` in segments of ``segment`` tokens; its KV goes to the store."""
        if self._tokens:
            raise LongContextError("this session already holds a context: open another session")
        if not context:
            raise LongContextError("an empty context")
        if len(context) > self.max_tokens:
            raise ContextTooLongError(f"a context of {len(context):,} tokens is longer than the model's "
                                      f"{self.max_tokens:,} positions")
        began = time.perf_counter()
        self._prefilling = True
        try:
            self._last_logits = self._run(list(context))[-1]
        finally:
            self._prefilling = False
        self.stats.prefill_s = time.perf_counter() - began
        self.stats.full_kv_bytes = len(context) * len(self.layers) * self._block_bytes(self.dtype) // \
            self.method.block_tokens
        self._context_tokens = len(context)
        self._note_fraction()

    def _note_fraction(self) -> None:
        m = self.method
        attended = m.sinks + m.window + self._top_blocks * m.block_tokens
        self.stats.kv_fraction = min(1.0, attended / self._context_tokens)

    # -- several questions of one context -----------------------------------------------------------------

    @property
    def top_blocks(self) -> int:
        """Stored blocks each layer attends per step (``TierSparse.top_blocks`` until set)."""
        return self._top_blocks

    @top_blocks.setter
    def top_blocks(self, value: int) -> None:
        """Attend ``value`` blocks per step from now on (the prefill's blocks and summaries serve any number). With
        ``per_head`` the fetch was sized for ``TierSparse.top_blocks``: more is a ``ResidentBudgetError``."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LongContextError(f"top_blocks={value!r}: a positive integer")
        if self.method.per_head and value > self.method.top_blocks:
            raise ResidentBudgetError(f"top_blocks={value} per head: the session's fetch memory was sized for "
                                      f"TierSparse.top_blocks={self.method.top_blocks}; open it with the larger one")
        self._top_blocks = value
        if self._context_tokens:
            self._note_fraction()

    def mark(self) -> None:
        """Remember this point (typically right after ``prefill``) so that ``rewind`` can return to it: ask one
        long context several questions with one prefill. The mark holds a copy of every managed layer's sinks and
        tail, counted in ``resident_bytes`` (from what the fixed part and the hot blocks leave, else the hot blocks
        give up the room; ``ResidentBudgetError`` when even that is too little); a later ``mark`` replaces it."""
        if not self._tokens:
            raise LongContextError("prefill a context before marking it")
        self._release_mark()
        stored = {t.stored for t in self._tails}
        assert len(stored) == 1, "every managed layer has stored the same blocks after a whole forward"
        tails = [(t.filled, t.keys[:, :, :t.filled].clone(), t.values[:, :, :t.filled].clone()) for t in self._tails]
        nbytes = sum(k.nbytes + v.nbytes for _, k, v in tails)
        free = self.method.resident_limit - self._fixed - self.hot.capacity  # what hot_bytes left unused
        if nbytes > free + self.hot.capacity:
            raise ResidentBudgetError(f"a mark holds {nbytes:,} bytes of sinks and tails: more than the "
                                      f"{free + self.hot.capacity:,} bytes resident_bytes leaves beside the fixed part")
        taken = max(0, nbytes - free)
        self.hot.resize(self.hot.capacity - taken)
        others = {i: copy.deepcopy(layer) for i, layer in enumerate(self.cache.layers) if not isinstance(layer,
                                                                                                         OwnedLayer)}
        self._mark = _Mark(tokens=len(self._tokens), stored=stored.pop(), tails=tails, others=others,
                           last_logits=self._last_logits, nbytes=nbytes, taken=taken)
        self._held_bytes += nbytes
        self._note_resident(0)

    def rewind(self) -> None:
        """Return to the ``mark``: the tokens after it are forgotten (blocks they stored stay in the store,
        unreachable from this session, until evicted), so the next ``generate`` / ``nll`` continues the marked
        context as if nothing had followed it. The mark stays for further rewinds."""
        mark = self._mark
        if mark is None:
            raise LongContextError("rewind needs a mark: call mark() after the prefill")
        for slot, index in self.hot.held():
            if index >= mark.stored:  # a block of the forgotten tokens: its index will name another block
                self.hot.drop((slot, index))
        for tail, (filled, keys, values) in zip(self._tails, mark.tails, strict=True):
            tail.keys[:, :, :filled].copy_(keys)
            tail.values[:, :, :filled].copy_(values)
            tail.filled, tail.seen, tail.stored = filled, mark.tokens, mark.stored
        for index, layer in mark.others.items():
            self.cache.layers[index] = copy.deepcopy(layer)
        del self._tokens[mark.tokens:]
        del self._chain[mark.stored:]
        self._last_logits = mark.last_logits

    def _release_mark(self) -> None:
        if self._mark is not None:
            self._held_bytes -= self._mark.nbytes
            self.hot.resize(self.hot.capacity + self._mark.taken)
            self._mark = None

    def generate(self, question: list[int], max_new_tokens: int, *,
                 scores: list[torch.Tensor] | None = None) -> list[int]:
        """Greedy ``max_new_tokens`` tokens after the context and ``question`` (``scores``: each new token's
        logits ``[vocab]`` appended to it)."""
        if not self._tokens:
            raise LongContextError("prefill a context first")
        if max_new_tokens <= 0:
            return []
        if not question and self._last_logits is None:
            raise LongContextError("generate after generate or nll needs question tokens")
        if len(self._tokens) + len(question) + max_new_tokens - 1 > self.max_tokens:
            raise ContextTooLongError(f"{len(self._tokens):,} tokens of context, {len(question):,} of question and "
                                      f"{max_new_tokens} new exceed the model's {self.max_tokens:,} positions")
        began = time.perf_counter()
        logits = self._run(list(question))[-1] if question else self._last_logits
        token = int(torch.argmax(logits))
        self.stats.ttft_s = time.perf_counter() - began
        out = [token]
        if scores is not None:
            scores.append(logits)
        began = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            logits = self._forward([token])[-1]
            token = int(torch.argmax(logits))
            out.append(token)
            if scores is not None:
                scores.append(logits)
        if max_new_tokens > 1:
            self.stats.tpot_s = (time.perf_counter() - began) / (max_new_tokens - 1)
        self._last_logits = None
        return out

    def nll(self, continuation: list[int]) -> list[float]:
        """Teacher-forced negative log-likelihood of each token of ``continuation`` after the context."""
        if self._last_logits is None:
            raise LongContextError("nll scores the tokens right after the prefilled context")
        if not continuation:
            return []
        logits = torch.cat([self._last_logits[None], self._run(list(continuation[:-1]), all_logits=True)]) \
            if len(continuation) > 1 else self._last_logits[None]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation)
        self.stats.top1_hits = int((logp.argmax(dim=-1) == target).sum())
        self._last_logits = None
        return (-logp[torch.arange(len(continuation)), target]).tolist()

    def close(self) -> None:
        self._mark = None
        self.hot.clear()
