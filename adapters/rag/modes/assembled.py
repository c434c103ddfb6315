"""``AssembledMode``: the modes that assemble stored chunk KV into one layout (the prefix at 0, each chunk's keys
re-rotated to its rows) and prefill only part of the prompt over it. Every prompt row is the engine's, the last one
included: ``model.generate`` takes its logits and the layout's cache as its prefill (``decode.generate_prefilled``)
and runs no forward over the prompt."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from transformers import PreTrainedModel

from kvshelf.adapters.decode import Generated, generate_prefilled
from kvshelf.adapters.hf import Rotary
from kvshelf.adapters.rag.modes.ape import ApeScaling
from kvshelf.adapters.rag.modes.base import FEATURE, Answer, RAGMode, RAGQuery
from kvshelf.adapters.reuse_engine import Layout, check_engine, check_positions, prefill_rows


def decode_prefilled(query: RAGQuery, layout: Layout, first: torch.Tensor) -> Generated:
    """Decode from ``layout`` (every prompt row) and the last row's logits ``first`` ``[vocab]``."""
    return generate_prefilled(query.model, layout, query.all_ids, first, None, **query.decode_kwargs())


class AssembledMode(RAGMode):
    """Loads (or computes) each chunk's KV of ``kind``, assembles the layout, then ``prefill`` s over it."""

    engine = True

    @abstractmethod
    def kind(self, blend_base: str) -> str:
        """The kind of stored chunk KV the mode reads (``CHUNK`` or ``BLOCK``)."""

    def kinds(self, blend_base: str) -> frozenset[str]:
        return frozenset({self.kind(blend_base)})

    def check(self, model: PreTrainedModel, positions: int) -> list[Rotary]:
        """The engine's refusals (``check_engine``), and a length-dependent RoPE must stay static over the whole
        context (``check_positions``); each layer's RoPE as the model has it now."""
        rotaries = check_engine(model, FEATURE)
        check_positions(model, rotaries, positions, FEATURE)
        return rotaries

    def run(self, query: RAGQuery, checked: Any) -> Answer:
        prefix_block = query.kv.prefix_block(query.fingerprint, query.mode)
        blocks, computed = query.kv.fetch(self.kind(query.settings.blend_base), query.chunks, query.mode,
                                          query.fingerprint, prefix_block, query.memo)
        layout = Layout.empty(query.model, query.total, zero=False, headroom=query.max_new_tokens + 1)
        if prefix_block is not None:
            layout.fill(0, prefix_block.keys, prefix_block.values)
        row = len(query.prefix)
        for block in blocks:
            layout.fill_moved(query.model, row, block.keys, block.values, row - block.start_pos, checked)
            row += block.num_tokens
        generated, recomputed = self.prefill(query, layout)
        return Answer(generated, len(blocks) - computed, computed, recomputed)

    def prefill(self, query: RAGQuery, layout: Layout) -> tuple[Generated, int]:
        """Prefill the question over the assembled chunks (with APE scaling when the generator has it) and
        decode; returns (generated, chunk tokens recomputed)."""
        q_rows = list(range(query.total - len(query.question), query.total))
        if query.settings.ape is not None:
            return ApeScaling(*query.settings.ape).answer(query, layout, q_rows), 0
        first = prefill_rows(query.model, layout, query.question, q_rows, q_rows)
        return decode_prefilled(query, layout, first), 0

