"""``Conversation``: each finished turn's KV (generated tokens included) is stored, so the next turn prefills only
the new user message; every turn's answer equals plain ``model.generate`` over the same template ids; an edited
history reuses exactly the unchanged prefix. Tiny random Llama with a tiny chat template."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from arch_rule import Output, assert_same, plain_generate
from chat_tokenizer import ChatTokenizer
from families import WINDOW, attn_implementations, family_model
from helpers import word_ids

from kvshelf.adapters.chat import Conversation
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import MemoryTier, TieredStore
from kvshelf.kvstore.errors import ConfigError

BLOCK = 16
NEW = 6
@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _generator(model, **kwargs) -> CachedGenerator:  # noqa: ANN001, ANN003
    return CachedGenerator(model, ChatTokenizer(), TieredStore([MemoryTier(64 << 20)]), block_size=BLOCK, **kwargs)


def _words(n: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"word{int(i)}" for i in torch.randint(0, 10_000, (n,), generator=g))


def _exact(model, turn) -> None:  # noqa: ANN001
    """The turn's answer equals plain generate over its template ids."""
    got = Output(turn.new_ids, [lg[0] for lg in turn.result.logits])
    assert_same(got, plain_generate(model, turn.result.prompt_ids, NEW), what="chat turn")


def _send(chat: Conversation, text: str, **kwargs):  # noqa: ANN003, ANN202
    return chat.send(text, max_new_tokens=NEW, eos_token_id=None, output_logits=True, **kwargs)


def test_each_turn_prefills_only_the_new_message_and_equals_plain_generate(model):
    chat = Conversation(_generator(model), system=_words(20, seed=0))
    stored: list[int] = []
    for n in range(4):
        message = _words(9 + n, seed=n + 1)
        turn = _send(chat, message)
        _exact(model, turn)
        ids = turn.result.prompt_ids
        if n == 0:
            assert turn.reused_tokens == 0
        else:  # everything stored after the previous turn, its answer included; then the new message's markup
            assert ids[: len(stored)] == stored
            assert turn.common_prefix == turn.reused_tokens == len(stored)
            assert turn.prefilled_tokens == 1 + 2 + len(word_ids(message)) + 2  # last answer token, <end> <user>
        stored = ids + turn.new_ids[:-1]
        assert chat.stored_ids == stored
        assert chat.messages[-1] == {"role": "assistant", "content": turn.text}
        assert turn.text == " ".join(f"w{t}" for t in turn.new_ids)
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 4


def test_an_edited_history_reuses_only_the_unchanged_prefix(model):
    gen = _generator(model)
    chat = Conversation(gen, system=_words(20, seed=0))
    for n in range(3):
        _send(chat, _words(12, seed=n + 1))
    before = chat.template_ids()  # what the 3 turns left stored (their answers in the template)
    history = chat.messages
    history[3]["content"] = _words(12, seed=99)  # the second user message edited
    history.append({"role": "user", "content": _words(5, seed=50)})
    turn = chat.reply(history, max_new_tokens=NEW, eos_token_id=None, output_logits=True)
    ids = turn.result.prompt_ids
    common = next(i for i, (a, b) in enumerate(zip(ids, before, strict=False)) if a != b)
    assert turn.common_prefix == common
    assert turn.reused_tokens == (common // BLOCK) * BLOCK  # the full blocks of the unchanged part only
    assert 0 < turn.reused_tokens < common
    _exact(model, turn)
    assert chat.messages[:-1] == history


def test_a_resumed_history_reuses_the_stored_full_blocks(model):
    gen = _generator(model)
    first = Conversation(gen, system=_words(20, seed=0))
    for n in range(2):
        _send(first, _words(12, seed=n + 1))
    history = first.messages + [{"role": "user", "content": _words(7, seed=7)}]
    resumed = Conversation(gen, messages=history)
    turn = resumed.reply(max_new_tokens=NEW, eos_token_id=None, output_logits=True)
    stored = first.stored_ids
    common = next((i for i, (a, b) in enumerate(zip(turn.result.prompt_ids, stored, strict=False)) if a != b),
                  len(stored))
    assert turn.common_prefix == 0  # a new Conversation knows no stored sequence: full blocks only
    assert turn.reused_tokens == (common // BLOCK) * BLOCK > 0
    _exact(model, turn)
    follow = _send(resumed, _words(6, seed=8))  # from now on it knows its own
    assert follow.reused_tokens == follow.common_prefix > turn.reused_tokens


def test_stream_yields_the_answer_and_keeps_the_turn(model):
    gen = _generator(model)
    streamed = Conversation(gen, system=_words(20, seed=0))
    plain = Conversation(_generator(model), system=_words(20, seed=0))
    for n in range(2):
        message = _words(10, seed=n + 1)
        stream = streamed.stream(message, max_new_tokens=NEW, eos_token_id=None)
        tokens = list(stream)
        want = _send(plain, message)
        assert tokens == stream.result.new_ids == want.new_ids
    assert streamed.messages == plain.messages
    assert stream.result.reused_tokens > 0


def test_bad_inputs_are_clear_errors(model):
    gen = _generator(model)
    chat = Conversation(gen)
    for empty in ("", "   "):
        with pytest.raises(ConfigError, match="user message is empty"):
            chat.send(empty, max_new_tokens=2)
    with pytest.raises(ConfigError, match="last message is the user's"):
        chat.reply(max_new_tokens=2)
    with pytest.raises(ConfigError, match="role"):
        Conversation(gen, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(ConfigError, match="chat template"):
        Conversation(CachedGenerator(model))
    with pytest.raises(ConfigError, match="sets 'cacheable_prefix'"):
        chat.send("hello", max_new_tokens=2, cacheable_prefix=3)
    assert chat.messages == []  # nothing appended by the refused calls
    gen.close()
    with pytest.raises(ConfigError, match="CachedGenerator is closed"):
        chat.send("hello", max_new_tokens=2)
    assert chat.messages == []


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2-window", "gemma2", "gemma3", "gpt2", "deepseek-v2",
                                    "deepseek-v3", "minicpm3"])
def test_turns_on_other_families(family):
    """Sliding-window and hybrid layers keep the generated tokens' KV too (stored from a cache whose sliding layers
    kept every token); turns longer than the window. MLA families: keys and values of different head dims."""
    model = family_model(family, attn=attn_implementations(family)[0])
    chat = Conversation(_generator(model), system=_words(20, seed=0))
    for n in range(3):
        turn = _send(chat, _words(10, seed=n + 1))
        _exact(model, turn)
        assert turn.reused_tokens == (0 if n == 0 else turn.common_prefix) and turn.common_prefix == (
            0 if n == 0 else len(turn.result.prompt_ids) - turn.prefilled_tokens)
    assert turn.reused_tokens > WINDOW


class _LossyTokenizer(ChatTokenizer):
    """Decodes odd ids as words that tokenize to other ids: an answer the template re-tokenizes differently."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" if i % 2 == 0 else f"odd{i}" for i in ids)


def test_an_answer_re_tokenized_differently_reuses_up_to_the_difference(model):
    gen = CachedGenerator(model, _LossyTokenizer(), TieredStore([MemoryTier(64 << 20)]), block_size=BLOCK)
    chat = Conversation(gen, system=_words(30, seed=0))
    first = chat.send(_words(12, seed=1), max_new_tokens=24, eos_token_id=None)
    odd = next(i for i, t in enumerate(first.new_ids[:-1]) if t % 2)  # the first answer token that changes
    second = _send(chat, _words(5, seed=2))
    assert second.common_prefix == len(first.result.prompt_ids) + odd
    assert second.reused_tokens == (second.common_prefix // BLOCK) * BLOCK
    _exact(model, second)
