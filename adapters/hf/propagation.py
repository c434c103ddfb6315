"""Shortening the hidden-state sequence in the middle of a decoder's forward (FastKV's token-selective
propagation): the decoder module and its layer list, whether a decoder can run its later layers on fewer tokens,
how a prefill of an empty cache looks at the decoder's entry, a decoder layer's output hidden states, and the
per-token arguments a decoder layer takes (position embeddings, position ids, the causal mask) gathered at the
kept tokens.

A decoder in transformers 5.x computes its position embeddings and causal mask once, for every token of the
call, and hands the same objects to each layer (``layer(hidden, attention_mask=..., position_embeddings=...,
position_ids=..., past_key_values=...)``). A layer's forward hook may return shorter hidden states; the layers
after it then need those arguments at the kept tokens only, which a forward pre-hook gathers (``gather_call``).
The kept tokens stay in ascending order, so their causal mask is the full mask's rows and columns at them, and
their RoPE positions stay the original absolute ones.

Shapes: ``b`` batch, ``n`` tokens of the call, ``k`` kept tokens, ``d`` rotary dim.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from kvshelf.adapters.hf.dynamic import HFModule
from kvshelf.adapters.hf.modules import _LAYER_LISTS
from kvshelf.kvstore.errors import UnsupportedModelError

#: per-token keyword arguments of a decoder layer that ``gather_call`` gathers (the rest pass unchanged)
GATHERED_ARGUMENTS = ("attention_mask", "position_embeddings", "position_ids", "cache_position")


def decoder_stack(model: HFModule) -> tuple[HFModule, nn.ModuleList]:
    """``(decoder module, its decoder layers)`` in any layout kvshelf knows (Llama-style ``model.layers``,
    GPT-NeoX ``gpt_neox.layers``, Falcon and GPT-2 ``transformer.h``); ``UnsupportedModelError`` otherwise."""
    for outer, inner in _LAYER_LISTS:
        module = getattr(model, outer, None)
        layers = getattr(module, inner, None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return module, layers
    raise UnsupportedModelError(f"{type(model).__name__} has no decoder layers kvshelf knows (model.layers, "
                                "gpt_neox.layers, transformer.h)")


def propagation_problem(model: HFModule) -> str | None:
    """Why the decoder cannot run its later layers on fewer tokens than its input, or ``None``: GPT-2's decoder
    reshapes its last hidden states to the input's shape (``view(output_shape)``) and hands its layers the mask
    positionally, where a pre-hook cannot tell it from other arguments."""
    try:
        module, _ = decoder_stack(model)
    except UnsupportedModelError as exc:
        return str(exc)
    if _reshapes_to_input(type(module)):
        return "its decoder reshapes the last hidden states to the input's length (GPT-2's view(output_shape))"
    return None


@functools.cache
def _reshapes_to_input(cls: type) -> bool:
    try:
        return "view(output_shape)" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True  # cannot tell: refuse rather than crash mid-forward


def empty_cache_prefill(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """From a forward pre-hook of the decoder module (``with_kwargs=True``): ``(b, n)`` when the call prefills
    ``n`` tokens into an empty cache (or one the decoder creates), ``None`` otherwise (a decode step, a
    continuation of a filled cache, or a call without a cache)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    tokens = ids if ids is not None else embeds
    if tokens is None:
        return None
    cache = kwargs.get("past_key_values", kwargs.get("layer_past"))
    if cache is None and kwargs.get("use_cache") is False:
        return None
    if cache is not None and cache.get_seq_length() != 0:
        return None
    return int(tokens.shape[0]), int(tokens.shape[1])


def output_hidden(output: Any) -> torch.Tensor:
    """A decoder layer's output hidden states ``[b, n, hidden]`` (its output, or Falcon's ``outputs[0]``)."""
    return output[0] if isinstance(output, tuple) else output


def with_output_hidden(output: Any, hidden: torch.Tensor) -> Any:
    """A decoder layer's ``output`` with its hidden states replaced by ``hidden`` (what its forward hook returns)."""
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def gather_call(args: tuple, kwargs: dict, index: torch.Tensor, tokens: int,
                memo: dict[int, Any]) -> tuple[tuple, dict]:
    """A decoder layer's call arguments at the kept tokens ``index [k]`` (ascending) of the ``tokens`` the decoder
    was called with: position embeddings ``(cos, sin)`` each ``[b, n, d]`` -> ``[b, k, d]``, position ids
    ``[..., n]`` -> ``[..., k]``, the causal mask ``[b, 1, n, n]`` -> ``[b, 1, k, k]`` (``None``, sdpa's plain
    causal mask, stays ``None``: the kept tokens keep their order). Hidden states (``args[0]``) were shortened by the
    layer before. ``memo`` (by ``id`` of the full argument) shares each gathered argument across the layers of one
    call (the decoder hands them all the same objects). ``UnsupportedModelError`` for a per-token argument of
    another form (a flex-attention block mask, a mask wider than the call)."""
    if len(args) > 1:
        raise UnsupportedModelError("a decoder layer called with positional arguments beside its hidden states")
    out = dict(kwargs)
    for name in GATHERED_ARGUMENTS:
        value = kwargs.get(name)
        if value is not None:
            key = id(value)
            if key not in memo:
                memo[key] = (value, _gathered(name, value, index, tokens))  # the original kept alive: ids stay unique
            out[name] = memo[key][1]
    return args, out


def _gathered(name: str, value: Any, index: torch.Tensor, tokens: int) -> Any:
    if name == "position_embeddings":
        if not isinstance(value, tuple) or not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in value):
            raise UnsupportedModelError(f"position embeddings of an unknown form ({type(value).__name__}), not "
                                        "(cos, sin) tables [b, n, d]")
        return tuple(_at(t, 1, index, tokens, name) for t in value)
    if not isinstance(value, torch.Tensor):
        raise UnsupportedModelError(f"a decoder layer's {name} of type {type(value).__name__}, not a tensor")
    if name == "attention_mask" and value.dim() == 4:
        return _at(_at(value, 2, index, tokens, name), 3, index, tokens, name)
    return _at(value, value.dim() - 1, index, tokens, name)


def _at(value: torch.Tensor, dim: int, index: torch.Tensor, tokens: int, name: str) -> torch.Tensor:
    if value.shape[dim] != tokens:
        raise UnsupportedModelError(f"a decoder layer's {name} of shape {tuple(value.shape)}: dim {dim} is not the "
                                    f"call's {tokens} tokens")
    return value.index_select(dim, index.to(value.device))
