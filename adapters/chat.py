"""Chat turns with the KV of every finished turn kept: ``Conversation``.

Each turn renders the whole conversation with the tokenizer's chat template (``add_generation_prompt=True``) into
token ids ``P`` and generates through a ``CachedGenerator``. After the turn, the KV of ``P`` plus the generated
tokens is stored (``generate(..., store_generated=True)``: chained prefix blocks including the last partial one,
``kvstore.keys.prefix_block_spans(..., partial=True)``), and the conversation remembers that token sequence ``S``
(``P + new_ids[:-1]``: the last new token never went through the model). The next turn's template ids ``P'``
start with ``S`` when nothing changed, so its lookup of ``P'[:L]`` with ``L`` = the longest common prefix of ``P'``
and ``S`` (``cacheable_prefix=L``: partial blocks included) finds exactly the stored keys, and only the new user
message (and the template's markup around it) is prefilled. When the history was edited, or the template
re-tokenizes an answer differently from the generated ids, ``L`` stops where they differ and only the full blocks
of that unchanged prefix are reused; either way the answer equals plain ``model.generate`` over ``P'`` (the reused
KV is that of the same tokens at the same positions).

With write-behind (the generator's default) the previous turn's blocks may still be queued when the next turn
looks them up: the generator's lookup waits for its own pending writes when blocks are missing
(``CachedGenerator`` "reading your own writes"), so no turn is ever prefilled for lack of a flush. Keeping the last
turn's cache in memory instead would skip the reload, but would hold a full cache per idle conversation; a
store's memory tier gives the same reuse with eviction.

A ``Conversation`` is used by one thread at a time (a server holds one per session).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshelf.adapters.generate import CachedGenerator, GenerationResult
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.miss import MissReason
from kvshelf.adapters.streaming import TokenStream
from kvshelf.kvstore.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTurn:
    """One answered turn: the assistant's ``text`` and the generation behind it (``result.prompt_ids`` are the
    template ids of the conversation up to the answer, ``result.new_ids`` the answer's tokens)."""

    text: str
    result: GenerationResult
    common_prefix: int  # template tokens shared with what the conversation stored after its previous turn
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation after this turn

    @property
    def reused_tokens(self) -> int:
        return self.result.reused_tokens

    @property
    def prefilled_tokens(self) -> int:
        return self.result.prefilled_tokens

    @property
    def ttft_s(self) -> float:
        return self.result.ttft_s

    @property
    def new_ids(self) -> list[int]:
        return self.result.new_ids

    @property
    def miss_reason(self) -> MissReason | None:
        """Why the turn's lookup found fewer blocks than its template ids have (``GenerationResult.miss_reason``):
        an edited history, or a template that re-tokenizes an answer differently, is ``tokens_differ`` at the
        first token that changed."""
        return self.result.miss_reason


class Conversation:
    """A chat through a ``CachedGenerator`` that keeps each finished turn's KV, generated tokens included.

    Args:
        generator: its tokenizer must have a chat template (``apply_chat_template``).
        system: a system message to start with.
        messages: a history to resume (``{"role", "content"}`` dicts; after ``system`` if both are given).
        chat_template_kwargs: passed to ``apply_chat_template`` on every turn (``tools=``, template options).

    ``send(text)`` adds a user message and answers it; ``reply()`` answers the history as it is (a resumed one
    whose last message is the user's), or ``reply(messages)`` an edited one: either reuses exactly the token prefix
    it shares with what is stored.
    """

    def __init__(self, generator: CachedGenerator, *, system: str | None = None,
                 messages: Sequence[dict[str, Any]] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        tokenizer = generator.tokenizer
        if tokenizer is None or not callable(getattr(tokenizer, "apply_chat_template", None)):
            raise ConfigError("a Conversation needs a generator whose tokenizer has a chat template "
                              "(apply_chat_template)")
        self.generator = generator
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        history: list[dict[str, Any]] = []
        if system is not None:
            history.append({"role": "system", "content": system})
        history += _checked(messages or [])
        self._messages = history
        self._stored_ids: list[int] = []  # the sequence whose KV this conversation stored last

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far (copies: editing them changes nothing; use ``reply(messages)``)."""
        return [dict(m) for m in self._messages]

    @property
    def stored_ids(self) -> list[int]:
        """The token ids whose KV this conversation stored after its last turn (template ids + the answer's tokens
        but the last); empty before its first turn and without a store."""
        return list(self._stored_ids)

    def template_ids(self, messages: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` (default: the conversation) rendered by the chat template, with the
        assistant's generation prompt at the end."""
        tokenizer = self.generator.tokenizer
        text = tokenizer.apply_chat_template(list(messages if messages is not None else self._messages),
                                             tokenize=False, add_generation_prompt=True,
                                             **self.chat_template_kwargs)
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

    def send(self, user_text: str, *, max_new_tokens: int, streamer: BaseStreamer | None = None,
             **generate_kwargs: Any) -> ChatTurn:
        """Add ``user_text`` as the user's message, answer it, and keep the answer (and its KV)."""
        return self._answer(self._messages + [_user(user_text)], max_new_tokens=max_new_tokens, streamer=streamer,
                            generate_kwargs=generate_kwargs)

    def reply(self, messages: Sequence[dict[str, Any]] | None = None, *, max_new_tokens: int,
              streamer: BaseStreamer | None = None, **generate_kwargs: Any) -> ChatTurn:
        """Answer ``messages`` (default: the conversation as it is), whose last message must be the user's; they
        become the conversation, followed by the answer. An edited history reuses the unchanged token prefix."""
        history = _checked(messages) if messages is not None else [dict(m) for m in self._messages]
        if not history or history[-1]["role"] != "user":
            raise ConfigError("reply() answers a conversation whose last message is the user's")
        return self._answer(history, max_new_tokens=max_new_tokens, streamer=streamer,
                            generate_kwargs=generate_kwargs)

    def stream(self, user_text: str, *, max_new_tokens: int, **generate_kwargs: Any) -> TokenStream[ChatTurn]:
        """``send`` in a worker thread, iterated token by token; ``.result`` is the ``ChatTurn``."""
        if "streamer" in generate_kwargs:
            raise ConfigError("stream() makes its own streamer; use send(streamer=...) to pass one")
        message = _user(user_text)  # checked now, in the caller's thread
        return TokenStream(
            lambda streamer: self._answer(self._messages + [message], max_new_tokens=max_new_tokens,
                                          streamer=streamer, generate_kwargs=generate_kwargs),
            self.generator.tokenizer,
        )

    def _answer(self, history: list[dict[str, Any]], *, max_new_tokens: int, streamer: BaseStreamer | None,
                generate_kwargs: dict[str, Any]) -> ChatTurn:
        for name in ("cacheable_prefix", "store_generated"):
            if name in generate_kwargs:
                raise ConfigError(f"a Conversation sets {name!r} itself; it is not accepted")
        ids = self.template_ids(history)
        common = _common_prefix(ids, self._stored_ids)
        result = self.generator.generate(ids, max_new_tokens=max_new_tokens, streamer=streamer,
                                         cacheable_prefix=common or None, store_generated=True, **generate_kwargs)
        text = result.text if result.text is not None else ""
        self._messages = history + [{"role": "assistant", "content": text}]
        if self.generator.store is not None and generate_kwargs.get("store", True):
            self._stored_ids = ids + result.new_ids[:-1]
        return ChatTurn(text=text, result=result, common_prefix=common, messages=self.messages)


def _user(text: str) -> dict[str, Any]:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("the user message is empty")
    return {"role": "user", "content": text}


def _checked(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages``, each a dict with a known ``role`` and a string ``content``."""
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ConfigError(f"message {index} must be a dict with a role in {ROLES}, got {message!r:.80}")
        if not isinstance(message.get("content"), str):
            raise ConfigError(f"message {index} has no string content")
        out.append(dict(message))
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for index in range(n):
        if a[index] != b[index]:
            return index
    return n
