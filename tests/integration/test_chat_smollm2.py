"""``Conversation`` on the real SmolLM2-135M-Instruct with its own chat template: each turn reuses everything the
previous turn stored (its answer included, as far as the template re-tokenizes it the same), prefills the rest,
and answers what plain ``model.generate`` answers over the same template ids."""

from __future__ import annotations

import pytest
import torch

from kvshelf.adapters.chat import Conversation
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.kvstore import open_embedded_store

pytestmark = pytest.mark.slow

NEW = 24
QUESTIONS = ["What is a neural network?", "Give one example of where it is used.", "Say it in one sentence."]


def _plain(model, ids: list[int]) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def test_turns_reuse_the_previous_turn_and_equal_plain_generate(smollm2, tmp_path):
    model, tokenizer = smollm2
    chat = Conversation(CachedGenerator(model, tokenizer, open_embedded_store(tmp_path), block_size=64),
                        system="You are a concise assistant.")
    previous: list[int] = []
    for n, question in enumerate(QUESTIONS):
        turn = chat.send(question, max_new_tokens=NEW)
        ids = turn.result.prompt_ids
        assert turn.new_ids == _plain(model, ids)
        if n:
            # the previous turn's prompt always; its answer as far as the template re-tokenizes it the same
            assert len(previous) <= turn.common_prefix == turn.reused_tokens
            assert turn.prefilled_tokens == len(ids) - turn.common_prefix
        print(f"turn {n + 1}: {len(ids)} prompt tokens, reused {turn.reused_tokens}, stored "
              f"{len(chat.stored_ids)}, answer {turn.text!r}")
        previous = ids
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * len(QUESTIONS)


def test_edited_history_reuses_the_unchanged_prefix(smollm2, tmp_path):
    model, tokenizer = smollm2
    chat = Conversation(CachedGenerator(model, tokenizer, open_embedded_store(tmp_path), block_size=16),
                        system="You are a concise assistant.")
    for question in QUESTIONS[:2]:
        chat.send(question, max_new_tokens=NEW)
    stored = chat.stored_ids
    history = chat.messages
    history[1]["content"] = "What is a decision tree?"  # the first question edited
    history.append({"role": "user", "content": QUESTIONS[2]})
    turn = chat.reply(history, max_new_tokens=NEW)
    ids = turn.result.prompt_ids
    common = next(i for i, (a, b) in enumerate(zip(ids, stored, strict=False)) if a != b)
    assert turn.common_prefix == common
    assert turn.reused_tokens == (common // 16) * 16 > 0
    assert turn.new_ids == _plain(model, ids)
