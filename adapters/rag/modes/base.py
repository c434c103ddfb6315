"""``RAGMode``: what one query-time RAG mode is (``RAGGenerator.generate(..., mode=NAME)``).

A mode says which kinds of stored KV it reads (``kinds``: what ``precompute`` stores for it), which models it
refuses before any work (``check``: an ``UnsupportedModelError`` naming the family and the feature), when its
answer equals full prefill's (``exactness``) and how a call's prompt is prefilled and decoded (``run``). A new mode
is one module with one subclass plus one line in ``registry.MODE_CLASSES``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters.decode import Generated
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.rag.chunks import Chunk
from kvshelf.adapters.rag.kv import ChunkKV
from kvshelf.kvstore.block import KVBlock

FEATURE = "RAG chunk reuse"  # what a refusal names (``UnsupportedModelError``)


@dataclass(frozen=True)
class RAGSettings:
    """A generator's mode settings: ``ratio`` (CacheBlend's recompute share), ``select_layer`` (where
    ``reuse-blend`` measures deviation), ``blend_base`` (``"block"`` or ``"chunk"``) and ``ape``
    (``(temperature, scale)`` or ``None``)."""

    ratio: float
    select_layer: int
    blend_base: str
    ape: tuple[float, float] | None


@dataclass(frozen=True)
class Exactness:
    """When a mode's greedy answer equals full prefill's (the same tokens; first logits within fp32 rounding):
    with at most ``max_chunks`` chunks (``None``: any), after a shared prefix too when ``prefix``, with the
    generator settings ``settings`` (``RAGGenerator`` keyword arguments)."""

    max_chunks: int | None = None
    prefix: bool = True
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class RAGQuery:
    """One call as a mode sees it: the prefix, chunk and question ids (the prompt is ``prefix + chunks +
    question``), where chunk KV comes from (``kv``, with ``memo`` shared by a batch's rows) and how to decode."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    mode: str
    fingerprint: str
    prefix: list[int]
    chunks: list[Chunk]
    question: list[int]
    kv: ChunkKV
    memo: dict[bytes, KVBlock] | None
    settings: RAGSettings
    max_new_tokens: int
    eos_token_id: Any
    streamer: BaseStreamer | None
    all_logits: bool
    generate_kwargs: dict[str, Any]

    @property
    def chunk_ids(self) -> list[list[int]]:
        return [c.ids for c in self.chunks]

    @property
    def all_ids(self) -> list[int]:
        return self.prefix + [t for c in self.chunks for t in c.ids] + self.question

    @property
    def total(self) -> int:
        """Prompt tokens."""
        return len(self.prefix) + sum(len(c.ids) for c in self.chunks) + len(self.question)

    def decode_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``decode.generate_from_cache`` / ``generate_prefilled``."""
        return {"max_new_tokens": self.max_new_tokens, "tokenizer": self.tokenizer,
                "eos_token_id": self.eos_token_id, "streamer": self.streamer, "all_logits": self.all_logits,
                **self.generate_kwargs}


@dataclass(frozen=True)
class Answer:
    """A mode's answer: the decoded tokens, chunks reused and computed, chunk tokens recomputed."""

    generated: Generated
    reused: int = 0
    computed: int = 0
    recomputed: int = 0


class RAGMode(ABC):
    """One query-time mode. ``name``: its public name; ``engine``: it assembles stored KV with the reuse engine
    (and so refuses the families the engine cannot drive); ``exactness``: its exact case (``None``: never)."""

    name: ClassVar[str]
    engine: ClassVar[bool] = True
    exactness: ClassVar[Exactness | None] = None

    def kinds(self, blend_base: str) -> frozenset[str]:
        """The kinds of stored KV the mode reads besides the prefix (``chunks.CHUNK`` / ``BLOCK``)."""
        return frozenset()

    def check(self, model: PreTrainedModel, positions: int) -> Any:
        """Refuse ``model`` (``UnsupportedModelError``) for a prompt and answer of ``positions`` tokens, before
        any work; returns what ``run`` needs of the check (the engine's rotaries), or ``None``."""
        return None

    def answer(self, query: RAGQuery) -> Answer:
        """Check, then run: a refusal always comes before any work."""
        checked = self.check(query.model, query.total + query.max_new_tokens)
        return self.run(query, checked)

    @abstractmethod
    def run(self, query: RAGQuery, checked: Any) -> Answer:
        """Prefill ``query``'s prompt and decode its answer."""
