"""``SparseSettings``: what a tier-backed sparse attention session is set to (``TierSparse`` adds the door to a
session); what each setting does is in ``session`` (module docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshelf.adapters.longctx.errors import ResidentBudgetError
from kvshelf.kvstore.sizes import parse_size


@dataclass(frozen=True)
class SparseSettings:
    """The settings of tier-backed sparse attention (``TierSparse`` opens sessions with them). ``top_blocks``:
    blocks each KV head attends per layer and step (``>= blocks of the context``: every block, exact).
    ``store_dtype``: the dtype blocks are stored and kept hot in (``None``: the model's, exact; ``torch.float16``
    halves the bytes, approximate)."""

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
