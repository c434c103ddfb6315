"""APE-style attention for parallel chunks (Yang et al. 2025, "APE: Faster and Longer Context-Augmented Generation
via Adaptive Parallel Encoding"): the question's and later tokens' logits on chunk keys are divided by
``temperature`` (chunk keys scaled by ``1 / temperature``) and shifted by ``log(scale)`` (a column bias). A
variant of the question prefill of ``reuse`` and ``block-attention``, set by ``RAGGenerator(ape=...)``; greedy
only (the bias cannot go through ``model.generate``); refused on sliding-window layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvshelf.adapters import hf
from kvshelf.adapters.decode import Generated, eos_set, greedy_with_bias
from kvshelf.adapters.rag.modes.base import FEATURE, RAGQuery
from kvshelf.adapters.reuse_engine import Layout, layer_windows, prefill_rows
from kvshelf.kvstore.errors import UnsupportedModelError


@dataclass(frozen=True)
class ApeScaling:
    """APE's ``temperature`` and ``scale`` (both > 0, checked by ``RAGGenerator``)."""

    temperature: float
    scale: float

    @staticmethod
    def check(model: PreTrainedModel) -> None:
        """Refuse sliding-window layers (``UnsupportedModelError``): their windows would cut the chunk span."""
        if any(w is not None for w in layer_windows(model)):
            raise UnsupportedModelError(f"model type {hf.model_type(model)!r}: APE scaling ({FEATURE}) is not "
                                        "supported on sliding-window layers")

    def bias(self, layout: Layout, start: int, end: int) -> torch.Tensor:
        """Scale the chunk rows ``[start, end)``'s keys in ``layout`` by ``1 / temperature``; the column bias
        ``[rows]`` (``log(scale)`` on the chunk rows, 0 elsewhere)."""
        for keys in layout.keys:
            keys[:, :, start:end] /= self.temperature
        bias = torch.zeros(layout.rows, dtype=torch.float32)
        bias[start:end] = math.log(self.scale)
        return bias

    def answer(self, query: RAGQuery, layout: Layout, q_rows: list[int]) -> Generated:
        """Prefill the question rows ``q_rows`` over the scaled chunks and decode greedily with the bias."""
        bias = self.bias(layout, len(query.prefix), q_rows[0])
        first = prefill_rows(query.model, layout, query.question, q_rows, q_rows, column_bias=bias)
        return greedy_with_bias(
            query.model, layout.to_cache(query.model), query.all_ids, first, query.total, query.max_new_tokens,
            eos=eos_set(query.model, query.eos_token_id), column_bias=bias, streamer=query.streamer,
            all_logits=query.all_logits, **query.generate_kwargs)
