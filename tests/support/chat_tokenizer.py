"""A tiny chat tokenizer for the tiny random models: words to ids that round-trip, a chat template of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from helpers import word_ids

MARKUP = {"<system>": 500, "<user>": 501, "<assistant>": 502, "<end>": 503}


class ChatTokenizer:
    """Words to ids that round-trip: ``w<id>`` is token ``id`` (how answers are decoded), the template's markup
    has ids of its own, any other word its ``helpers.word_ids`` id. Its chat template: ``<role> content <end>``
    per message, then ``<assistant>`` for the generation prompt."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        ids = []
        for word in text.split():
            if word in MARKUP:
                ids.append(MARKUP[word])
            elif word[:1] == "w" and word[1:].isdigit():
                ids.append(int(word[1:]))
            else:
                ids += word_ids(word)
        return {"input_ids": ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str:
        assert not tokenize
        text = " ".join(f"<{m['role']}> {m['content']} <end>" for m in messages)
        return text + " <assistant>" if add_generation_prompt else text
