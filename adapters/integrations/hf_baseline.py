"""The framework's own HuggingFace chat model over an already loaded model: ``langchain_huggingface``'s
``ChatHuggingFace`` on a ``HuggingFacePipeline`` (greedy, only new text), the baseline ``kvshelf bench rag-chain``
compares ``KVShelfChatModel`` with. Nothing is loaded from the network: the pipeline is built on the given model and
tokenizer objects."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase, pipeline


def hf_chat_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int) -> Any:
    """``ChatHuggingFace(llm=HuggingFacePipeline(text-generation pipeline of model, tokenizer))``, greedy."""
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline

    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                    do_sample=False, return_full_text=False)
    return ChatHuggingFace(llm=HuggingFacePipeline(pipeline=pipe), tokenizer=tokenizer)
