"""Streaming the new tokens of a generation: a streamer that also times the first token, and an iterator.

Every front door (``CachedGenerator``, ``RAGGenerator``, ``PromptModuleGenerator``, ``Conversation``) accepts a
HF streamer (``streamer=``: a ``transformers`` ``BaseStreamer`` such as ``TextStreamer``) and offers ``stream(...)``,
an iterator of new token ids. TTFT is still measured: the generator wraps the caller's streamer in
``FirstTokenTimer``, which records when the first new token arrives and forwards every call.

The streamer protocol is HF ``generate``'s: ``put(prompt_ids)`` once, then ``put(new_ids)`` per step (``[batch]``
or ``[batch, 1]``), then ``end()``. A path that decodes without ``model.generate`` calls it the same way
(``emit_prompt``, ``emit_tokens``).
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from kvshelf.adapters.hf import BaseStreamer
from kvshelf.kvstore.errors import ConfigError

R = TypeVar("R")
_DONE = object()


class FirstTokenTimer(BaseStreamer):
    """Records when generation emits its first new token (its first ``put`` is the prompt) and forwards every
    call to ``inner`` (the caller's streamer, if any)."""

    def __init__(self, inner: BaseStreamer | None = None) -> None:
        if inner is not None and not (callable(getattr(inner, "put", None)) and callable(getattr(inner, "end", None))):
            raise ConfigError(f"streamer must have put() and end() (a transformers BaseStreamer), got "
                              f"{type(inner).__name__}")
        self.inner = inner
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.inner is not None:
            self.inner.end()


def emit_prompt(streamer: BaseStreamer | None, ids: list[int]) -> None:
    """The first call of the streamer protocol: the prompt ``[1, n]``."""
    if streamer is not None:
        streamer.put(torch.tensor([ids]))


def emit_tokens(streamer: BaseStreamer | None, tokens: list[int]) -> None:
    """One step of new tokens, one per row: ``[batch]``."""
    if streamer is not None:
        streamer.put(torch.tensor(tokens))


class _QueueStreamer(BaseStreamer):
    """Puts each new token id of a single-row generation on a queue (the prompt is skipped)."""

    def __init__(self, out: queue.Queue) -> None:
        self.out = out
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        if value.dim() > 1 and value.shape[0] != 1 or value.dim() == 1 and value.numel() != 1:
            raise ConfigError("stream() streams one sequence; use generate() with a streamer for a batch")
        for token in value.reshape(-1).tolist():
            self.out.put(int(token))

    def end(self) -> None:
        pass


class TokenStream(Generic[R]):
    """Iterate the new token ids of one generation as they are produced; ``result`` is the call's result.

    ``run(streamer)`` is the generation (it must pass ``streamer`` on); it runs in a worker thread in a copy of
    the caller's context (``contextvars``), so per-call settings stay the caller's. Iterating yields ``int`` token
    ids; ``texts()`` yields decoded text as it grows. An exception of the generation is raised by the iteration.
    """

    def __init__(self, run: Callable[[BaseStreamer], R], tokenizer: PreTrainedTokenizerBase | None = None,
                 *, timeout_s: float | None = None) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._tokenizer = tokenizer
        self._timeout_s = timeout_s
        self._result: R | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._consumed = False
        context = contextvars.copy_context()
        streamer = _QueueStreamer(self._queue)

        def work() -> None:
            try:
                self._result = context.run(run, streamer)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
                self._error = exc
            finally:
                self._finished.set()
                self._queue.put(_DONE)

        self._thread = threading.Thread(target=work, name="kvshelf-stream", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[int]:
        if self._consumed:
            raise ConfigError("this stream was already consumed; start another with stream()")
        self._consumed = True
        while True:
            try:
                item = self._queue.get(timeout=self._timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no new token within {self._timeout_s} s") from None
            if item is _DONE:
                break
            yield item
        self._thread.join()
        if self._error is not None:
            raise self._error

    def texts(self) -> Iterator[str]:
        """The decoded text of the new tokens as it grows, one increment per step (an incomplete multi-byte
        character is held back until its last token arrives)."""
        if self._tokenizer is None:
            raise ConfigError("texts() needs a tokenizer")
        ids: list[int] = []
        shown = ""
        for token in self:
            ids.append(token)
            text = self._tokenizer.decode(ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
            shown = text

    @property
    def result(self) -> R:
        """The generation's result; waits for it to finish (and raises its exception)."""
        self._finished.wait()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]
