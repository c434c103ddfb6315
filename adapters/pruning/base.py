"""The hook plumbing shared by every static pruning method, and the ``PruningMethod`` interface.

A static method scores the context's tokens once, at the end of the prefill, per layer and per KV head, and the
layer's cache keeps the ``budget`` best-scored tokens of each head. It runs as forward hooks on the attention
modules (as NVIDIA kvpress does), so it works with ``model.generate`` in transformers 5.x::

    with SnapKV(budget=0.25)(model):
        out = model.generate(input_ids, max_new_tokens=16)

Why this is correct without ``cache_position`` (gone in recent transformers): ``generate`` tracks
``position_ids`` itself (``position_ids[-1] + 1`` per step), so RoPE positions of new tokens stay absolute after
the cache shrank; the causal mask only needs the cache length, which ``DynamicLayer.get_seq_length`` reports.
The prefill's own output is computed with the full cache (each layer is pruned right after it ran), so the first
generated token is the uncompressed one; every later step sees the pruned cache.

Decode speed: a pruned layer becomes a ``GrowingLayer`` (``layout.py``: in-place appends, no per-step copy of the
whole cache as ``DynamicLayer``'s ``torch.cat`` does), and a method that reads attention weights switches the
model to eager attention for the prefill only: decode steps run with sdpa (the original implementation is back
when the ``with`` block ends).

Shapes: ``b`` batch, ``h_q`` query heads, ``h_kv`` KV heads, ``g = h_q / h_kv`` (GQA group), ``n`` tokens,
``d`` head dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from kvshelf.adapters import hf
from kvshelf.adapters.pruning.budget import check_budget, resolve_budget
from kvshelf.adapters.pruning.errors import AttentionImplementationError, UnsupportedArchitectureError
from kvshelf.adapters.pruning.layout import GrowingLayer, cache_bytes, growing_cache
from kvshelf.kvstore.errors import UnsupportedModelError
from kvshelf.reuse.rope import apply_rope

_ATTN_WEIGHT_IMPLEMENTATIONS = ("eager",)


@dataclass
class LayerInputs:
    """What a scoring method sees for one attention layer at the end of the prefill.

    Attributes:
        module: the attention module (``q_proj``, ``head_dim``, ``num_key_value_groups``...).
        hidden_states: ``[b, n, hidden]``, the layer's (normed) input.
        keys, values: ``[b, h_kv, n, d]``, the layer's cache (RoPE applied to keys).
        position_embeddings: ``(cos, sin)``, each ``[b, n, d]``.
        attentions: ``[b, h_q, n, n]`` prefill attention weights, or ``None`` when the implementation returns none.
    """

    module: nn.Module
    hidden_states: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attentions: torch.Tensor | None = None

    @property
    def groups(self) -> int:
        return int(self.module.num_key_value_groups)

    @property
    def tokens(self) -> int:
        return int(self.keys.shape[2])

    def queries(self, last: int) -> torch.Tensor:
        """The last ``last`` tokens' queries, recomputed with RoPE: ``[b, h_q, last, d]``."""
        q = hf.project_queries(self.module, self.hidden_states[:, -last:])  # [b, h_q, last, d], before RoPE
        cos, sin = (t[:, -last:].unsqueeze(1).to(q.dtype) for t in self.position_embeddings)  # [b, 1, last, d]
        return apply_rope(q, cos, sin)

    def to_kv_heads(self, per_query_head: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
        """``[b, h_q, ...]`` -> ``[b, h_kv, ...]``: mean (or sum) over each GQA group."""
        b, h_q = per_query_head.shape[:2]
        grouped = per_query_head.reshape(b, h_q // self.groups, self.groups, *per_query_head.shape[2:])
        return grouped.sum(2) if reduce == "sum" else grouped.mean(2)


def recent_bonus(scores: torch.Tensor, recent: int, sinks: int = 0) -> torch.Tensor:
    """``scores [b, h, n]`` with the last ``recent`` and first ``sinks`` tokens forced to be kept (+inf)."""
    out = scores.clone()
    if recent > 0:
        out[..., -recent:] = float("inf")
    if sinks > 0:
        out[..., :sinks] = float("inf")
    return out


def select(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices ``[b, h_kv, keep]`` (ascending positions) of the ``keep`` best tokens of ``scores [b, h_kv, n]``.

    Ties (e.g. several +inf) break towards later positions, deterministically.
    """
    n = scores.shape[-1]
    tie = torch.arange(n, device=scores.device, dtype=torch.float32) * 1e-7 / max(n, 1)
    idx = torch.topk(scores.float() + tie, keep, dim=-1).indices
    return idx.sort(dim=-1).values


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [b, h_kv, n, d]`` at ``idx [b, h_kv, k]`` -> ``[b, h_kv, k, d]``."""
    return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's attention modules, in layer order; ``UnsupportedArchitectureError`` if it has none we can hook."""
    from kvshelf.adapters.cache_bridge import check_supported

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise UnsupportedArchitectureError(
            f"token pruning supports Llama-style HF decoders; {type(model).__name__} has no transformers config"
        )
    try:
        check_supported(config)
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(f"token pruning does not support this model: {exc}") from exc
    try:
        return hf.attention_modules(model)
    except UnsupportedModelError as exc:
        raise UnsupportedArchitectureError(
            f"token pruning supports Llama-style decoders (model.model.layers[i].self_attn with q_proj/k_proj, "
            f"GQA and RoPE); {type(model).__name__} ({model.config.model_type!r}) is not one"
        ) from exc


def check_attn_implementation(model: nn.Module, method: str) -> None:
    impl = hf.attn_implementation(model)
    if impl not in _ATTN_WEIGHT_IMPLEMENTATIONS:
        raise AttentionImplementationError(
            f"{method} needs the prefill's attention weights, which attn_implementation={impl!r} does not return; "
            f'load the model with attn_implementation="eager" (or call model.set_attn_implementation("eager"))'
        )


@dataclass
class PruningMethod:
    """A static method: score the prefill's tokens per KV head, keep ``budget`` of them in every layer's cache.

    Args:
        budget: a ratio of the prefill's tokens in ``(0, 1]`` (float) or a token count (int).

    Subclasses implement ``score`` (and set ``needs_attentions`` when they read attention weights). Using a
    method as ``with method(model): ...`` hooks the model; the yielded ``PruningSession`` records the kept
    indices per layer.
    """

    budget: float | int = 0.5
    needs_attentions: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_budget(self.budget)

    @property
    def name(self) -> str:
        return type(self).__name__

    def base_score(self, layer: LayerInputs) -> torch.Tensor:
        """``[b, h_kv, n]``: the budget-independent part of ``score`` (what ``scoring`` shares across budgets)."""
        raise NotImplementedError

    def score(self, layer: LayerInputs, keep: int) -> torch.Tensor:
        """``[b, h_kv, n]``: higher is kept first. ``keep`` is the number of tokens that will be kept."""
        return self.finish(self.base_score(layer), keep)

    def finish(self, base: torch.Tensor, keep: int) -> torch.Tensor:
        """The budget-dependent part: ``base [b, h_kv, n]`` -> scores (e.g. force a recent window)."""
        return base

    def select_from(self, layer: LayerInputs, base: torch.Tensor) -> torch.Tensor:
        """Like ``keep_indices`` but from a precomputed ``base_score``."""
        keep = resolve_budget(self.budget, layer.tokens)
        if keep >= layer.tokens:
            return torch.arange(layer.tokens, device=layer.keys.device).expand(*layer.keys.shape[:2], -1)
        return select(self.finish(base, keep), keep)

    def scoring_key(self) -> str:
        """Methods with equal keys share ``base_score`` (all fields but the budget)."""
        return repr(replace(self, budget=1.0))

    def keep_indices(self, layer: LayerInputs) -> torch.Tensor:
        """``[b, h_kv, k]`` kept token indices (ascending) for this layer."""
        keep = resolve_budget(self.budget, layer.tokens)
        if keep >= layer.tokens:
            b, h = layer.keys.shape[:2]
            return torch.arange(layer.tokens, device=layer.keys.device).expand(b, h, -1)
        return select(self.score(layer, keep), keep)

    def check_model(self, model: nn.Module) -> list[nn.Module]:
        modules = attention_modules(model)
        if self.needs_attentions:
            check_attn_implementation(model, self.name)
        return modules

    def __call__(self, model: nn.Module) -> Any:
        return hooked(model, self)


@dataclass
class PruningSession:
    """What a hooked prefill did: per layer, the kept indices ``[b, h_kv, k]`` and the tokens before pruning."""

    method: PruningMethod
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens_before: int = 0

    def kv_bytes(self, cache: Any) -> int:
        """Bytes of keys and values a (pruned) cache takes now (a ``GrowingLayer``'s headroom included)."""
        return cache_bytes(cache)


def _layer_inputs(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple[Any, LayerInputs] | None:
    """The cache and the layer's ``LayerInputs`` when this call is a prefill of an empty cache, else ``None``."""
    hidden, cache, embeddings = hf.attention_hook_inputs(args, kwargs)
    if cache is None or hidden is None:
        return None
    tensors = hf.layer_tensors(hf.cache_layers(cache)[module.layer_idx])
    if tensors is None or tensors[0].shape[2] != hidden.shape[1]:
        return None  # a decode step, or a continuation of an already filled cache
    attentions = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    return cache, LayerInputs(module, hidden, *tensors, embeddings, attentions)


@contextmanager
def eager_prefill(model: nn.Module) -> Iterator[None]:
    """Eager attention for prefills of an empty cache (they must return attention weights), sdpa for decode steps.

    A forward pre-hook on ``model`` switches ``config._attn_implementation`` between ``"eager"`` and ``"sdpa"``
    only (any other implementation, e.g. TokenSelect's, is left alone), and puts ``"eager"`` back on exit if it
    switched. A model without sdpa support keeps eager throughout.
    """
    if not hf.supports_sdpa(model):
        yield
        return
    switched = False

    def switch(module: nn.Module, args: tuple, kwargs: dict) -> None:
        nonlocal switched
        cache = kwargs.get("past_key_values")
        prefill = cache is None or cache.get_seq_length() == 0
        impl = hf.attn_implementation(model)
        if prefill and switched and impl == "sdpa":
            hf.switch_attention(model, "eager")
            switched = False
        elif not prefill and impl == "eager":
            hf.switch_attention(model, "sdpa")
            switched = True

    handle = model.register_forward_pre_hook(switch, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        if switched and hf.attn_implementation(model) == "sdpa":
            hf.switch_attention(model, "eager")


@contextmanager
def hooked(model: nn.Module, method: PruningMethod) -> Iterator[PruningSession]:
    """Hook ``model`` so that every prefill of an empty cache is pruned by ``method``; yields the session."""
    modules = method.check_model(model)
    session = PruningSession(method)

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        found = _layer_inputs(module, args, kwargs, output)
        if found is None:
            return
        cache, inputs = found
        if method.needs_attentions and inputs.attentions is None:
            check_attn_implementation(model, method.name)
            raise AttentionImplementationError(f"{method.name} got no attention weights from the model")
        idx = method.keep_indices(inputs)
        session.tokens_before = inputs.tokens
        session.kept[module.layer_idx] = idx
        hf.set_cache_layer(cache, module.layer_idx, GrowingLayer.of(gather_tokens(inputs.keys, idx),
                                                                    gather_tokens(inputs.values, idx)))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        with eager_prefill(model) if method.needs_attentions else nullcontext():
            yield session
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def scoring(model: nn.Module, methods: dict[str, PruningMethod]) -> Iterator[dict[str, dict[int, torch.Tensor]]]:
    """Score one prefill with several methods at once, pruning nothing: yields ``{name: {layer: idx [b,h_kv,k]}}``.

    The prefill's computation does not depend on pruning (each layer is pruned after it ran), so one prefill
    can serve every method; ``prune_cache`` then builds each method's cache. Used by ``bench/pruning.py``.
    """
    modules = attention_modules(model)
    for method in methods.values():
        if method.needs_attentions:
            check_attn_implementation(model, method.name)
    kept: dict[str, dict[int, torch.Tensor]] = {name: {} for name in methods}

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        found = _layer_inputs(module, args, kwargs, output)
        if found is None:
            return
        shared: dict[str, torch.Tensor] = {}
        for name, method in methods.items():
            key = method.scoring_key()
            if key not in shared:
                shared[key] = method.base_score(found[1])
            kept[name][module.layer_idx] = method.select_from(found[1], shared[key])

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()


def prune_cache(cache: Any, kept: dict[int, torch.Tensor]) -> Any:
    """A new ``DynamicCache`` holding, per layer, only the tokens ``kept[layer] [b, h_kv, k]`` of ``cache``.

    Its layers are ``GrowingLayer`` s (in-place decode appends), as in a cache pruned by ``with method(model):``.
    """
    return growing_cache([(gather_tokens(keys, kept[i]), gather_tokens(values, kept[i]))
                          for i, (keys, values) in enumerate(hf.cache_tensors(cache))])
