"""``CachedGenerator``: HF ``generate`` with automatic prefix reuse through a kvshelf store.

On each call: find the longest cached prefix of full blocks (chained keys), load it into a ``DynamicCache``,
let ``model.generate`` prefill only the rest, then store the prompt's new full blocks. The output equals the
uncached run's (same model, same KV up to floating-point summation order of the suffix prefill).

Batches: ``generate`` also takes a list of prompts, or a ``[B, T]`` tensor with its ``attention_mask`` (padding
on either side is stripped per row). Each row looks up and loads its own cached prefix and prefills its own rest
against it (one row at a time: exact, as for one prompt); the rows' caches are then joined into one left-padded
cache ``[B, kv_heads, T_max - 1, head_dim]`` per layer and decoded together in one batched ``model.generate``
(the 2-D ``attention_mask`` masks the pad slots; HF derives each row's positions from the mask's cumulative sum, so
every row keeps its own). Greedy output per row equals the single-prompt run's (test_generate_batch.py, on every
family of the architecture suite). Rows of a batch stop at their own EOS (the pad tokens HF appends after it are
cut off). Sampling in a batch draws from one random stream for all rows, so a row's samples differ from the
same row sampled alone with the same seed.

Sliding-window and hybrid models (Mistral, Qwen2 with a window, Gemma 2/3) work the same way: a block holds every
token of every layer (while the call runs, the sliding layers keep the tokens they would drop:
``hf.keep_sliding_history``), and a loaded prefix gives each layer what its cache class keeps: a sliding layer its
last ``window - 1`` tokens, counting all of them, exactly as if it had prefilled the prefix itself. In a batch, a
row's tokens end at the last cache slot, so a window counted in cache slots is the row's own window.

Storing is write-behind by default (``kvstore.write_behind.WriteBehind``): the new blocks are handed to a writer
thread after the answer, so neither this call nor the next waits for the store; ``generate(..., wait=True)``
stores synchronously. Reading your own writes: a lookup that misses blocks while this generator still has writes
pending waits for them first (``flush``), so a repeated or extended prompt (the next turn of a chat) finds them.
``close()`` (or leaving a ``with`` block, or the generator being garbage-collected, or interpreter exit) flushes.

Streaming: ``streamer=`` takes a HF streamer (``TextStreamer``...), wrapped in ``streaming.FirstTokenTimer`` so
``ttft_s`` is still measured; ``stream(prompt, ...)`` iterates the new token ids as they come
(``streaming.TokenStream``). Sampling arguments (``do_sample``, ``temperature``, ``top_k``, ``top_p``...) go to
``model.generate`` untouched; seed with ``torch.manual_seed`` before the call.

Blocks are keyed by the model's dtype. When a lookup finds nothing, the result says how many blocks of the same
prompt are stored for the same weights in another common dtype (``other_dtype_blocks``; see
``fingerprint.fingerprint_in_dtype`` for which ones can be named).

Why a prompt missed: when a lookup finds fewer blocks than the prompt has, the result's ``miss_reason`` (and
``miss_reasons``) say why: evicted, stored under another dtype, block size, namespace or model fingerprint, as a
chunk, with other token ids (the first differing token), or never stored (``adapters.miss``, which bounds the
work; a full hit costs nothing). The diagnosis runs after the answer (TTFT does not pay for it);
``explain_misses=False`` turns it off. ``explain(prompt)`` runs it on demand, without generating.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters import hf, hybrid
from kvshelf.adapters import states as state_types
from kvshelf.adapters.cache_bridge import blocks_from_cache, check_supported
from kvshelf.adapters.fingerprint import model_fingerprint, other_dtype_fingerprints
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.kv_support import check_model_supported
from kvshelf.adapters.lifecycle import Closable
from kvshelf.adapters.miss import EXPLAIN_SCAN, MissKind, MissQuery, MissReason, MissReport, explain_miss
from kvshelf.adapters.model_label import label_blocks
from kvshelf.adapters.prefix_load import KVPrefixLoader, PrefixLoader, Row
from kvshelf.adapters.prompts import Prompt, batch_prompt_ids, is_batch, prompt_ids
from kvshelf.adapters.streaming import FirstTokenTimer, TokenStream
from kvshelf.kvstore.block import KVBlock, PreparedBlock
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction_log import EvictionLog
from kvshelf.kvstore.keys import PARENT_EXTRA, prefix_block_spans
from kvshelf.kvstore.protocol import BlockStore, device_cache_of, namespace_of
from kvshelf.kvstore.write_behind import DEFAULT_MAX_PENDING_BLOCKS, WriteBehind

DEFAULT_BLOCK_SIZE = 256

#: ``model.generate`` arguments the generator sets itself
_UNSET = object()
_MANAGED_KWARGS = ("input_ids", "inputs_embeds", "past_key_values", "return_dict_in_generate", "use_cache")


@dataclass(frozen=True)
class GenerationResult:
    """What one ``generate`` call (or one row of a batch) produced and what the cache saved."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str | None
    reused_tokens: int  # prompt tokens whose KV came from the store
    prefilled_tokens: int  # prompt tokens computed by this call
    # blocks handed to the store: written before returning with wait=True (or without write-behind), else queued
    # for the writer thread (submitted; see CachedGenerator.write_behind_stats for what was written)
    stored_blocks: int
    ttft_s: float  # call start to first new token, including the store lookup and load (a batch: its first token)
    total_s: float
    logits: tuple[torch.Tensor, ...] | None = None  # per new token, [1, vocab] (when output_logits=True)
    # when nothing was reused: blocks of this prompt stored for the same weights in other dtypes (not usable: KV is
    # keyed by dtype), and those dtypes; 0 and () when something was reused or none is found
    other_dtype_blocks: int = 0
    other_dtypes: tuple[str, ...] = ()
    # why the lookup found fewer blocks than the prompt has (``adapters.miss``): every finding, and the first;
    # () and None on a full hit, without a lookup (reuse=False, no store), with explain_misses=False, and for a
    # prompt with no full block that no other setting holds
    miss_reasons: tuple[MissReason, ...] = ()
    miss_reason: MissReason | None = None


class CachedGenerator(Closable):
    """Generate with a model through a kvshelf store.

    Args:
        model: a HF decoder-only causal LM: full-attention, sliding-window or hybrid layers (the architecture
            suite's families, ``tests/support/families.py``); an encoder-decoder (T5) or a model with other layers
            (linear attention, recurrent state...) raises ``UnsupportedModelError``. Its dtype is the blocks':
            choose it when loading (``load_model(..., dtype=...)``).
        tokenizer: used when prompts are strings and to decode the output; optional with token-id prompts.
        store: a ``BlockStore`` (embedded ``TieredStore``, or ``RemoteStore``); ``None`` disables reuse.
        namespace: tenant namespace of the blocks (default: the store's).
        block_size: tokens per prefix block (default 256).
        write_behind: store new blocks from a writer thread (default); ``False``: every call stores before it
            returns.
        max_pending_blocks: the write-behind queue's bound (``submit`` waits beyond it: backpressure).
        snapshot_every: hybrid models (recurrent-state layers: ``adapters.hybrid``): snapshot the state at every
            N-th block boundary (default 4; 0: only at the end of ``cacheable_prefix`` and of a chat turn).
        snapshot_codec: the codec state snapshots are written in: ``raw`` (default, exact) or ``zstd``;
            ``fp16`` / ``bf16`` opt in to rounding the state.
        explain_misses: say in each result why its lookup found fewer blocks than the prompt has
            (``miss_reason``; default). It also keeps an ``EvictionLog`` of the store's evictions (an embedded
            store's events), to tell an evicted block from one never stored.

    A generator is a context manager; ``close()`` flushes the pending writes, after which every call raises
    ``ConfigError``. It may be shared by threads.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        store: BlockStore | None = None,
        *,
        namespace: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        write_behind: bool = True,
        max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS,
        snapshot_every: int = hybrid.DEFAULT_SNAPSHOT_EVERY,
        snapshot_codec: str = "raw",
        explain_misses: bool = True,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {block_size}")
        check_supported(model.config, "prefix reuse", sliding_window=True, states=True)
        check_model_supported(model, "prefix reuse")
        hybrid.check_settings(snapshot_every, snapshot_codec)
        self._states = state_types.has_state_layers(model.config)  # recurrent-state layers: adapters.hybrid
        self.snapshot_every, self.snapshot_codec = snapshot_every, snapshot_codec
        #: hybrid models: snapshots taken, stored, failed (not stored: the answer stands), loaded (hits), rejected
        #: (damaged, foreign, lossy or mismatched: a miss, never a state); fallbacks: loads that reused less than
        #: the cached blocks (no snapshot at the deepest usable boundary: a shallower one, or none)
        self.snapshot_stats = hybrid.new_stats()
        self._sliding = bool(hf.WINDOWED_ATTENTION & set(hf.attention_layer_types(model.config)))
        # chunked attention (Llama 4): chunk boundaries and the NoPE layers' temperature follow cache positions, which
        # a left-padded batch shifts: its rows run one at a time (exact), as a hybrid model's do
        self._chunked = hf.CHUNKED_ATTENTION in hf.attention_layer_types(model.config)
        # positions a left-padded batch would shift (no position_ids, or counted from the input ids): rows alone
        self._rows_alone = self._chunked or not hf.batch_positions_follow_mask(model)
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.namespace = namespace_of(store, namespace)
        self.block_size = block_size
        self._writer: WriteBehind | None = None
        if write_behind and store is not None:
            self._writer = WriteBehind(store, max_pending_blocks=max_pending_blocks)
            # a generator dropped without close() still writes what it queued (CPython: when its last reference
            # goes; else at interpreter exit, by the writer's own hook)
            self._finalizer = weakref.finalize(self, _close_writer, self._writer)
        self.explain_misses = explain_misses
        #: the store's evictions heard while this generator watched (``explain_misses`` and an embedded store)
        self.eviction_log: EvictionLog | None = None
        self._unwatch: weakref.finalize | None = None
        if explain_misses and store is not None:
            log = EvictionLog()
            unsubscribe = log.watch(store)
            if unsubscribe is not None:
                self.eviction_log = log
                self._unwatch = weakref.finalize(self, unsubscribe)
        self._hybrid = (hybrid.HybridPrefixLoader(model, store, self.namespace, block_size, snapshot_every,
                                                  snapshot_codec, self.snapshot_stats) if self._states else None)
        self._loader: PrefixLoader = self._hybrid or KVPrefixLoader(model, store, self.namespace)

    @property
    def snapshot_last_error(self) -> str | None:
        """Hybrid models: why the last snapshot was rejected or not stored (``None``: none was)."""
        return self._hybrid.last_error if self._hybrid is not None else None

    # -- lifecycle --------------------------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every block queued for writing is written (or failed: ``write_behind_stats``). Raises
        ``WriteBehindError`` when ``timeout_s`` passes first."""
        if self._writer is not None:
            self._writer.flush(timeout_s)

    def write_behind_stats(self) -> dict[str, Any] | None:
        """The writer's counts (``WriteBehind.stats``: submitted, written, rejected, failed, pending blocks,
        ``last_error``); ``None`` without write-behind."""
        return self._writer.stats() if self._writer is not None else None

    def close(self, timeout_s: float | None = None) -> None:
        """Flush pending writes and stop the writer; the generator then refuses every call (idempotent)."""
        super().close()
        if self._writer is not None:
            self._writer.close(timeout_s)
        if self._unwatch is not None:
            self._unwatch()

    # -- keys, lookup, storing ---------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint now: it follows the model's dtype and weights (``model_fingerprint``)."""
        return model_fingerprint(self.model)

    def encode(self, prompt: Prompt) -> list[int]:
        """Prompt -> token ids (``prompts.prompt_ids``; a string gets the tokenizer's special tokens)."""
        return prompt_ids(prompt, self.tokenizer, add_special_tokens=True)

    def _spans(self, ids: list[int], cacheable_prefix: int | None, fingerprint: str) -> list:
        return prefix_block_spans(fingerprint, self.namespace, ids[: cacheable_prefix or len(ids)], self.block_size,
                                  partial=cacheable_prefix is not None)

    def _read_own_writes(self, keys: list[bytes]) -> None:
        """Wait for this generator's pending writes when some of ``keys`` are not held yet (they may be among
        them). An uncounted ``held`` probe, only while writes are pending."""
        if self._writer is None or not keys or not self._writer.typed_stats().pending_blocks:
            return
        if not all(self.store.held(keys, namespace=self.namespace)):
            self._writer.flush()

    def load_prefix(self, ids: list[int]) -> tuple[int, Any]:
        """The longest cached prefix of ``ids`` (full blocks, as ``generate`` looks it up): ``(reused, cache)``, a
        fresh ``DynamicCache`` of ``reused <= len(ids) - 1`` tokens, or ``(0, None)`` (``export.cached_prefix``)."""
        self._check_open()
        row = self._load_prefix(list(ids), None, self.fingerprint)
        return row.reused, row.cache

    def _load_prefix(self, ids: list[int], cacheable_prefix: int | None, fingerprint: str) -> Row:
        """The longest cached prefix as a cache of ``reused`` tokens, at most ``len(ids) - 1`` (one token must be
        prefilled), ``loaded`` the tokens of the blocks found; ``missed``: blocks were looked up and none was
        found."""
        row = Row(ids)
        if self.store is None or len(ids) < 2:
            return row
        spans = self._spans(ids, cacheable_prefix, fingerprint)
        keys = [span.key for span in spans]
        tokens = [span.end - span.start for span in spans]
        self._read_own_writes(keys)
        found = (
            self.store.lookup_prefix(keys, namespace=self.namespace, model=fingerprint, tokens=tokens)
            if keys else 0
        )
        row.looked, row.asked, row.found = True, len(keys), found
        if not found:
            row.missed = bool(keys)
            return row
        row = self._loader.load(row, spans, tokens, found, fingerprint)  # a hybrid's: KV only with its state
        if row.loaded_kv is not None:
            self._offer_device(*row.loaded_kv)
            row.loaded_kv = None
        return row

    def _offer_device(self, keys: list[bytes], blocks: list[PreparedBlock], keys_t: torch.Tensor,
                      values_t: torch.Tensor) -> None:
        """Blocks loaded from below the store's GPU tier, copied into it from the cache just built (when the tier
        is on the model's device): the next load of this prefix is a copy within the device."""
        cache = device_cache_of(self.store)
        if cache is None or cache.device != keys_t.device:
            return
        held = cache.holds(keys)
        offers, start = [], 0
        for key, block, present in zip(keys, blocks, held, strict=True):
            end = start + block.num_tokens
            if not present and block.dtype == keys_t.dtype:
                offers.append((key, KVBlock(keys_t[:, :, start:end], values_t[:, :, start:end], block.token_ids,
                                            block.start_pos, block.fingerprint, block.namespace)))
            start = end
        cache.offer(offers)

    def _other_dtype_blocks(self, ids: list[int], cacheable_prefix: int | None) -> tuple[int, tuple[str, ...]]:
        """Blocks of this prompt's cached prefix stored for the model's weights cast to another common dtype, and
        those dtypes. Run after generating, on a miss only: the fingerprints cost one weight digest per dtype once
        (memoized), the probes one uncounted ``held`` call per dtype (the store's hit rates stay the users')."""
        count, dtypes = 0, []
        for name, fingerprint in other_dtype_fingerprints(self.model).items():
            keys = [span.key for span in self._spans(ids, cacheable_prefix, fingerprint)]
            held = self.store.held(keys, namespace=self.namespace) if keys else []
            run = next((i for i, present in enumerate(held) if not present), len(held))
            if run:
                count += run
                dtypes.append(name.removeprefix("torch."))
        return count, tuple(dtypes)

    def _miss_reasons(self, row: Row, cacheable_prefix: int | None, fingerprint: str) -> tuple[MissReason, ...]:
        """Why ``row``'s lookup found fewer blocks than it asked for (``adapters.miss.explain_miss``); () on a full
        hit, without a lookup, or with ``explain_misses`` off."""
        if not self.explain_misses or not row.looked or (row.asked and row.found >= row.asked):
            return ()
        query = MissQuery(row.ids, fingerprint, self.namespace, self.block_size, row.found, cacheable_prefix)
        return explain_miss(self.model, self.tokenizer, self.store, query, eviction_log=self.eviction_log)

    def _other_dtypes(self, row: Row, cacheable_prefix: int | None,
                      reasons: tuple[MissReason, ...]) -> tuple[int, tuple[str, ...]]:
        """``other_dtype_blocks`` and ``other_dtypes`` of a row that reused nothing: read off its miss reasons
        when they were looked for (the same probes), else probed (``_other_dtype_blocks``)."""
        if not row.missed:
            return 0, ()
        if not self.explain_misses:
            return self._other_dtype_blocks(row.ids, cacheable_prefix)
        found = [r for r in reasons if r.kind is MissKind.OTHER_DTYPE]
        return sum(r.blocks for r in found), tuple(str(r.candidate) for r in found)

    def explain(self, prompt: Prompt, *, cacheable_prefix: int | None = None, namespaces: Sequence[str] = (),
                scan: int = EXPLAIN_SCAN, scan_tiers: int | None = None) -> MissReport:
        """Why ``prompt`` would miss, without generating: its blocks, how many of them lead the store (an
        uncounted ``held`` probe, after this generator's pending writes) and the findings of
        ``adapters.miss.explain_miss`` (none on a full hit). ``namespaces``: other namespaces to try first;
        ``scan``: stored values whose headers are compared, from the first ``scan_tiers`` tiers (``None``: all).
        Raises ``ConfigError`` without a store, for an empty prompt or a ``cacheable_prefix`` out of range."""
        self._check_open()
        if self.store is None:
            raise ConfigError("explain needs a generator with a store")
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        if cacheable_prefix is not None and not 0 < cacheable_prefix <= len(ids):
            raise ConfigError(
                f"cacheable_prefix must be in [1, {len(ids)}] (the prompt length), got {cacheable_prefix}"
            )
        self.flush()
        fingerprint = self.fingerprint
        spans = self._spans(ids, cacheable_prefix, fingerprint)
        held = self.store.held([span.key for span in spans], namespace=self.namespace) if spans else []
        found = next((i for i, present in enumerate(held) if not present), len(held))
        query = MissQuery(ids, fingerprint, self.namespace, self.block_size, found, cacheable_prefix)
        reasons = explain_miss(self.model, self.tokenizer, self.store, query, eviction_log=self.eviction_log,
                               namespaces=namespaces, scan=scan, scan_tiers=scan_tiers)
        return MissReport(len(ids), self.block_size, len(spans), found, spans[found - 1].end if found else 0,
                          reasons)

    def _block_entries(self, ids: list[int], cache: Any, loaded: int, limit: int, partial: bool,
                       fingerprint: str) -> list[tuple[bytes, KVBlock]]:
        """The blocks of ``ids[:limit]`` (``limit`` at most the cache's tokens) past the ``loaded`` tokens' (the
        blocks found need no second copy), with the trailing partial block when ``partial``. Each block names its
        parent in the chain (``PARENT_EXTRA``: a server's BlockStored events carry it, for routers)."""
        limit = min(limit, cache.get_seq_length())
        spans = prefix_block_spans(fingerprint, self.namespace, ids[:limit], self.block_size, partial=partial)
        entries = []
        for i, (start, end, key) in enumerate(spans):
            if end <= loaded:
                continue
            (block,) = blocks_from_cache(
                cache, ids, start=start, end=end, block_size=end - start,
                fingerprint=fingerprint, namespace=self.namespace,
            )
            if i:
                block.extra[PARENT_EXTRA] = spans[i - 1].key.hex()
            entries.append((key, label_blocks([block], self.model)[0]))
        return entries

    def _put(self, entries: list[tuple[bytes, KVBlock]], wait: bool) -> int:
        """Store ``entries``: queued for the writer, or now (``wait``, or no write-behind). Returns the count
        handed over (queued, or accepted by the store)."""
        if not entries or self.store is None:
            return 0
        if self._writer is not None and not wait:
            return self._writer.submit(entries)
        return int(self.store.put_many(entries))

    # -- generation -----------------------------------------------------------------------------------------------

    @overload
    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult: ...

    @overload
    def generate(self, prompt: Sequence[str] | Sequence[Sequence[int]], **kwargs: Any) -> list[GenerationResult]: ...

    @overload
    def generate(self, prompt: torch.Tensor, **kwargs: Any) -> GenerationResult | list[GenerationResult]: ...

    @torch.inference_mode()
    def generate(
        self,
        prompt: Prompt | Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 32,
        reuse: bool = True,
        store: bool = True,
        wait: bool = False,
        cacheable_prefix: int | None = None,
        store_generated: bool = False,
        attention_mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
        streamer: BaseStreamer | None = None,
        **generate_kwargs: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate from one prompt, or from a batch; ``generate_kwargs`` go to ``model.generate`` (do_sample,
        temperature, top_k, top_p, eos_token_id, output_logits...).

        Args:
            prompt: one prompt (a string, token ids, a tensor ``[n]``) -> one ``GenerationResult``; a batch (a list
                of strings or of token-id lists, or a tensor ``[B, T]``, even with ``B == 1``) -> a list of them,
                one per row, in order.
            reuse: ``False`` prefills everything (the uncached baseline). ``store``: ``False`` stores nothing.
            wait: store the new blocks before returning (else they are queued for the write-behind writer).
            cacheable_prefix: the length of the reusable context at the head of the prompt (a document before
                its question). Only that much is stored, including its last partial block, so a later prompt with
                the same context and another question reuses all of it. Default: the prompt's full blocks. One
                prompt only.
            store_generated: also store the KV of the generated tokens with the prompt's (all of them but the
                last, which never went through the model), including the last partial block: the cached sequence
                is ``prompt_ids + new_ids[:-1]``; the next turn of a chat looks it up with
                ``cacheable_prefix=`` its common prefix with that sequence. One prompt only.
            attention_mask: with a tensor prompt, ``[B, T]`` (or ``[T]``): 1 for tokens, 0 for padding (on either
                side); each row keeps its tokens where the mask is 1.
            streamer: a HF streamer (``put`` / ``end``) fed as ``model.generate`` feeds it (``[B]`` per step for a
                batch); TTFT is still measured.
        Raises:
            ConfigError: an empty prompt or batch, a batch mixing strings and token ids, a prompt too long for
                the model, an argument the generator sets itself (``past_key_values``...), a closed generator.
        """
        self._check_open()
        for name in _MANAGED_KWARGS:
            if name in generate_kwargs:
                raise ConfigError(f"CachedGenerator sets {name!r} itself; it is not accepted")
        if generate_kwargs.get("num_return_sequences", 1) != 1 or generate_kwargs.get("num_beams", 1) != 1:
            raise ConfigError("num_return_sequences and num_beams must be 1 (one sequence per prompt)")
        timer = FirstTokenTimer(streamer)
        started = time.perf_counter()
        if is_batch(prompt) or attention_mask is not None and torch.as_tensor(attention_mask).dim() == 2:
            if cacheable_prefix is not None or store_generated:
                raise ConfigError("cacheable_prefix and store_generated apply to one prompt, not to a batch")
            rows = batch_prompt_ids(prompt, self.tokenizer, attention_mask=attention_mask, add_special_tokens=True)
            for ids in rows:
                self._check_length(ids, max_new_tokens)
            return self._generate_batch(rows, max_new_tokens=max_new_tokens, reuse=reuse, store=store, wait=wait,
                                        timer=timer, started=started, generate_kwargs=generate_kwargs)
        if attention_mask is not None:
            (ids,) = batch_prompt_ids(prompt, self.tokenizer, attention_mask=attention_mask,
                                      add_special_tokens=True)
        else:
            ids = self.encode(prompt)
        self._check_length(ids, max_new_tokens)
        if cacheable_prefix is not None and not 0 < cacheable_prefix <= len(ids):
            raise ConfigError(
                f"cacheable_prefix must be in [1, {len(ids)}] (the prompt length), got {cacheable_prefix}"
            )
        return self._generate_one(ids, max_new_tokens=max_new_tokens, reuse=reuse, store=store, wait=wait,
                                  cacheable_prefix=cacheable_prefix, store_generated=store_generated, timer=timer,
                                  started=started, generate_kwargs=generate_kwargs)

    def stream(self, prompt: Prompt, **kwargs: Any) -> TokenStream[GenerationResult]:
        """``generate(prompt, **kwargs)`` in a worker thread, iterated token by token: ``for token_id in
        gen.stream(prompt, max_new_tokens=64): ...``; ``.texts()`` yields decoded text; ``.result`` is the
        ``GenerationResult`` once done. One prompt only."""
        self._check_open()
        if "streamer" in kwargs:
            raise ConfigError("stream() makes its own streamer; use generate(streamer=...) to pass one")
        if is_batch(prompt):
            raise ConfigError("stream() streams one prompt; use generate(batch, streamer=...) for a batch")
        return TokenStream(lambda streamer: self.generate(prompt, streamer=streamer, **kwargs), self.tokenizer)

    def _check_length(self, ids: list[int], max_new_tokens: int) -> None:
        if not ids:
            raise ConfigError("the prompt is empty")
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions and len(ids) + max_new_tokens > max_positions:
            raise ConfigError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"{max_positions} positions"
            )

    def _defaults(self, generate_kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(generate_kwargs)
        kwargs.setdefault("do_sample", False)
        kwargs.setdefault("use_cache", True)  # a config's use_cache=False (MPT's default) would return no cache
        if self.tokenizer is not None and getattr(self.tokenizer, "pad_token_id", None) is not None:
            kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        return kwargs

    def _decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None

    def _generate_one(self, ids: list[int], *, max_new_tokens: int, reuse: bool, store: bool, wait: bool,
                      cacheable_prefix: int | None, store_generated: bool, timer: FirstTokenTimer, started: float,
                      generate_kwargs: dict[str, Any]) -> GenerationResult:
        fingerprint = self.fingerprint  # this call's: blocks are looked up and stored for the model as it is now
        row = self._load_prefix(ids, cacheable_prefix, fingerprint) if reuse else Row(ids)
        cache = row.cache
        if self._sliding and store and self.store is not None:  # the blocks to store need every token
            cache = cache if cache is not None else hf.new_cache(self.model.config)
            hf.keep_sliding_history(cache)
        snapshots: list = []
        if self._hybrid is not None and store and self.store is not None:  # prefill up to each snapshot boundary
            # a chat turn stores full blocks and its own end (not the looked-up cacheable_prefix's partial block)
            cut = self._hybrid.boundaries(ids, row.reused, None if store_generated else cacheable_prefix,
                                          fingerprint)
            if cut:
                cache, snapshots = self._hybrid.prefill(row, cut, cache)
        input_ids = torch.tensor([ids], device=self.model.device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            streamer=timer,
            return_dict_in_generate=True,
            **self._defaults(generate_kwargs),
        )
        finished = time.perf_counter()
        new_ids = [int(t) for t in out.sequences[0, len(ids) :].tolist()]
        stored = 0
        if store and self.store is not None and out.past_key_values is not None:
            if store_generated:
                entries = self._block_entries(ids + new_ids, out.past_key_values, row.loaded,
                                              len(ids) + len(new_ids), True, fingerprint)
                if self._hybrid is not None:
                    snapshots += self._hybrid.turn_snapshot((ids + new_ids)[:-1], out.past_key_values, row.reused,
                                                            fingerprint)
            else:
                entries = self._block_entries(ids, out.past_key_values, row.loaded, cacheable_prefix or len(ids),
                                              cacheable_prefix is not None, fingerprint)
            stored = self._put(entries, wait)
            if self._hybrid is not None:
                self._hybrid.put(snapshots, ids + new_ids, fingerprint)
        # after the answer (TTFT does not pay for it): why the lookup missed, and what it would have found in
        # another dtype
        reasons = self._miss_reasons(row, cacheable_prefix, fingerprint)
        other_blocks, other_dtypes = self._other_dtypes(row, cacheable_prefix, reasons)
        return GenerationResult(
            prompt_ids=ids,
            new_ids=new_ids,
            text=self._decode(new_ids),
            reused_tokens=row.reused,
            prefilled_tokens=len(ids) - row.reused,
            stored_blocks=stored,
            ttft_s=(timer.first_token_at or finished) - started,
            total_s=finished - started,
            logits=getattr(out, "logits", None),
            other_dtype_blocks=other_blocks,
            other_dtypes=other_dtypes,
            miss_reasons=reasons,
            miss_reason=reasons[0] if reasons else None,
        )

    def _prefill_row(self, row: Row) -> None:
        """Run the row's tokens past its loaded prefix through the model into its own cache (every token: the
        blocks to store end at the prompt's end; the batch cache takes all but the last). Sliding layers keep every
        token (the batch cache needs the window before the last token)."""
        cache = row.cache if row.cache is not None else hf.new_cache(self.model.config)
        if self._sliding:
            hf.keep_sliding_history(cache)
        rest = torch.tensor([row.ids[row.reused:]], device=self.model.device)
        self.model(input_ids=rest, past_key_values=cache, use_cache=True)
        row.cache = cache

    def _batch_cache(self, rows: list[Row], width: int) -> Any:
        """The rows' caches joined, left-padded: per layer ``[B, kv_heads, width - 1, head_dim]``, row ``i``'s
        first ``len(ids_i) - 1`` tokens in its last slots, zeros (masked) before them; a sliding layer is filled as
        its own prefill of ``width - 1`` tokens leaves it (``hf.fill_layer``: the last ``window - 1`` slots)."""
        past = width - 1
        per_row = [hf.cache_layers(row.cache) for row in rows]
        joined = []
        for index in range(len(per_row[0])):
            k0, v0 = hf.layer_tensors(per_row[0][index])
            keys = k0.new_zeros((len(rows), k0.shape[1], past, k0.shape[3]))
            values = v0.new_zeros((len(rows), v0.shape[1], past, v0.shape[3]))
            for b, (row, layers) in enumerate(zip(rows, per_row, strict=True)):
                layer = layers[index]
                k, v = hf.layer_tensors(layer)
                first = hf.layer_start(layer)  # cache index of the layer's first held token
                end = len(row.ids) - 1  # the last prompt token is decode's first input
                offset = width - len(row.ids)  # left padding of this row
                if end > first:
                    keys[b, :, offset + first:offset + end] = k[0, :, : end - first]
                    values[b, :, offset + first:offset + end] = v[0, :, : end - first]
            joined.append((keys, values))
        return hf.cache_from_tensors(joined, self.model.config)

    def _generate_batch(self, rows_ids: list[list[int]], *, max_new_tokens: int, reuse: bool, store: bool,
                        wait: bool, timer: FirstTokenTimer, started: float,
                        generate_kwargs: dict[str, Any]) -> list[GenerationResult]:
        if self._states or self._rows_alone:  # per-row state, or positions padding would shift: one row at a time
            if timer.inner is not None:
                why = (f"recurrent-state layers ({state_types.state_layer_types(self.model.config)})" if self._states
                       else "chunked attention layers" if self._chunked
                       else "positions a padded batch would shift")
                raise ConfigError(f"streaming a batch is not supported for a model with {why}; stream one prompt")
            return [self._generate_one(ids, max_new_tokens=max_new_tokens, reuse=reuse, store=store, wait=wait,
                                       cacheable_prefix=None, store_generated=False, timer=FirstTokenTimer(None),
                                       started=started, generate_kwargs=generate_kwargs) for ids in rows_ids]
        fingerprint = self.fingerprint
        rows = [self._load_prefix(ids, None, fingerprint) if reuse else Row(ids) for ids in rows_ids]
        for row in rows:
            self._prefill_row(row)
        width = max(len(row.ids) for row in rows)
        kwargs = self._defaults(generate_kwargs)
        pad = kwargs.get("pad_token_id")
        pad = 0 if pad is None else int(pad)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long, device=self.model.device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=self.model.device)
        for b, row in enumerate(rows):
            input_ids[b, width - len(row.ids):] = torch.tensor(row.ids, device=self.model.device)
            mask[b, width - len(row.ids):] = 1
        cache = self._batch_cache(rows, width) if width > 1 else hf.new_cache(self.model.config)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            streamer=timer,
            return_dict_in_generate=True,
            **kwargs,
        )
        finished = time.perf_counter()
        eos = _eos_ids(kwargs.get("eos_token_id", _UNSET), self.model)
        logits = getattr(out, "logits", None)
        results = []
        for b, row in enumerate(rows):
            new_ids = _until_eos([int(t) for t in out.sequences[b, width:].tolist()], eos)
            stored = 0
            if store and self.store is not None:
                entries = self._block_entries(row.ids, row.cache, row.loaded, len(row.ids), False, fingerprint)
                stored = self._put(entries, wait)
            reasons = self._miss_reasons(row, None, fingerprint)
            other_blocks, other_dtypes = self._other_dtypes(row, None, reasons)
            results.append(GenerationResult(
                prompt_ids=row.ids,
                new_ids=new_ids,
                text=self._decode(new_ids),
                reused_tokens=row.reused,
                prefilled_tokens=len(row.ids) - row.reused,
                stored_blocks=stored,
                ttft_s=(timer.first_token_at or finished) - started,
                total_s=finished - started,
                logits=tuple(step[b:b + 1] for step in logits[:len(new_ids)]) if logits is not None else None,
                other_dtype_blocks=other_blocks,
                other_dtypes=other_dtypes,
                miss_reasons=reasons,
                miss_reason=reasons[0] if reasons else None,
            ))
        return results


def _eos_ids(given: Any, model: PreTrainedModel) -> set[int]:
    """The ids that end a row: the call's ``eos_token_id`` (``None``: none), else the generation config's."""
    if given is _UNSET:
        config = getattr(model, "generation_config", None)
        given = getattr(config, "eos_token_id", None)
    if given is None:
        return set()
    if isinstance(given, torch.Tensor):
        given = given.reshape(-1).tolist()
    return {int(given)} if isinstance(given, int) else {int(t) for t in given}


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """A row's new tokens up to its first EOS, included (HF pads a finished row until the batch ends)."""
    for index, token in enumerate(ids):
        if token in eos:
            return ids[: index + 1]
    return ids


def _close_writer(writer: WriteBehind) -> None:
    if not writer.closed:
        writer.close()
