"""LlamaIndex: ``KVShelfLLM`` (a ``CustomLLM``) and ``KVShelfSynthesizer``, a response synthesizer that hands the
retrieved nodes to it as chunks (``pip install "kvshelf[llamaindex]"``).

``RetrieverQueryEngine(retriever, response_synthesizer=KVShelfSynthesizer(llm=KVShelfLLM(rag=RAGChat(...))))``
answers each query over the retrieved nodes' text, each node a ``RAGGenerator`` chunk (its KV stored on first sight
and reused after); no nodes is plain generation of the query. ``complete(prompt, documents=[...])`` and
``stream_complete`` take documents directly; ``chat``/``stream_chat`` render their messages with the tokenizer's chat
template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryType
from pydantic import ConfigDict

from kvshelf.adapters.integrations.core import RAGChat
from kvshelf.kvstore.errors import ConfigError

ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages as chat-template messages (``role``, ``content``)."""
    out = []
    for msg in messages:
        role = ROLES.get(msg.role)
        if role is None:
            raise ConfigError(f"a {msg.role.value!r} message cannot go into the chat template; use system, user or "
                              "assistant")
        out.append({"role": role, "content": msg.content or ""})
    return out


class KVShelfLLM(CustomLLM):
    """A LlamaIndex LLM over a ``RAGChat``; ``system_prompt`` (LlamaIndex's own field) opens every prompt.
    ``complete``/``stream_complete`` take ``documents`` (texts), ``mode`` and ``max_new_tokens``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rag: RAGChat

    @property
    def metadata(self) -> LLMMetadata:
        window = getattr(self.rag.model.config, "max_position_embeddings", None) or 4096
        return LLMMetadata(context_window=window, num_output=self.rag.max_new_tokens, model_name="kvshelf")

    def _messages(self, prompt: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*head, {"role": "user", "content": prompt}]

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        documents = kwargs.pop("documents", None)
        answer = self.rag.generate(self._messages(prompt), documents, **kwargs)
        return CompletionResponse(text=answer.text, raw={"mode": answer.mode, "chunks": answer.chunks,
                                                         "reused_chunks": answer.reused_chunks,
                                                         "computed_chunks": answer.computed_chunks,
                                                         "ttft_s": answer.ttft_s})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        documents = kwargs.pop("documents", None)
        pieces = self.rag.stream(self._messages(prompt), documents, **kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece)

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        documents = kwargs.pop("documents", None)
        answer = self.rag.generate(chat_messages(messages), documents, **kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer.text))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        documents = kwargs.pop("documents", None)
        pieces = self.rag.stream(chat_messages(messages), documents, **kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)

        return gen()


class KVShelfSynthesizer(BaseSynthesizer):
    """Answers a query over the retrieved nodes: each node's text (as LlamaIndex shows it to an LLM) is one
    document of ``KVShelfLLM``; no nodes is plain generation of the query. ``streaming=True`` gives a
    ``StreamingResponse``."""

    def __init__(self, llm: KVShelfLLM, *, streaming: bool = False) -> None:
        if not isinstance(llm, KVShelfLLM):
            raise ConfigError(f"KVShelfSynthesizer needs a KVShelfLLM, got {type(llm).__name__}")
        window = llm.metadata.context_window
        tokenizer = llm.rag.tokenizer
        super().__init__(llm=llm, streaming=streaming,
                         prompt_helper=PromptHelper(context_window=window, num_output=llm.rag.max_new_tokens,
                                                    tokenizer=lambda text: tokenizer(text)["input_ids"]))
        self._kvshelf_llm = llm

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if prompts:
            raise ConfigError("KVShelfSynthesizer has no prompt templates: the documents go to the model as chunks")

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> Any:
        documents = list(text_chunks) or None
        if self._streaming:
            return (r.delta or "" for r in self._kvshelf_llm.stream_complete(query_str, documents=documents,
                                                                              **response_kwargs))
        return self._kvshelf_llm.complete(query_str, documents=documents, **response_kwargs).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> Any:
        return self.get_response(query_str, text_chunks, **response_kwargs)

    def synthesize(self, query: QueryType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None,
                   **response_kwargs: Any) -> RESPONSE_TYPE:
        """The answer over ``nodes`` (none: plain generation, not LlamaIndex's "Empty Response")."""
        query_str = query if isinstance(query, str) else query.query_str
        texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
        response = self.get_response(query_str, texts, **response_kwargs)
        return self._prepare_response_output(response, [*nodes, *(additional_source_nodes or [])])
