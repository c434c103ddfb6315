"""Haystack 2: ``KVShelfGenerator``, a generator component answering through ``RAGChat`` (``pip install
"kvshelf[haystack]"``).

In a pipeline, connect a retriever's ``documents`` to the generator's ``documents`` and give the query as its
``prompt``: each document's ``content`` is a ``RAGGenerator`` chunk (its KV stored on first sight and reused after),
placed before the prompt in the user turn; no documents is plain generation of the prompt. A
``streaming_callback`` (at init or per run) receives a ``StreamingChunk`` per piece of text as tokens come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from haystack import Document, component
from haystack.dataclasses import StreamingChunk

from kvshelf.adapters.integrations.core import RAGChat
from kvshelf.kvstore.errors import ConfigError

StreamingCallback = Callable[[StreamingChunk], None]


def document_texts(documents: list[Document]) -> list[str]:
    """Each document's ``content``; a document without text is a ``ConfigError``."""
    out = []
    for n, doc in enumerate(documents):
        if not isinstance(doc, Document) or not isinstance(doc.content, str):
            raise ConfigError(f"document {n} is not a Document with text content")
        out.append(doc.content)
    return out


@component
class KVShelfGenerator:
    """A Haystack generator over a ``RAGChat``: ``run(prompt, documents=None, streaming_callback=None,
    mode=None, max_new_tokens=None)`` -> ``{"replies": [text], "meta": [{mode, chunks, reused_chunks, ...}]}``;
    ``system_prompt`` opens every prompt."""

    def __init__(self, rag: RAGChat, system_prompt: str | None = None,
                 streaming_callback: StreamingCallback | None = None) -> None:
        if not isinstance(rag, RAGChat):
            raise ConfigError(f"KVShelfGenerator needs a RAGChat, got {type(rag).__name__}")
        self.rag, self.system_prompt, self.streaming_callback = rag, system_prompt, streaming_callback

    @component.output_types(replies=list[str], meta=list[dict[str, Any]])
    def run(self, prompt: str, documents: list[Document] | None = None,
            streaming_callback: StreamingCallback | None = None, mode: str | None = None,
            max_new_tokens: int | None = None) -> dict[str, Any]:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError("the prompt is empty")
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        texts = document_texts(documents) if documents else None
        callback = streaming_callback or self.streaming_callback
        if callback is None:
            answer = self.rag.generate(messages, texts, mode=mode, max_new_tokens=max_new_tokens)
            meta = {"mode": answer.mode, "chunks": answer.chunks, "reused_chunks": answer.reused_chunks,
                    "computed_chunks": answer.computed_chunks, "ttft_s": answer.ttft_s}
            return {"replies": [answer.text], "meta": [meta]}
        text = ""
        for n, piece in enumerate(self.rag.stream(messages, texts, mode=mode, max_new_tokens=max_new_tokens)):
            callback(StreamingChunk(content=piece, index=0, start=n == 0))
            text += piece
        callback(StreamingChunk(content="", index=0, finish_reason="stop"))
        return {"replies": [text], "meta": [{"mode": mode or self.rag.mode, "streamed": True}]}
