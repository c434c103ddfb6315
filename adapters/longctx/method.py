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

from kvshelf.adapters import hf
from kvshelf.adapters.longctx.attention import managing
from kvshelf.adapters.longctx.session import SparseSession
from kvshelf.adapters.longctx.settings import SparseSettings
from kvshelf.adapters.pruning.base import attention_modules, refusal
from kvshelf.kvstore.protocol import BlockStore

FEATURE = "tier-backed sparse attention"


@dataclass(frozen=True)
class TierSparse(SparseSettings):
    """Settings (``SparseSettings``: ``block_tokens``, ``top_blocks``, ``sinks``, ``window``, ``segment``,
    ``resident_bytes``...) and the door to a session of one context."""

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
