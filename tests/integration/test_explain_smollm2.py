"""Why a prompt missed, on the real SmolLM2-135M-Instruct and its own tokenizer and chat template: the same text
tokenized in two pieces, and an edited chat history, each named at the first token whose id differs."""

from __future__ import annotations

from kvshelf.adapters.chat import Conversation
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.miss import MissKind
from kvshelf.kvstore import open_embedded_store

TEXT = ("A key-value cache keeps the attention state of a prompt, so that a model that sees the same context "
        "again reads it back instead of computing it again.")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_text_tokenized_in_two_pieces_names_the_first_differing_token(smollm2, tmp_path):
    model, tokenizer = smollm2
    whole = tokenizer(TEXT)["input_ids"]
    cut = TEXT.index("attention") + 4  # inside a word: "atte" + "ntion" are other tokens than "attention"
    pieces = tokenizer(TEXT[:cut])["input_ids"] + tokenizer(TEXT[cut:])["input_ids"]
    index = _first_difference(whole, pieces)
    gen = CachedGenerator(model, tokenizer, open_embedded_store(tmp_path), block_size=16)
    assert gen.generate(whole, max_new_tokens=1, wait=True).miss_reason.kind is MissKind.NEVER_STORED
    result = gen.generate(pieces, max_new_tokens=1, store=False)
    reason = result.miss_reason
    assert (reason.kind, reason.token_index) == (MissKind.TOKENS_DIFFER, index)
    assert (reason.prompt_token, reason.stored_token) == (tokenizer.decode([pieces[index]]),
                                                          tokenizer.decode([whole[index]]))
    assert result.reused_tokens == index // 16 * 16
    print(reason)


def test_an_edited_system_message_is_named_at_its_first_changed_token(smollm2, tmp_path):
    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, open_embedded_store(tmp_path), block_size=16)
    chat = Conversation(gen, system="You are a concise assistant who answers in one short sentence.")
    chat.send("What is a neural network?", max_new_tokens=8)
    edited = chat.messages[:-1]
    edited[0] = {"role": "system", "content": "You are a concise assistant who answers in two short sentences."}
    turn = chat.reply(edited, max_new_tokens=2)
    common, ids = turn.common_prefix, turn.result.prompt_ids
    assert common % 16, "the edit must fall inside a block for the lookup to miss one"
    reason = turn.miss_reason
    assert (reason.kind, reason.token_index) == (MissKind.TOKENS_DIFFER, common)
    assert reason.prompt_token == tokenizer.decode([ids[common]])
    print(reason)
