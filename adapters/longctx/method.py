"""``TierSparse``: the settings of tier-backed sparse attention, and the door to a session.

::

    from kvshelf.adapters.longctx import TierSparse
    with open_embedded_store(path, memory_bytes=None) as store, TierSparse(resident_bytes="24MiB").session(
            model, store) as session:
        session.prefill(context_ids)                       # in segments; the KV goes to the store
        answer = session.generate(question_ids, max_new_tokens=16)
        session.stats.resident_peak_bytes                  # <= resident_bytes, whatever the context's length

What each setting does is in ``session`` (module docstring). ``resident_bytes`` bounds everything the session holds
of the context in memory: the sinks and tail of every managed layer, the block summaries (sized for ``max_tokens``,
so they do not grow with the context), one layer's fetch, and the hot blocks, which get what is left. A setting
that cannot hold the fixed part is a ``ResidentBudgetError`` before any work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvshelf.adapters.longctx.attention import managing
from kvshelf.adapters.longctx.errors import ResidentBudgetError
from kvshelf.adapters.longctx.session import SparseSession
from kvshelf.adapters.pruning.base import attention_modules, refusal
from kvshelf.kvstore.protocol import BlockStore
from kvshelf.kvstore.sizes import parse_size

FEATURE = "tier-backed sparse attention"


@dataclass(frozen=True)
class TierSparse:
    """Settings. ``top_blocks``: blocks each KV head attends per layer and step (``>= blocks of the context``:
    every block, exact). ``store_dtype``: the dtype blocks are stored and kept hot in (``None``: the model's,
    exact; ``torch.float16`` halves the bytes, approximate)."""

    block_tokens: int = 64
    top_blocks: int = 16
    sinks: int = 16
    window: int = 64
    segment: int = 64
    resident_bytes: int | str = "24MiB"
    max_tokens: int | None = None  # default: the model's max_position_embeddings
    prefill_top_blocks: int | None = None  # blocks a prefill segment attends (None: every block, exact)
    fetch_blocks: int = 16  # blocks fetched at once while attending to many (one layer's working set)
    summary: str = "quest"  # block summary: "quest" (min/max keys, a logit bound) or "mean" (the mean key)
    per_head: bool = False  # each KV head selects its own blocks (their union is fetched) or the layer selects once
    hot_bytes: int | str | None = None  # at most this much of resident_bytes for hot blocks (None: all that is left)
    store_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("block_tokens", "top_blocks", "segment", "fetch_blocks"):
            if int(getattr(self, name)) <= 0:
                raise ResidentBudgetError(f"TierSparse {name} must be > 0, got {getattr(self, name)}")
        for name in ("sinks", "window"):
            if int(getattr(self, name)) < 0:
                raise ResidentBudgetError(f"TierSparse {name} must be >= 0, got {getattr(self, name)}")
        if self.store_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise ResidentBudgetError(f"TierSparse store_dtype must be float32, float16 or bfloat16, got "
                                      f"{self.store_dtype}")
        self.resident_limit  # noqa: B018 (parses it now: a bad size is an error at construction)
        if self.hot_bytes is not None:
            parse_size(self.hot_bytes, "hot_bytes")

    @property
    def resident_limit(self) -> int:
        return parse_size(self.resident_bytes, "resident_bytes")

    def tag(self) -> str:
        """What the stored KV depends on besides the tokens (a prefill attends sparsely): part of its keys."""
        return (f"tiersparse/v1/b{self.block_tokens}/k{self.top_blocks}/s{self.sinks}/w{self.window}/"
                f"g{self.segment}/p{self.prefill_top_blocks}/h{int(self.per_head)}/{self.summary}/{self.store_dtype}")

    @contextmanager
    def session(self, model: Any, store: BlockStore, *, namespace: str | None = None) -> Iterator[SparseSession]:
        """A session of one context on ``model`` over ``store`` (``namespace``: the store's by default).
        ``UnsupportedArchitectureError`` (model type, feature) before any work where it cannot work."""
        modules = check_model(model)
        session = SparseSession(self, model, store, [int(m.layer_idx) for m in modules], namespace=namespace)
        try:
            with managing(model, session, modules):
                yield session
        finally:
            session.close()


def check_model(model: Any) -> list[Any]:
    """The full-attention modules the method manages; ``UnsupportedArchitectureError`` where it cannot work."""
    modules = attention_modules(model, FEATURE, interface=True)
    config = model.config.get_text_config(decoder=True)
    from kvshelf.adapters import hf

    types = hf.attention_layer_types(model.config)
    states = sorted(set(types) - {hf.FULL_ATTENTION, hf.SLIDING_ATTENTION})
    if states:
        raise refusal(FEATURE, model, f"layers of types {states} (recurrent state or chunked attention) are not "
                                      "managed by tier-backed attention")
    if getattr(config, "kv_lora_rank", None):
        raise refusal(FEATURE, model, "multi-head latent attention (MLA): its cache holds a latent the attention "
                                      "module expands, not per-head keys and values")
    if any(hf.attention_softcap(m) is not None for m in modules):
        raise refusal(FEATURE, model, "soft-capped attention logits")
    return modules
