"""LangChain: ``KVShelfChatModel``, a ``BaseChatModel`` answering through ``RAGChat`` (``pip install
"kvshelf[langchain]"``).

Retrieved documents reach it one of two ways: marked in the prompt, by filling the prompt template's context slot
with ``format_documents(docs)`` (so a chain ``{"context": retriever | format_documents, "question": ...} | prompt |
chat_model`` is the usual LCEL RAG chain), or as ``invoke(messages, documents=docs)`` (strings or ``Document``s;
they go to the head of the last user message). Either way each document is a ``RAGGenerator`` chunk; without
documents the prompt is generated plainly. ``stream`` yields ``ChatGenerationChunk``s as tokens come.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from kvshelf.adapters.integrations.core import RAGChat, cut_at_stop, held_back, mark_documents
from kvshelf.kvstore.errors import ConfigError

ROLES = {"system": "system", "human": "user", "ai": "assistant"}


def document_texts(documents: Sequence[Document | str]) -> list[str]:
    """The text of each document (a ``Document``'s ``page_content``, or a string)."""
    out = []
    for n, doc in enumerate(documents):
        if isinstance(doc, Document):
            out.append(doc.page_content)
        elif isinstance(doc, str):
            out.append(doc)
        else:
            raise ConfigError(f"document {n} is a {type(doc).__name__}, not a Document or a string")
    return out


def format_documents(documents: Sequence[Document | str]) -> str:
    """Retrieved documents for a prompt's context slot, marked so ``KVShelfChatModel`` passes each as a chunk."""
    return mark_documents(document_texts(documents))


def chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as chat-template messages (``role``, ``content``)."""
    out = []
    for msg in messages:
        role = ROLES.get(msg.type)
        if role is None:
            raise ConfigError(f"a {msg.type!r} message cannot go into the chat template; use system, human or ai")
        out.append({"role": role, "content": msg.text})
    return out


class KVShelfChatModel(BaseChatModel):
    """A LangChain chat model over a ``RAGChat`` (``KVShelfChatModel(rag=RAGChat(model, tokenizer, store))``).

    ``invoke``/``stream`` keyword arguments: ``documents`` (the retrieved documents, when not marked in the
    prompt), ``mode`` and ``max_new_tokens`` (this call's), and ``model.generate`` options."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rag: RAGChat

    @property
    def _llm_type(self) -> str:
        return "kvshelf"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"mode": self.rag.mode, "model": type(self.rag.model).__name__}

    def _arguments(self, messages: list[BaseMessage], kwargs: dict[str, Any]) -> tuple[list[dict[str, str]], Any]:
        documents = kwargs.pop("documents", None)
        return chat_messages(messages), None if documents is None else document_texts(documents)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        msgs, documents = self._arguments(messages, kwargs)
        answer = self.rag.generate(msgs, documents, **kwargs)
        text, _ = cut_at_stop(answer.text, stop)
        info = {"mode": answer.mode, "chunks": answer.chunks, "reused_chunks": answer.reused_chunks,
                "computed_chunks": answer.computed_chunks, "ttft_s": answer.ttft_s}
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text, response_metadata=info))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        msgs, documents = self._arguments(messages, kwargs)
        shown = text = ""
        pieces = self.rag.stream(msgs, documents, **kwargs)
        for piece in _with_end(pieces):
            text += piece or ""
            kept, stopped = cut_at_stop(text, stop)
            # a piece that may begin a stop string waits for the next one (the end flushes it)
            visible = kept if stopped or piece is None else kept[:len(kept) - held_back(kept, stop)]
            if len(visible) > len(shown):
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=visible[len(shown):]))
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
                shown = visible
            if stopped:
                break


def _with_end(pieces: Iterator[str]) -> Iterator[str | None]:
    """``pieces``, then ``None`` for their end."""
    yield from pieces
    yield None
