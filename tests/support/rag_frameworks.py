"""Shared parts of the RAG framework integration tests: the SmolLM2 tokenizer on a tiny random model, BM25 over
the corpus (rank-bm25), and the answer ``RAGGenerator`` gives for the same chunks, built without the
integrations' own prompt code."""

from __future__ import annotations

import re
from typing import Any

from rank_bm25 import BM25Okapi

from kvshelf.adapters.integrations.core import DEFAULT_MODE
from kvshelf.adapters.rag import RAGGenerator

SYSTEM = "Answer the question from the documents."
SEPARATOR = "\n\n"
_CUT = "\x00DOCUMENTS\x00"


def tiny_with_smollm2_tokenizer() -> tuple[Any, Any]:
    """``(tiny random Llama, SmolLM2's tokenizer)``: the real tokenizer and chat template, a fast model."""
    from transformers import AutoTokenizer

    from kvshelf.adapters.model import convert_bundled, tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(str(convert_bundled("smollm2-135m")), local_files_only=True)
    return tiny_llama(vocab=len(tokenizer)), tokenizer


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class Bm25:
    """BM25 (Okapi) over ``texts``: ``top(query, k)`` gives the ``k`` best texts, best first."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.index = BM25Okapi([_words(t) for t in texts])

    def top(self, query: str, k: int) -> list[str]:
        scores = self.index.get_scores(_words(query))
        order = sorted(range(len(self.texts)), key=lambda i: -scores[i])
        return [self.texts[i] for i in order[:k]]


def split_prompt(tokenizer: Any, user: str, system: str | None = SYSTEM) -> tuple[str, str]:
    """The chat prompt of ``system`` and a user turn ``<documents> + user``, cut where the documents go."""
    messages = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": _CUT + user}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(_CUT)
    return before, after


def rag_answer(model: Any, tokenizer: Any, documents: list[str], user: str, *, system: str | None = SYSTEM,
               mode: str = DEFAULT_MODE, max_new_tokens: int = 8, store: Any = None,
               chunk_size: int = 256) -> Any:
    """``RAGGenerator``'s answer (``RAGResult``) over ``documents`` (each plus the separator) before ``user``."""
    before, after = split_prompt(tokenizer, user, system)
    gen = RAGGenerator(model, tokenizer, store, prefix=before, chunk_size=chunk_size)
    return gen.generate([d + SEPARATOR for d in documents], after, mode=mode, max_new_tokens=max_new_tokens)


def plain_answer(model: Any, tokenizer: Any, user: str, *, system: str | None = SYSTEM,
                 max_new_tokens: int = 8) -> str:
    """``model.generate``'s greedy answer to the chat prompt of ``system`` and ``user`` (no documents)."""
    import torch

    messages = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
