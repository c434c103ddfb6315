"""``full``: no reuse; the prefix, the chunks and the question are prefilled together by HF ``model.generate``
(the reference every other mode is compared with)."""

from __future__ import annotations

from typing import Any

from kvshelf.adapters.decode import generate_from_cache
from kvshelf.adapters.rag.modes.base import Answer, Exactness, RAGMode, RAGQuery


class FullMode(RAGMode):
    name = "full"
    engine = False
    exactness = Exactness()

    def run(self, query: RAGQuery, checked: Any) -> Answer:
        generated, _ = generate_from_cache(query.model, query.all_ids, None, None, **query.decode_kwargs())
        return Answer(generated)
