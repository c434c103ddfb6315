"""Attention implementations: reading, switching (per call, per thread) and registering them.

kvshelf runs some calls with another attention implementation than the model's own (eager for a pruning
prefill, ``kvshelf_gqa_fold`` for the reuse engine's layer-by-layer runs, ``kvshelf_tokenselect``). Switching
``config._attn_implementation`` for that would switch every thread using the model. Instead, while at least one
kvshelf call uses the model (``attention_scope``), its configs name ``DISPATCH``: a registered attention function
and mask function that look the implementation up per call, in a ``ContextVar`` (the calling thread's context),
and fall back to the model's own implementation (``sdpa`` or ``eager``) when the context chose none. A call that
is not kvshelf's, or another thread's, sees exactly the original functions (same masks, same attention); the
last scope to exit puts the model's own name back. The dispatch state (``_CHOSEN``, ``_BASES``, ``_INSTALLED``,
``_LOCK``) lives in this module only.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvshelf.adapters.hf.dynamic import HFModule
from kvshelf.adapters.hf.modules import eager_attention_function
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError

#: the attention implementation (and mask function) name a model runs under while kvshelf calls use it
DISPATCH = "kvshelf_dispatch"
#: the implementations a model may have for ``DISPATCH`` to stand in for it (others: ``switch_attention`` is global)
_DISPATCHABLE = ("sdpa", "eager")
#: per config (by ``id``): the implementation this context chose; only configs with an active scope have an entry
_CHOSEN: ContextVar[dict[int, str] | None] = ContextVar("kvshelf_attention", default=None)
#: per config (by ``id``): the model's own implementation, recorded before its configs were switched to DISPATCH
_BASES: dict[int, str] = {}
_LOCK = threading.Lock()


@dataclass
class _Dispatch:
    base: str  # the model's own implementation
    configs: tuple[int, ...]  # ids of every config object of the model (the attention modules' included)
    users: int = 0  # active ``attention_scope`` s, all threads


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, _Dispatch] = weakref.WeakKeyDictionary()


def _chosen(config: Any) -> str:
    """The implementation this context runs ``config`` 's attention with (a ``DISPATCH`` config)."""
    chosen = _CHOSEN.get()
    name = chosen.get(id(config)) if chosen else None
    if name is None:
        name = _BASES.get(id(config))
    if name is None:  # switched back meanwhile (the last scope exited between HF's lookup and the call)
        name = config._attn_implementation
        if name == DISPATCH:
            raise UnsupportedModelError("a model config names kvshelf's attention dispatch without kvshelf "
                                        "having installed it")
    return name


def _dispatch_attention(module: HFModule, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The ``DISPATCH`` attention function: the implementation ``_chosen`` for the module's config, called as
    the module's forward would call it (``query [b, h_q, q, d]``, ``key/value [b, h, n, d]`` -> ``([b, q, h_q, d],
    weights or None)``); ``eager`` is the module's own modeling file's eager function (GPT-2's reordered upcast
    when the module asks for it)."""
    name = _chosen(module.config)
    if name == "eager":
        if getattr(module, "reorder_and_upcast_attn", False):
            return module._upcast_and_reordered_attn(query, key, value, attention_mask)
        return eager_attention_function(module)(module, query, key, value, attention_mask, **kwargs)
    return AttentionInterface._global_mapping[name](module, query, key, value, attention_mask, **kwargs)


def _dispatch_mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """The ``DISPATCH`` mask function: the mask function of the implementation ``_chosen`` for ``config`` (eager:
    additive float; sdpa: bool, or ``None`` for a plain causal mask), or ``None`` for an implementation without
    one (what transformers gives such an implementation)."""
    function = AttentionMaskInterface._global_mapping.get(_chosen(config))
    return None if function is None else function(*args, config=config, **kwargs)


def _configs(model: HFModule) -> list[Any]:
    """Every config object of the model: its own, its sub-configs', its submodules' (the attention modules')."""
    found: dict[int, Any] = {}
    pending = [model.config]
    pending += [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while pending:
        config = pending.pop()
        if id(config) not in found:
            found[id(config)] = config
            pending += [getattr(config, k) for k in getattr(config, "sub_configs", {}) if getattr(config, k, None)]
    return list(found.values())


def _install(model: HFModule) -> _Dispatch | None:
    """Make the model's configs name ``DISPATCH`` (one more user if they do already); ``None`` when the model
    cannot be dispatched (its own implementation is not sdpa or eager, it cannot switch implementations, or its
    configs disagree)."""
    with _LOCK:
        state = _INSTALLED.get(model)
        own = model.config._attn_implementation
        if own != DISPATCH:
            configs = _configs(model)
            if (own not in _DISPATCHABLE or not can_switch_attention(model)
                    or any(c._attn_implementation != own for c in configs)):
                return None
            AttentionInterface.register(DISPATCH, _dispatch_attention)
            AttentionMaskInterface.register(DISPATCH, _dispatch_mask)
            for config in configs:  # before the switch: a dispatched call always finds its base
                _BASES[id(config)] = own
            if state is None:
                state = _INSTALLED[model] = _Dispatch(own, tuple(id(c) for c in configs))
            state.base = own
            model.set_attn_implementation(DISPATCH)
        elif state is None:
            raise UnsupportedModelError("a model config names kvshelf's attention dispatch without kvshelf having "
                                        "installed it")
        state.users += 1
        return state


def _uninstall(model: HFModule, state: _Dispatch) -> None:
    with _LOCK:
        state.users -= 1
        if state.users == 0 and model.config._attn_implementation == DISPATCH:
            model.set_attn_implementation(state.base)


def _scoped(model: HFModule) -> bool:
    """Whether an ``attention_scope`` of the model is active in this context."""
    chosen = _CHOSEN.get()
    return bool(chosen) and id(model.config) in chosen


def attn_implementation(model: PreTrainedModel) -> str:
    """The attention implementation the model runs with now in this context (thread): ``"sdpa"``, ``"eager"``, a
    registered name... Another thread's ``attention_implementation`` block does not change what this returns."""
    own = model.config._attn_implementation
    return _chosen(model.config) if own == DISPATCH else str(own)


@contextmanager
def attention_scope(model: PreTrainedModel) -> Iterator[bool]:
    """A block in which ``switch_attention`` changes the model's attention implementation for the current context
    only (this thread, and contexts copied from it): yields whether it can (``False``: the model's own
    implementation is not sdpa or eager, or the model cannot switch; ``switch_attention`` then switches it for
    every thread). On exit the context's choice is what it was before the block."""
    state = _install(model)
    if state is None:
        yield False
        return
    try:
        chosen = dict(_CHOSEN.get() or {})
        current = attn_implementation(model)
        for config_id in state.configs:
            chosen.setdefault(config_id, current)
        token = _CHOSEN.set(chosen)
        try:
            yield True
        finally:
            _CHOSEN.reset(token)
    finally:
        _uninstall(model, state)


def switch_attention(model: PreTrainedModel, name: str) -> None:
    """Switch the model to the attention implementation ``name``: inside an ``attention_scope`` of the model, for
    the current context only (until the scope exits); otherwise for every thread (a model kvshelf cannot dispatch,
    ``attention_scope`` yielded ``False``). ``ConfigError`` outside a scope while other kvshelf calls dispatch the
    model (a global switch would change their attention)."""
    if name != "eager" and name not in AttentionInterface._global_mapping:
        raise ConfigError(f"unknown attention implementation {name!r} (register it first)")
    if _scoped(model):
        state = _INSTALLED[model]
        chosen = dict(_CHOSEN.get() or {})
        chosen.update(dict.fromkeys(state.configs, name))
        _CHOSEN.set(chosen)
        return
    if model.config._attn_implementation == DISPATCH:
        raise ConfigError(f"switch_attention({name!r}) outside an attention_scope of a model that other kvshelf calls "
                          "are using: it would switch their attention too")
    model.set_attn_implementation(name)


@contextmanager
def attention_implementation(model: PreTrainedModel, name: str) -> Iterator[str]:
    """Run the block with attention implementation ``name`` in the current context (this thread; other threads
    using the model keep theirs); the previous one is yielded, and back afterwards."""
    previous = attn_implementation(model)
    if previous == name:
        yield previous
        return
    with attention_scope(model) as scoped:
        if scoped:
            switch_attention(model, name)
            yield previous
            return
        with _LOCK:  # a model kvshelf cannot dispatch: the old global switch, for every thread
            model.set_attn_implementation(name)
        try:
            yield previous
        finally:
            with _LOCK:
                model.set_attn_implementation(previous)


def supports_sdpa(model: HFModule) -> bool:
    """Whether the model class can run with ``sdpa`` attention."""
    return bool(getattr(model, "_supports_sdpa", False))


def can_switch_attention(model: HFModule) -> bool:
    """Whether ``switch_attention`` works on the model (Falcon's attention ignores it: transformers only warns)."""
    can = getattr(model, "_can_set_attn_implementation", None)
    return bool(can()) if callable(can) else False


def register_attention(name: str, function: Callable[..., Any], *, sdpa_masks: bool = False) -> None:
    """Register ``function`` as the attention implementation ``name`` (idempotent).

    ``function(module, query [b, h_q, q, d], key [b, h, n, d], value [b, h, n, d], attention_mask, **kwargs)``
    returns ``(output [b, q, h_q, d], weights or None)``. ``sdpa_masks``: the model builds its masks for ``name``
    as for ``sdpa`` (else the model's default for unknown implementations applies).
    """
    AttentionInterface.register(name, function)
    if sdpa_masks:
        AttentionMaskInterface.register(name, sdpa_mask)
