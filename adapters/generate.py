"""``CachedGenerator``: HF ``generate`` with automatic prefix reuse through a kvshelf store.

On each call: find the longest cached prefix of full blocks (chained keys), load it into a ``DynamicCache``,
let ``model.generate`` prefill only the rest, then store the prompt's new full blocks. The output equals the
uncached run's (same model, same KV up to floating-point summation order of the suffix prefill).

Sliding-window and hybrid models (Mistral, Qwen2 with a window, Gemma 2/3) work the same way: a block holds every
token of every layer (while the call runs, the sliding layers keep the tokens they would drop:
``hf.keep_sliding_history``), and a loaded prefix gives each layer what its cache class keeps: a sliding layer its
last ``window - 1`` tokens, counting all of them, exactly as if it had prefilled the prefix itself.

Blocks are keyed by the model's dtype. When a lookup finds nothing, the result says how many blocks of the same
prompt are stored for the same weights in another common dtype (``other_dtype_blocks``; see
``fingerprint.fingerprint_in_dtype`` for which ones can be named).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters import hf
from kvshelf.adapters.cache_bridge import blocks_from_cache, cache_from_prepared, check_supported
from kvshelf.adapters.fingerprint import model_fingerprint, other_dtype_fingerprints
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.prompts import Prompt, prompt_ids
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.keys import prefix_block_spans
from kvshelf.kvstore.protocol import BlockStore, namespace_of

DEFAULT_BLOCK_SIZE = 256


@dataclass(frozen=True)
class GenerationResult:
    """What one ``generate`` call produced and what the cache saved."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str | None
    reused_tokens: int  # prompt tokens whose KV came from the store
    prefilled_tokens: int  # prompt tokens computed by this call
    stored_blocks: int
    ttft_s: float  # call start to first new token, including the store lookup and load
    total_s: float
    logits: tuple[torch.Tensor, ...] | None = None  # per new token, [1, vocab] (when output_logits=True)
    # when nothing was reused: blocks of this prompt stored for the same weights in other dtypes (not usable: KV is
    # keyed by dtype), and those dtypes; 0 and () when something was reused or none is found
    other_dtype_blocks: int = 0
    other_dtypes: tuple[str, ...] = ()


class _FirstTokenTimer(BaseStreamer):
    """Records when ``generate`` emits its first new token (its first ``put`` is the prompt itself)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()


class CachedGenerator:
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
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        store: BlockStore | None = None,
        *,
        namespace: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {block_size}")
        check_supported(model.config, "prefix reuse", sliding_window=True)
        self._sliding = hf.SLIDING_ATTENTION in hf.attention_layer_types(model.config)
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.namespace = namespace_of(store, namespace)
        self.block_size = block_size

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

    def _load_prefix(self, ids: list[int], cacheable_prefix: int | None,
                     fingerprint: str) -> tuple[int, int, Any, bool]:
        """``(reused, loaded, cache, missed)``: the longest cached prefix as a cache of ``reused`` tokens, at most
        ``len(ids) - 1`` (one token must be prefilled), ``loaded`` the tokens of the blocks found; ``missed``:
        blocks were looked up and none was found."""
        if self.store is None or len(ids) < 2:
            return 0, 0, None, False
        spans = self._spans(ids, cacheable_prefix, fingerprint)
        keys = [span.key for span in spans]
        tokens = [span.end - span.start for span in spans]
        found = (
            self.store.lookup_prefix(keys, namespace=self.namespace, model=fingerprint, tokens=tokens)
            if keys else 0
        )
        if not found:
            return 0, 0, None, bool(keys)
        blocks = self.store.get_prepared_many(keys[:found], fingerprint=fingerprint, namespace=self.namespace,
                                              tokens=tokens[:found])
        usable = []
        for block in blocks:  # a damaged or vanished block ends the usable prefix
            if block is None:
                break
            usable.append(block)
        if not usable:
            return 0, 0, None, False
        loaded = sum(b.num_tokens for b in usable)
        reused = min(loaded, len(ids) - 1)
        cache = cache_from_prepared(usable, self.model.config, max_tokens=reused, device=self.model.device,
                                    dtype=self.model.dtype)
        return reused, loaded, cache, False

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

    def _store_prompt_blocks(self, ids: list[int], cache: Any, loaded: int, cacheable_prefix: int | None,
                             fingerprint: str) -> int:
        """Store the blocks of the prompt past the ``loaded`` tokens' (the blocks found need no second copy)."""
        if self.store is None or cache is None:
            return 0
        limit = min(cacheable_prefix or len(ids), cache.get_seq_length())
        spans = [s for s in prefix_block_spans(fingerprint, self.namespace, ids[:limit], self.block_size,
                                               partial=cacheable_prefix is not None) if s.end > loaded]
        if not spans:
            return 0
        entries = []
        for start, end, key in spans:
            (block,) = blocks_from_cache(
                cache, ids, start=start, end=end, block_size=end - start,
                fingerprint=fingerprint, namespace=self.namespace,
            )
            entries.append((key, block))
        return self.store.put_many(entries)

    @torch.inference_mode()
    def generate(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 32,
        reuse: bool = True,
        store: bool = True,
        cacheable_prefix: int | None = None,
        **generate_kwargs: Any,
    ) -> GenerationResult:
        """Generate from ``prompt``; ``generate_kwargs`` go to ``model.generate`` (do_sample, temperature...).

        ``reuse=False`` prefills everything (the uncached baseline); ``store=False`` stores nothing.
        ``cacheable_prefix``: the length of the reusable context at the head of the prompt (a document before
        its question). Only that much is stored, including its last partial block, so a later prompt with
        the same context and another question reuses all of it. Default: the prompt's full blocks.
        """
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        if cacheable_prefix is not None and not 0 < cacheable_prefix <= len(ids):
            raise ConfigError(
                f"cacheable_prefix must be in [1, {len(ids)}] (the prompt length), got {cacheable_prefix}"
            )
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions and len(ids) + max_new_tokens > max_positions:
            raise ConfigError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"{max_positions} positions"
            )
        if "streamer" in generate_kwargs:
            raise ConfigError("CachedGenerator measures TTFT with its own streamer; 'streamer' is not accepted")
        started = time.perf_counter()
        fingerprint = self.fingerprint  # this call's: blocks are looked up and stored for the model as it is now
        reused, loaded, cache, missed = (
            self._load_prefix(ids, cacheable_prefix, fingerprint) if reuse else (0, 0, None, False))
        if self._sliding and store and self.store is not None:  # the blocks to store need every token
            cache = cache if cache is not None else hf.new_cache(self.model.config)
            hf.keep_sliding_history(cache)
        timer = _FirstTokenTimer()
        input_ids = torch.tensor([ids], device=self.model.device)
        generate_kwargs.setdefault("do_sample", False)
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            generate_kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            streamer=timer,
            return_dict_in_generate=True,
            **generate_kwargs,
        )
        finished = time.perf_counter()
        new_ids = [int(t) for t in out.sequences[0, len(ids) :].tolist()]
        stored = (self._store_prompt_blocks(ids, out.past_key_values, loaded, cacheable_prefix, fingerprint)
                  if store else 0)
        # after the answer (TTFT does not pay for it): what a miss would have found in another dtype
        other_blocks, other_dtypes = self._other_dtype_blocks(ids, cacheable_prefix) if missed else (0, ())
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(
            prompt_ids=ids,
            new_ids=new_ids,
            text=text,
            reused_tokens=reused,
            prefilled_tokens=len(ids) - reused,
            stored_blocks=stored,
            ttft_s=(timer.first_token_at or finished) - started,
            total_s=finished - started,
            logits=getattr(out, "logits", None),
            other_dtype_blocks=other_blocks,
            other_dtypes=other_dtypes,
        )
