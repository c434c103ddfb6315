"""Prompts to token ids: the one conversion every front door uses (``CachedGenerator``, ``RAGGenerator`` and
``rag.precompute``, ``PromptModuleGenerator``); batches (``CachedGenerator.generate`` on a list of prompts or a
padded ``[B, T]`` tensor with its attention mask) as one list of ids per row."""

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


def is_batch(prompt: object) -> bool:
    """Whether ``prompt`` is a batch: a ``[B, T]`` tensor, or a list (tuple) whose items are strings or
    sequences (a list of ints, or an empty list, is one prompt)."""
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 2
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not prompt:
        return False
    return any(isinstance(item, str | Sequence | torch.Tensor) for item in prompt)


def batch_prompt_ids(
    prompts: object, tokenizer: PreTrainedTokenizerBase | None, *,
    attention_mask: torch.Tensor | Sequence[Sequence[int]] | Sequence[int] | None = None,
    add_special_tokens: bool,
) -> list[list[int]]:
    """A batch as one list of token ids per row.

    Args:
        prompts: a list of strings, or a list of token-id lists (not both), or a tensor ``[B, T]`` (or ``[T]``:
            one row).
        attention_mask: with a tensor only, the same shape: 1 for a token, 0 for padding (left or right); a row
            keeps its tokens where the mask is 1.
    Raises:
        ConfigError: an empty batch or an empty row, strings mixed with token ids, a mask of another shape or
            with values other than 0 and 1, a mask with a list batch.
    """
    if isinstance(prompts, torch.Tensor):
        ids = prompts if prompts.dim() == 2 else prompts.reshape(1, -1)
        if prompts.dim() > 2 or ids.shape[0] == 0:
            raise ConfigError(f"a tensor batch is [B, T] with B >= 1, got shape {tuple(prompts.shape)}")
        if attention_mask is None:
            rows = [[int(t) for t in row] for row in ids.tolist()]
        else:
            mask = torch.as_tensor(attention_mask)
            if mask.numel() != ids.numel() or mask.dim() not in (1, 2) or mask.shape[-1] != ids.shape[-1]:
                raise ConfigError(f"attention_mask of shape {tuple(mask.shape)} does not match the prompt's "
                                  f"{tuple(prompts.shape)}")
            mask = mask.reshape(ids.shape)
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ConfigError("attention_mask must hold 0 (padding) and 1 (token) only")
            rows = [[int(t) for t, keep in zip(row, kept, strict=True) if keep]
                    for row, kept in zip(ids.tolist(), mask.tolist(), strict=True)]
    else:
        if attention_mask is not None:
            raise ConfigError("attention_mask goes with a tensor batch [B, T]; a list batch has no padding")
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ConfigError(f"a batch is a list of prompts, got {type(prompts).__name__}")
        if not prompts:
            raise ConfigError("the batch is empty: give at least one prompt")
        strings = [isinstance(p, str) for p in prompts]
        if any(strings) and not all(strings):
            raise ConfigError("a batch mixes strings and token ids: give all rows as strings or all as ids")
        if not all(strings):
            for index, p in enumerate(prompts):
                if not isinstance(p, Sequence | torch.Tensor):
                    raise ConfigError(f"batch row {index} is a {type(p).__name__}, not token ids: a batch mixes "
                                      "single token ids with lists of them")
        rows = [prompt_ids(p, tokenizer, add_special_tokens=add_special_tokens) for p in prompts]
    for index, row in enumerate(rows):
        if not row:
            raise ConfigError(f"batch row {index} is empty")
    return rows
