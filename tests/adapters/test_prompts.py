"""One prompt-to-ids conversion (``adapters.prompts.prompt_ids``) for every front door, with clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.prompt_modules import PromptModuleGenerator
from kvshelf.adapters.prompts import prompt_ids
from kvshelf.adapters.rag import RAGGenerator
from kvshelf.kvstore.errors import ConfigError

BOS = 1


class _Tokenizer:
    """One id per word (3 + length), a BOS when asked for special tokens; records what it was asked."""

    pad_token_id = 0

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        self.calls.append(add_special_tokens)
        return {"input_ids": [BOS] * add_special_tokens + [3 + len(w) for w in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return " ".join(map(str, ids))


def test_every_form_of_prompt():
    tok = _Tokenizer()
    assert prompt_ids("a bb", tok, add_special_tokens=True) == [BOS, 4, 5]
    assert prompt_ids("a bb", tok, add_special_tokens=False) == [4, 5]
    assert prompt_ids([7, np.int64(8)], None, add_special_tokens=True) == [7, 8]
    assert prompt_ids((7, 8), tok, add_special_tokens=True) == [7, 8]  # ids are taken as they are
    assert prompt_ids(torch.tensor([7, 8]), None, add_special_tokens=False) == [7, 8]
    assert prompt_ids(torch.tensor([[7, 8]]), None, add_special_tokens=False) == [7, 8]
    assert all(isinstance(t, int) for t in prompt_ids(torch.tensor([[7, 8]]), None, add_special_tokens=False))


def test_clear_errors():
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        prompt_ids("text", None, add_special_tokens=True)
    for bad in (torch.ones(2, 3, dtype=torch.long), torch.ones(1, 1, 3, dtype=torch.long)):
        with pytest.raises(ConfigError, match="batch size 1"):
            prompt_ids(bad, None, add_special_tokens=True)


def test_front_doors_use_it_with_their_special_tokens(tmp_path):
    model = tiny_llama(seed=0)
    tok = _Tokenizer()
    gen = CachedGenerator(model, tok)
    assert gen.generate("a bb ccc", max_new_tokens=1).prompt_ids == [BOS, 4, 5, 6]  # a whole prompt: BOS
    assert tok.calls == [True]
    tok.calls.clear()
    rag = RAGGenerator(model, tok, prefix="p q")
    rag.generate(["a bb", "ccc"], "dddd", max_new_tokens=1)  # pieces inside one prompt: no special tokens
    assert tok.calls and not any(tok.calls)
    tok.calls.clear()
    PromptModuleGenerator(model, tok, None, '<schema name="s"><module name="m">a bb ccc</module></schema>')
    assert tok.calls and not any(tok.calls)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        RAGGenerator(model, None).generate(["a"], [5], max_new_tokens=1)
