"""Prompts to token ids: the one conversion every front door uses (``CachedGenerator``, ``RAGGenerator`` and
``rag.precompute``, ``PromptModuleGenerator``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from kvshelf.kvstore.errors import ConfigError

Prompt = str | Sequence[int] | torch.Tensor


def prompt_ids(prompt: Prompt, tokenizer: PreTrainedTokenizerBase | None, *, add_special_tokens: bool) -> list[int]:
    """``prompt`` as a list of token ids.

    Args:
        prompt: a string (tokenized by ``tokenizer``), token ids, or a tensor of ids ``[n]`` or ``[1, n]``.
        tokenizer: needed for a string only.
        add_special_tokens: whether the tokenizer adds its special tokens to a string (a BOS, for a whole prompt);
            ``False`` for text that goes inside a prompt (a RAG chunk or question, a module's text). Ignored for
            ids, which are taken as they are.
    Raises:
        ConfigError: a string without a tokenizer; a tensor holding more than one sequence (batch size > 1).
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("a string prompt needs a tokenizer; pass token ids or a tokenizer")
        return [int(t) for t in tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ConfigError(f"only batch size 1 is supported, got input of shape {tuple(prompt.shape)}")
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]
