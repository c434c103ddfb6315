"""``prefilled``: hand ``model.generate`` a prefill computed elsewhere (the reuse engine's), for one call.

In transformers 5.x the decoding loop (``GenerationMixin._sample``, greedy and sampling alike) takes its first
step from ``self._prefill(input_ids, generation_config, model_kwargs, ...)``: a forward over the prompt rows the
cache does not hold, returning the model output (``logits`` and the cache). Everything after it (logits processors,
sampling, stopping criteria, streamers, the next steps' positions and masks) reads only that output and the
cache, so an output with the last prompt row's logits and a cache of every prompt row gives the same decoding as
``generate`` computing that row itself.

``prefilled(model, logits, cache)`` makes the calling context's next ``model.generate`` of ``model`` take them as its
prefill: while at least one such block is open, the model instance has its own ``_prefill`` (installed under a
lock, counted, and deleted when the last block closes, so the class method is back and nothing stays patched),
and it answers from a ``ContextVar``: a thread (or context) that opened no block, or whose output was used
already, runs the model's own ``_prefill``. Decoding modes that do not call ``_prefill`` (assisted decoding, a
``custom_generate``: ``NOT_PREFILLED``) must not be used in the block: the caller checks ``used`` after
``generate``.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

# generate keyword arguments whose decoding method does not start from ``_prefill``
NOT_PREFILLED = ("assistant_model", "custom_generate", "prompt_lookup_num_tokens", "assistant_early_exit")


@dataclass
class Prefill:
    """One handed-over prefill: the model output ``generate`` gets, the prompt length it is for, and whether it
    was used."""

    output: CausalLMOutputWithPast
    rows: int
    used: bool = False


_PENDING: ContextVar[dict[int, Prefill] | None] = ContextVar("kvshelf_prefilled", default=None)
_LOCK = threading.Lock()
_USERS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # open blocks per model


def _prefill(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The instance's ``_prefill`` while a ``prefilled`` block of the model is open somewhere: this context's
    handed-over output (once), else the class's own."""
    pending = _PENDING.get()
    entry = pending.get(id(self)) if pending else None
    if entry is None or entry.used:
        return type(self)._prefill(self, input_ids, *args, **kwargs)
    if input_ids.shape[-1] != entry.rows:
        raise ValueError(f"the prefill handed to generate covers {entry.rows} prompt rows, generate has "
                         f"{input_ids.shape[-1]}")
    entry.used = True
    return entry.output


def _install(model: nn.Module) -> None:
    with _LOCK:
        users = _USERS.get(model, 0)
        if users == 0:
            if "_prefill" in vars(model):
                raise RuntimeError(f"{type(model).__name__} has an instance attribute _prefill already; kvshelf "
                                   "cannot hand generate a prefill")
            object.__setattr__(model, "_prefill", types.MethodType(_prefill, model))
        _USERS[model] = users + 1


def _uninstall(model: nn.Module) -> None:
    with _LOCK:
        users = _USERS.get(model, 0) - 1
        if users <= 0:
            _USERS.pop(model, None)
            if "_prefill" in vars(model):
                object.__delattr__(model, "_prefill")
        else:
            _USERS[model] = users


@contextmanager
def prefilled(model: nn.Module, logits: torch.Tensor, cache: Any) -> Iterator[Prefill]:
    """In the block, the calling context's next ``model.generate`` starts from ``logits`` (the last prompt row's
    next-token logits, ``[vocab]``) and ``cache`` (every prompt row; pass it as ``generate``'s ``past_key_values``
    too) instead of running the model over the prompt rows the cache lacks. Yields the ``Prefill`` (``used``:
    whether ``generate`` took it)."""
    entry = Prefill(CausalLMOutputWithPast(logits=logits.reshape(1, 1, -1), past_key_values=cache),
                    int(cache.get_seq_length()))
    token = _PENDING.set({**(_PENDING.get() or {}), id(model): entry})
    _install(model)
    try:
        yield entry
    finally:
        _uninstall(model)
        _PENDING.reset(token)
