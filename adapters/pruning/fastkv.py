"""FastKV: prefill-time pruning by token-selective propagation (TSP).

Jo et al., "FastKV: KV Cache Compression for Fast Long-Context Processing with Token-Selective Propagation"
(2025). The decoder layers up to the TSP layer run the whole prompt; at the TSP layer the last ``window`` tokens'
queries vote for the tokens to keep (SnapKV's observation window: softmax over the context, mean over the window,
max pooling, per KV head, GQA-aware, then averaged over the KV heads: one choice per token, since a token's
hidden state is shared by every head), and only the chosen tokens' hidden states (the window always among them)
go on to the later layers, which therefore prefill ``ratio`` of the prompt. Their RoPE positions stay the original
absolute ones and their causal mask is the full mask at the kept tokens (``hf.propagation.gather_call``); the
last token is always kept, so the prefill's last logits, and thus the first generated token, come from the
pruned prefill::

    with FastKV(layer=9, ratio=0.1)(model) as session:
        out = model.generate(input_ids, max_new_tokens=16)
    session.propagated                    # [k] absolute positions the layers after the TSP layer prefilled

The cache: with ``budget=None`` (the default) every layer keeps exactly the propagated tokens (the layers up to
the TSP layer are cut to them once it has voted): one set of positions for the whole cache, which stores exactly
through the ``sparse`` codec (``FastKVSession.stored_tensors``). With a ``budget`` (a ratio of the prompt or a
token count, the paper's decoupled KV budget), each layer keeps ``min(budget, propagated)`` tokens per KV head
by its own SnapKV vote (the layers up to the TSP layer choose from the whole prompt, the later ones from the
propagated tokens); every layer holds the same number of tokens, which decode steps' masks assume.

Decode-time methods compose by nesting (``with FastKV(...)(model), TokenSelect(...)(model):``): TokenSelect sees
a full-attention prefill of the propagated tokens, then selects in the pruned cache.

How it hooks transformers 5.x (all internals in ``hf.propagation``): a forward pre-hook on the decoder module
notes a prefill of an empty cache (batch 1; another batch size raises ``PruningError``); forward hooks on the
attention modules score and prune each layer's cache (as the static methods do); a forward hook on the TSP
decoder layer returns its output hidden states at the chosen tokens; forward pre-hooks on the later decoder
layers gather their position embeddings, position ids and mask at those tokens. A call of the model outside
``generate`` returns logits of the propagated tokens only (``[b, k, vocab]``; the last one is the prompt's last).

Refused when the ``with`` block is entered (``UnsupportedArchitectureError`` naming the family and the feature):
models with any sliding-window, chunked or recurrent layer (a window counts cache slots, which dropped tokens
would shift; a recurrent state would skip tokens), ALiBi, GPT-2's decoder (reshapes to the input's length), and
query paths SnapKV cannot recompute (MLA, Llama 4). A TSP layer outside ``[0, layers - 2]`` raises
``ConfigError``; ratios and budgets out of range ``BudgetError``.

Shapes: ``b`` batch (1), ``h_kv`` KV heads, ``n`` prompt tokens, ``k`` propagated tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvshelf.adapters import hf
from kvshelf.adapters.hf import propagation
from kvshelf.adapters.pruning.base import (
    LayerInputs,
    _active,
    _is_active,
    _layer_inputs,
    attention_modules,
    gather_tokens,
    refusal,
    select,
)
from kvshelf.adapters.pruning.budget import check_budget, resolve_budget
from kvshelf.adapters.pruning.errors import BudgetError, PruningError
from kvshelf.adapters.pruning.layout import GrowingLayer, cache_bytes
from kvshelf.adapters.pruning.snapkv import SnapKV
from kvshelf.kvstore.errors import ConfigError

NAME = "FastKV"


@dataclass
class FastKVSession:
    """What a FastKV prefill did.

    Attributes:
        layer: the TSP layer.
        tokens_before: the prompt's tokens ``n``.
        propagated: ``[k]`` ascending absolute positions of the tokens the layers after the TSP layer prefilled.
        kept: per layer, the absolute positions ``[b, h_kv, kept]`` (ascending) its cache holds.
    """

    method: FastKV
    layer: int
    tokens_before: int = 0
    propagated: torch.Tensor | None = None
    kept: dict[int, torch.Tensor] = field(default_factory=dict)

    def kv_bytes(self, cache: Any) -> int:
        """Bytes of keys and values the pruned cache takes now."""
        return cache_bytes(cache)

    def stored_tensors(self, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's KV ``[layers, h_kv, n, d]`` (keys, values) on CPU with every token the cache does not hold
        marked dropped (NaN: what the ``sparse`` codec leaves out), for a cache whose layers and heads all hold the
        same tokens (``budget=None``); ``PruningError`` otherwise. Only the first ``n`` cache entries of each layer
        are the prompt's (decode steps append after them)."""
        if self.propagated is None:
            raise PruningError("FastKV has not pruned a prefill yet: nothing to store")
        first = self.kept[0][0, 0]
        if any(not torch.equal(k, first.expand_as(k)) for k in self.kept.values()):
            raise PruningError("the cache's layers or heads hold different tokens (a FastKV budget): the sparse "
                               "codec stores one token set per block; use budget=None")
        keys, values = [], []
        for layer in hf.cache_layers(cache):
            k, v = hf.filled_layer_tensors(layer)
            for tensor, out in ((k, keys), (v, values)):
                full = torch.full((tensor.shape[1], self.tokens_before, tensor.shape[3]), float("nan"),
                                  dtype=tensor.dtype)
                full[:, first.cpu()] = tensor[0, :, :len(first)].cpu()
                out.append(full)
        return torch.stack(keys), torch.stack(values)


@dataclass
class _Call:
    """One prefill in progress: its size, and the propagated tokens once the TSP layer chose them."""

    tokens: int
    propagate: int
    keep: int
    index: torch.Tensor | None = None  # [k] ascending positions, set by the TSP layer
    memo: dict[int, Any] = field(default_factory=dict)  # gathered per-token layer arguments, shared by layers


#: the prefill in progress per ``with FastKV(...)(model):`` block, in this context (thread)
_CALLS: ContextVar[dict[object, _Call] | None] = ContextVar("kvshelf_fastkv_calls", default=None)


class _Block:
    """One ``with FastKV(...)(model):`` block (``token``) and its prefill in progress in this context."""

    def __init__(self) -> None:
        self.token = object()

    def current(self) -> _Call | None:
        return (_CALLS.get() or {}).get(self.token) if _is_active(self.token) else None

    def set_call(self, call: _Call | None) -> None:
        calls = dict(_CALLS.get() or {})
        calls.pop(self.token, None)
        if call is not None:
            calls[self.token] = call
        _CALLS.set(calls)


@dataclass
class FastKV:
    """Token-selective propagation after decoder layer ``layer``; the cache pruned to the propagated tokens.

    Args:
        layer: the TSP layer (0-based): layers ``0..layer`` prefill the whole prompt, the later ones only the
            propagated tokens. ``None``: two thirds of the depth (``2 * layers // 3``, at most ``layers - 2``;
            SmolLM2-135M: 20 of 30). Measured on SmolLM2 at 4K tokens: the window's vote puts a needle among the
            best 20% in 10 of 10 cases at layer 20, 6 of 10 at layers 15-18, at most 1 of 10 up to layer 13;
            the paper's half depth (Llama-3.1-8B: 15 of 32) suits larger models.
        ratio: the propagated tokens: a ratio of the prompt in ``(0, 1]`` or a token count (the paper's TSP rate).
        budget: the KV cache's tokens per layer and head: ``None`` keeps the propagated tokens in every layer;
            a ratio of the prompt or a count keeps ``min(budget, propagated)`` by each layer's own SnapKV vote.
        window, kernel, pooling: the observation window (the prompt's last tokens, always kept) and its pooling,
            as ``SnapKV``'s.
    """

    layer: int | None = None
    ratio: float | int = 0.2
    budget: float | int | None = None
    window: int = 16
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        try:
            check_budget(self.ratio)
        except BudgetError as exc:
            raise BudgetError(f"FastKV's ratio (propagated tokens): {exc}") from exc
        if self.budget is not None:
            check_budget(self.budget)
        if self.layer is not None and (isinstance(self.layer, bool) or not isinstance(self.layer, int)
                                       or self.layer < 0):
            raise ConfigError(f"FastKV's TSP layer must be a decoder layer index >= 0 (or None), got {self.layer!r}")
        self._vote = SnapKV(1.0, window=self.window, kernel=self.kernel, pooling=self.pooling)

    @property
    def name(self) -> str:
        return NAME

    def tsp_layer(self, layers: int) -> int:
        """The TSP layer of a model of ``layers`` decoder layers; ``ConfigError`` when no layer would follow it."""
        layer = min(2 * layers // 3, layers - 2) if self.layer is None else self.layer
        if not 0 <= layer <= layers - 2:
            raise ConfigError(f"FastKV's TSP layer must be in [0, {layers - 2}] for a model of {layers} decoder "
                              f"layers (the layers after it prefill the propagated tokens), got {layer}")
        return layer

    def check_model(self, model: hf.HFModule) -> tuple[list[hf.HFModule], nn.Module, nn.ModuleList, int]:
        """``(attention modules, decoder module, decoder layers, TSP layer)``; refuses (before any work) what
        FastKV cannot do on ``model``."""
        modules = attention_modules(model, NAME, queries=True)
        types = hf.attention_layer_types(model.config)
        windows = sorted(set(types) & hf.WINDOWED_ATTENTION)
        states = sorted(set(types) - hf.WINDOWED_ATTENTION - {hf.FULL_ATTENTION})
        if states:
            raise refusal(NAME, model, f"layers of types {states} keep a recurrent state, which would skip the "
                                       "dropped tokens")
        if windows:
            raise refusal(NAME, model, f"layers of types {windows}: a sliding window or chunk counts cache slots, "
                                       "which the dropped tokens would shift")
        problem = propagation.propagation_problem(model)
        if problem is not None:
            raise refusal(NAME, model, problem)
        decoder, layers = propagation.decoder_stack(model)
        if [m.layer_idx for m in modules] != list(range(len(layers))):
            raise refusal(NAME, model, "its attention modules do not map one to one to its decoder layers")
        return modules, decoder, layers, self.tsp_layer(len(layers))

    def propagated_index(self, inputs: LayerInputs, keep: int) -> torch.Tensor:
        """``[k]`` ascending positions: the ``keep`` best of the TSP layer's vote averaged over its KV heads (the
        window forced)."""
        scores = self._vote.base_score(inputs).float().mean(dim=1)  # [b, n]; +inf on the window
        return select(scores.unsqueeze(1), keep)[0, 0]

    def head_index(self, inputs: LayerInputs, keep: int) -> torch.Tensor:
        """``[b, h_kv, keep]`` ascending cache indices each KV head keeps by its own SnapKV vote."""
        if keep >= inputs.tokens:
            return torch.arange(inputs.tokens, device=inputs.keys.device).expand(*inputs.keys.shape[:2], -1)
        return select(self._vote.base_score(inputs), keep)

    def _prune_layer(self, session: FastKVSession, call: _Call, cache: Any, inputs: LayerInputs, i: int,
                     tsp: int) -> None:
        """Cut layer ``i``'s cache to what FastKV keeps of it; the TSP layer first chooses the propagated tokens.
        Without a budget every layer keeps the propagated tokens (those up to the TSP layer cut once it chose
        them); with one, each layer keeps its ``keep`` best per head (positions of the propagated tokens after the
        TSP layer)."""
        if i == tsp:
            call.index = self.propagated_index(inputs, call.propagate)
            session.propagated = call.index
        index = call.index
        if self.budget is None:
            if index is None or i < tsp:
                return
            cut = range(tsp + 1) if i == tsp else [i]
            for j in cut:
                keys, values = (hf.filled_layer_tensors(hf.cache_layers(cache)[j]) if j != i
                                else (inputs.keys, inputs.values))
                session.kept[j] = index.view(1, 1, -1).expand(*keys.shape[:2], -1)
                kept = (keys, values) if i > tsp else (gather_tokens(keys, session.kept[j]),
                                                       gather_tokens(values, session.kept[j]))
                hf.set_cache_layer(cache, j, GrowingLayer.of(*kept))
            return
        idx = self.head_index(inputs, call.keep)  # [b, h_kv, keep] cache indices
        session.kept[i] = index[idx] if i > tsp and index is not None else idx
        hf.set_cache_layer(cache, i, GrowingLayer.of(gather_tokens(inputs.keys, idx),
                                                     gather_tokens(inputs.values, idx)))

    @contextmanager
    def __call__(self, model: hf.HFModule) -> Iterator[FastKVSession]:
        modules, decoder, layers, tsp = self.check_model(model)
        session = FastKVSession(self, tsp)
        block = _Block()

        def start(module: hf.HFModule, args: tuple, kwargs: dict) -> None:
            if not _is_active(block.token):
                return
            shape = propagation.empty_cache_prefill(args, kwargs)
            if shape is None:
                block.set_call(None)
                return
            batch, tokens = shape
            if batch != 1:
                raise PruningError(f"FastKV runs with batch size 1, got {batch}")
            propagate = resolve_budget(self.ratio, tokens)
            keep = propagate if self.budget is None else min(resolve_budget(self.budget, tokens), propagate)
            block.set_call(_Call(tokens, propagate, keep))
            session.kept.clear()
            session.tokens_before, session.propagated = tokens, None

        def finish(module: hf.HFModule, args: tuple, kwargs: dict, output: Any) -> None:
            if block.current() is not None:
                block.set_call(None)

        def prune(module: hf.HFModule, args: tuple, kwargs: dict, output: Any) -> None:
            call = block.current()
            found = _layer_inputs(module, args, kwargs, output) if call is not None else None
            if call is not None and found is not None:
                self._prune_layer(session, call, found[0], found[1], int(module.layer_idx), tsp)

        def propagate(module: hf.HFModule, args: tuple, kwargs: dict, output: Any) -> Any:
            call = block.current()
            if call is None or call.index is None or call.propagate >= call.tokens:
                return None
            hidden = propagation.output_hidden(output)
            return propagation.with_output_hidden(output, hidden.index_select(1, call.index.to(hidden.device)))

        def gather(module: hf.HFModule, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            call = block.current()
            if call is None or call.index is None or call.propagate >= call.tokens:
                return None
            return propagation.gather_call(args, kwargs, call.index, call.tokens, call.memo)

        handles = [decoder.register_forward_pre_hook(start, with_kwargs=True),
                   decoder.register_forward_hook(finish, with_kwargs=True),
                   layers[tsp].register_forward_hook(propagate, with_kwargs=True)]
        handles += [m.register_forward_hook(prune, with_kwargs=True) for m in modules]
        handles += [layer.register_forward_pre_hook(gather, with_kwargs=True) for layer in layers[tsp + 1:]]
        try:
            with _active(block.token):
                yield session
        finally:
            for handle in handles:
                handle.remove()
