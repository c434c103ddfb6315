"""``RAGChat``: chat messages plus retrieved documents answered through ``RAGGenerator``; what every framework
integration calls.

The messages are rendered with the tokenizer's chat template. The documents sit at one place in one message:
either marked inside its text (``mark_documents``: what the integrations' ``format_documents`` put into a prompt
template's context slot), or, given as a list, at the head of the last user message. The rendered prompt is cut
there: the text before the documents is the generator's shared prefix (``RAGGenerator(prefix=...)``), each document
(plus ``separator``) is a chunk, and the text after them is the question. A chunk longer than ``chunk_size`` tokens
is split by ``reuse.chunking.chunk_tokens``, as ``rag.precompute`` splits a document. With a store, a chunk's KV is
computed and stored the first time it is seen and read back after (``on_missing="recompute"``). Without documents
the whole rendered prompt is generated plainly (``CachedGenerator``: greedy, the output of ``model.generate``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.lifecycle import Closable
from kvshelf.adapters.prompts import prompt_ids
from kvshelf.adapters.rag import DEFAULT_CHUNK_SIZE, MODES, RAGGenerator
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.protocol import BlockStore

DOC_START, DOC_END = "\ue000", "\ue001"  # private-use characters around each marked document
#: the default mode, the most accurate reuse mode: CacheBlend over the prefix-encoded blocks (closest to ``full`` in
#: ``kvshelf bench rag``, and in ``kvshelf bench rag-chain``'s free-form answers; docs/integrations.md)
DEFAULT_MODE = "reuse-blend"
DEFAULT_SEPARATOR = "\n\n"
PLAIN = "plain"  # ``Answer.mode`` of a call without documents
MAX_GENERATORS = 16  # RAG generators kept, one per distinct prefix (system prompt and history)

Message = Mapping[str, str]


def mark_documents(texts: Sequence[str]) -> str:
    """The documents as one string for a prompt's context slot, each between ``DOC_START`` and ``DOC_END``, so
    ``RAGChat`` finds them in the rendered prompt and passes them as chunks; no documents give ``""``."""
    out = []
    for n, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"document {n} is a {type(text).__name__}, not text")
        if DOC_START in text or DOC_END in text:
            raise ConfigError(f"document {n} holds a kvshelf document marker (U+E000 or U+E001)")
        out.append(f"{DOC_START}{text}{DOC_END}")
    return "".join(out)


def split_marked(text: str) -> tuple[str, list[str], str] | None:
    """``(before, documents, after)`` of a text holding marked documents side by side, ``None`` when it holds
    none. Markers that do not pair up, or text between two documents, are a ``ConfigError``."""
    if DOC_START not in text and DOC_END not in text:
        return None
    first, last = text.find(DOC_START), text.rfind(DOC_END)
    if first < 0 or last < first or DOC_END in text[:first] or DOC_START in text[last:]:
        raise ConfigError("the prompt's document markers do not pair up (a DOC_START before each DOC_END)")
    body = text[first:last + 1]
    docs: list[str] = []
    for n, piece in enumerate(body.split(DOC_END)[:-1]):
        if not piece.startswith(DOC_START) or DOC_START in piece[1:]:
            raise ConfigError(f"the prompt's marked documents are not side by side (at document {n}): put "
                              "mark_documents(...) in one place of one message")
        docs.append(piece[1:])
    return text[:first], docs, text[last + 1:]


def cut_at_stop(text: str, stop: Sequence[str] | None) -> tuple[str, bool]:
    """``text`` up to the first of the ``stop`` strings, and whether one was found."""
    cuts = [text.find(s) for s in stop or () if s and s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def held_back(text: str, stop: Sequence[str] | None) -> int:
    """How many characters at the end of ``text`` could begin one of the ``stop`` strings (a stream holds them
    back until the next piece shows whether the stop string follows)."""
    held = 0
    for s in stop or ():
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


@dataclass(frozen=True)
class Answer:
    """One answer: its text and ids, the mode (``"plain"`` without documents), the chunks after splitting, how many
    of them came from the store or were computed, and the time to the first token."""

    text: str
    new_ids: list[int]
    mode: str
    chunks: int
    reused_chunks: int
    computed_chunks: int
    ttft_s: float


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered chat prompt: ``chunks`` empty means plain generation of ``question`` (the whole prompt)."""

    prefix: str
    chunks: list[str]
    question: str


class RAGChat(Closable):
    """Chat messages with retrieved documents, answered by ``RAGGenerator`` over ``store``.

    Args:
        model, tokenizer: a HF causal LM and its tokenizer (with a chat template).
        store: a kvshelf store for the documents' KV (``None``: computed on every call).
        mode: the RAG mode (``rag.MODES``); default ``reuse-blend``, the most accurate reuse mode measured.
        chunk_size, overlap: a document longer than ``chunk_size`` tokens is split as ``precompute`` splits one.
        separator: text appended to each document (its chunk ends with it).
        max_new_tokens: the default answer length; ``generate_kwargs`` go to ``model.generate`` on every call.
        rag_options: further ``RAGGenerator`` options (``recompute_ratio``, ``blend_base``, ``on_missing``...).
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, store: BlockStore | None = None, *,
        mode: str = DEFAULT_MODE, namespace: str | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
        overlap: int = 0, separator: str = DEFAULT_SEPARATOR, max_new_tokens: int = 256,
        generate_kwargs: Mapping[str, Any] | None = None, **rag_options: Any,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; use one of {MODES}")
        if not callable(getattr(tokenizer, "apply_chat_template", None)):
            raise ConfigError("RAGChat needs a tokenizer with a chat template (apply_chat_template)")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.mode, self.namespace, self.separator, self.max_new_tokens = mode, namespace, separator, max_new_tokens
        self.generate_kwargs = dict(generate_kwargs or {})
        self.rag_options = {"chunk_size": chunk_size, "overlap": overlap, **rag_options}
        # checks the model, chunk_size and options now, before any call
        self._generators: OrderedDict[str, RAGGenerator] = OrderedDict()
        self._generator("")
        self._plain = CachedGenerator(model, tokenizer, store, namespace=namespace, write_behind=False)

    # -- prompts --------------------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], documents: Sequence[str] | None = None) -> RenderedPrompt:
        """The prompt of ``messages`` with ``documents`` at the head of the last user message (or where the
        messages mark them): its prefix, chunks and question."""
        messages = [dict(m) for m in messages]
        if not messages:
            raise ConfigError("no messages given")
        for n, m in enumerate(messages):
            if not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise ConfigError(f"message {n} needs a text 'role' and 'content'")
        marked = any(DOC_START in m["content"] or DOC_END in m["content"] for m in messages)
        if documents is not None and marked:
            raise ConfigError("documents come both marked in the messages and as a list; give them one way")
        if documents:
            users = [n for n, m in enumerate(messages) if m["role"] == "user"]
            if not users:
                raise ConfigError("documents need a user message to go into")
            messages[users[-1]]["content"] = mark_documents(list(documents)) + messages[users[-1]]["content"]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        found = split_marked(text)
        if found is None:
            return RenderedPrompt("", [], text)
        before, docs, after = found
        for n, doc in enumerate(docs):
            if not doc.strip():
                raise ConfigError(f"document {n} is empty")
        return RenderedPrompt(before, [doc + self.separator for doc in docs], after)

    def _generator(self, prefix: str) -> RAGGenerator:
        gen = self._generators.pop(prefix, None)
        if gen is None:
            gen = RAGGenerator(self.model, self.tokenizer, self.store, namespace=self.namespace, prefix=prefix or None,
                               **self.rag_options)
        self._generators[prefix] = gen
        while len(self._generators) > MAX_GENERATORS:
            self._generators.popitem(last=False)[1].close()
        return gen

    # -- answers --------------------------------------------------------------------------------------

    def _target(self, prompt: RenderedPrompt, mode: str | None, max_new_tokens: int | None,
                kwargs: dict[str, Any]) -> tuple[CachedGenerator | RAGGenerator, tuple[Any, ...], dict[str, Any]]:
        """What answers ``prompt``: the plain generator or the prefix's RAG generator, with its arguments."""
        self._check_open()
        mode = mode or self.mode
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; use one of {MODES}")
        kwargs = {**self.generate_kwargs, **kwargs, "max_new_tokens": max_new_tokens or self.max_new_tokens}
        if not prompt.chunks:
            return self._plain, (prompt_ids(prompt.question, self.tokenizer, add_special_tokens=False),), kwargs
        return self._generator(prompt.prefix), (prompt.chunks, prompt.question), {"mode": mode, **kwargs}

    def generate(self, messages: Sequence[Message], documents: Sequence[str] | None = None, *,
                 mode: str | None = None, max_new_tokens: int | None = None, **generate_kwargs: Any) -> Answer:
        """Answer ``messages`` over ``documents`` (or plainly without any); ``generate_kwargs`` (``streamer``,
        ``do_sample``...) go to the generator's ``generate``."""
        prompt = self.render(messages, documents)
        gen, args, kwargs = self._target(prompt, mode, max_new_tokens, generate_kwargs)
        return self._answer(prompt, gen.generate(*args, **kwargs))

    def stream(self, messages: Sequence[Message], documents: Sequence[str] | None = None, *,
               mode: str | None = None, max_new_tokens: int | None = None, **generate_kwargs: Any) -> Iterator[str]:
        """``generate`` as the answer's text, piece by piece as its tokens come; the pieces join to ``generate``'s
        text."""
        prompt = self.render(messages, documents)
        gen, args, kwargs = self._target(prompt, mode, max_new_tokens, generate_kwargs)
        yield from gen.stream(*args, **kwargs).texts()

    def _answer(self, prompt: RenderedPrompt, result: Any) -> Answer:
        text = self.tokenizer.decode(result.new_ids, skip_special_tokens=True)
        if not prompt.chunks:
            return Answer(text, list(result.new_ids), PLAIN, 0, 0, 0, result.ttft_s)
        return Answer(text, list(result.new_ids), result.mode, result.chunks, result.reused_chunks,
                      result.computed_chunks, result.ttft_s)

    def close(self) -> None:
        """End this chat and its generators; the store stays open (the caller's)."""
        for gen in self._generators.values():
            gen.close()
        self._generators.clear()
        self._plain.close()
        super().close()
