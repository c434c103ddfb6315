"""HF-native export of a cached prefix: a ready ``DynamicCache`` for callers who run ``model.generate`` or
``pipeline("text-generation")`` themselves.

``cached_prefix(model, store, prompt)`` looks up the prompt's longest cached prefix exactly as ``CachedGenerator``
does (same block keys, so blocks stored by any kvshelf front door are found) and returns a ``CachedPrefix``:

* ``cache``: a ``DynamicCache`` of the model's layer types holding the prefix's KV, per layer
  ``[batch, kv_heads, reused_tokens, head_dim]`` (sliding-window layers: their window of it). It is a fresh copy:
  ``generate`` may grow it in place, nothing stored changes.
* cropped correctly: it covers at most ``len(prompt) - 1`` tokens. HF ``generate`` must compute at least the last
  prompt token itself (its logits give the first new token); a cache covering the whole prompt would make it skip
  that token and continue from the wrong state.
* ``input_ids`` / ``attention_mask``: ``[batch, len(prompt)]``, the whole prompt (``generate`` feeds only the
  uncached tail).
* batch-expandable: ``expand(n)`` gives an independent copy for ``n`` rows of the same prompt (e.g. ``n`` samples).

Example::

    prefix = kvshelf.cached_prefix(model, store, prompt, tokenizer=tokenizer)
    out = model.generate(**prefix.generate_inputs(), max_new_tokens=32)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    pipe(prompt, past_key_values=kvshelf.cached_prefix(model, store, prompt, tokenizer=tokenizer).cache)

A prefix that nothing stored yet gives an empty cache (``reused_tokens == 0``): ``generate`` then prefills it all.

Families whose own ``generate`` does not continue a prefilled cache exactly (``HF_CONTINUATION_INEXACT``) are
refused before any work: ``CachedGenerator`` is exact on them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters import hf
from kvshelf.adapters.generate import DEFAULT_BLOCK_SIZE, CachedGenerator
from kvshelf.adapters.prompts import Prompt
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError
from kvshelf.kvstore.protocol import BlockStore

#: model type -> why transformers' own ``generate`` does not continue a prefilled cache exactly (checked in
#: transformers 5.23: ``tests/adapters/test_catalog_paths.py`` fails when it does)
HF_CONTINUATION_INEXACT = {
    "mpt": "MptForCausalLM.generate continuing from a prefilled cache differs from one prefill by up to 1e-2 in fp32 "
           "logits from the second new token on (its ALiBi bias in decode), so an exported cache cannot be exact; "
           "CachedGenerator is",
}


@dataclass
class CachedPrefix:
    """A prompt's cached prefix as HF inputs (see the module docstring)."""

    cache: DynamicCache
    input_ids: torch.Tensor  # [batch, n]
    attention_mask: torch.Tensor  # [batch, n]
    reused_tokens: int
    prompt_ids: list[int] = field(repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def expand(self, batch_size: int) -> CachedPrefix:
        """An independent copy for ``batch_size`` rows of the prompt (the cache repeated along the batch axis)."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if self.batch_size != 1:
            raise ConfigError(f"only a single-row prefix can be expanded (this one has {self.batch_size} rows)")
        cache = copy.deepcopy(self.cache)
        if batch_size > 1:
            hf.repeat_batch(cache, batch_size)  # state layers too (a hybrid model's)
        return CachedPrefix(cache, self.input_ids.repeat(batch_size, 1), self.attention_mask.repeat(batch_size, 1),
                            self.reused_tokens, self.prompt_ids)

    def generate_inputs(self) -> dict[str, Any]:
        """``input_ids``, ``attention_mask`` and ``past_key_values`` for ``model.generate(**...)``."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "past_key_values": self.cache}


def cached_prefix(
    model: PreTrainedModel, store: BlockStore, prompt: Prompt, *, tokenizer: PreTrainedTokenizerBase | None = None,
    namespace: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE, batch_size: int = 1,
) -> CachedPrefix:
    """The longest cached prefix of ``prompt`` in ``store`` as a ready ``DynamicCache`` (module docstring).

    ``block_size`` and ``namespace`` must be those the blocks were stored with (``CachedGenerator``'s defaults:
    256 and the store's namespace). The prompt is tokenized as ``CachedGenerator`` does (special tokens added).
    Refuses (``UnsupportedModelError``) the models ``CachedGenerator`` refuses.
    """
    kind = hf.model_type(model)
    if kind in HF_CONTINUATION_INEXACT:
        raise UnsupportedModelError(f"HF export of prefix reuse does not support model type {kind!r}: "
                                    f"{HF_CONTINUATION_INEXACT[kind]}")
    generator = CachedGenerator(model, tokenizer, store, namespace=namespace, block_size=block_size,
                                write_behind=False)  # reads only
    ids = generator.encode(prompt)
    if not ids:
        raise ConfigError("the prompt is empty")
    reused, cache = generator.load_prefix(ids)
    if cache is None:
        cache = hf.new_cache(model.config)
    input_ids = torch.tensor([ids], device=model.device)
    prefix = CachedPrefix(cache, input_ids, torch.ones_like(input_ids), reused, ids)
    return prefix.expand(batch_size) if batch_size != 1 else prefix
