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

Threads: a ``with method(model):`` block acts only on the calls of the context (thread) that entered it. Its hooks
are no-ops elsewhere, and the eager/sdpa switch is per context (``hf.attention_scope``), never a switch of the
model for every thread; several threads may each run their own method (or none) on one model at the same time.
Work handed to a worker thread must run in a copy of the caller's context (``contextvars.copy_context().run``,
as ``adapters.streaming`` does) to be pruned. Static methods hold no state of their own (each block has its own
``PruningSession``), so one method object may serve several threads.

Model families: a method hooks the self-attention modules of any layout ``adapters.hf`` knows (Llama-style,
GPT-NeoX, Falcon, GPT-2) and prunes the full-attention layers only: a sliding-window layer's cache is bounded by
its window already, and HF's sliding cache layer keeps only the window's last tokens, so pruning it (or turning it
into a full layer) would change what the window sees; a model without any full-attention layer (Mistral with its
``sliding_window``) is refused. Methods that recompute queries (SnapKV) follow the model's own query path
(``hf.attention_queries``: projection, q norm placement, partial or interleaved RoPE) and its logit scaling and
soft cap. What a method cannot do on a model raises ``UnsupportedArchitectureError`` naming the method, the
family (``model_type``) and the feature, when the ``with`` block is entered, before any work.

Shapes: ``b`` batch, ``h_q`` query heads, ``h_kv`` KV heads (the cache's heads), ``g = h_q / h_kv`` (GQA group),
``n`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from kvshelf.adapters import hf
from kvshelf.adapters.pruning.budget import check_budget, resolve_budget
from kvshelf.adapters.pruning.errors import AttentionImplementationError, UnsupportedArchitectureError
from kvshelf.adapters.pruning.layout import GrowingLayer, cache_bytes
from kvshelf.kvstore.errors import UnsupportedModelError

_ATTN_WEIGHT_IMPLEMENTATIONS = ("eager",)
#: the largest row chunk of attention weights ``LayerInputs.attention_mass`` holds at once (float32 bytes)
ATTENTION_CHUNK_BYTES = 16 * 2**20


def _rows(embeddings: tuple[torch.Tensor, torch.Tensor] | None, lo: int, hi: int
          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if embeddings is None else (embeddings[0][:, lo:hi], embeddings[1][:, lo:hi])


@dataclass
class LayerInputs:
    """What a scoring method sees for one attention layer at the end of the prefill.

    Attributes:
        module: the attention module (any layout ``adapters.hf`` knows).
        hidden_states: ``[b, n, hidden]``, the layer's (normed) input.
        keys, values: ``[b, h_kv, n, d]``, the layer's cache (RoPE applied to keys).
        position_embeddings: ``(cos, sin)``, each ``[b, n, rotary_dim]``, or ``None`` (no RoPE: GPT-2).
        attentions: ``[b, h_q, n, n]`` prefill attention weights, or ``None`` when the implementation returns none.
    """

    module: hf.HFModule
    hidden_states: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    attentions: torch.Tensor | None = None

    @property
    def kv_heads(self) -> int:
        return int(self.keys.shape[1])

    @property
    def scaling(self) -> float:
        """The factor the model multiplies ``q @ k^T`` by (``1 / sqrt(d)``, Granite's multiplier, Gemma's...)."""
        return hf.attention_scaling(self.module)

    def logits(self, queries: torch.Tensor, keys: int | None = None) -> torch.Tensor:
        """The model's attention logits of ``queries`` ``[b, h_q, q, d]`` over the (first ``keys``) keys:
        ``[b, h_q, q, n]`` float32 (scaled, soft-capped where the model caps them; no mask)."""
        cached = self.keys if keys is None else self.keys[:, :, :keys]
        expanded = cached.float().repeat_interleave(queries.shape[1] // self.kv_heads, dim=1)  # [b, h_q, n, d]
        logits = queries.float() @ expanded.transpose(2, 3) * self.scaling
        cap = hf.attention_softcap(self.module)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def tokens(self) -> int:
        return int(self.keys.shape[2])

    def attention_mass(self, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The prefill's causal attention weights summed over queries: ``[b, h_q, n]`` (H2O's accumulated attention),
        each row first passed through ``transform`` (``[b, h_q, c, m]`` row chunk -> the same shape; Keyformer's
        Gumbel noise) when given.

        Computed over row chunks of at most ``ATTENTION_CHUNK_BYTES``, in order, from the eager ``attentions`` when
        the layer returned them, else from the queries recomputed along the model's own path (``queries_rows``):
        the prefill runs sdpa and no ``[b, h_q, n, n]`` tensor is ever built. Row ``i`` sees keys ``0..i`` only, so
        a chunk of rows ``lo..hi`` is computed over its first ``hi`` keys (``m = hi``)."""
        b, n = self.keys.shape[0], self.tokens
        h_q = self.attentions.shape[1] if self.attentions is not None else None
        if h_q is None:
            h_q = hf.attention_queries(self.module, self.hidden_states[:, :1], _rows(self.position_embeddings, 0, 1)
                                       ).shape[1]
        rows = max(1, ATTENTION_CHUNK_BYTES // (4 * b * h_q * n))
        mass = torch.zeros(b, h_q, n, dtype=torch.float32, device=self.keys.device)
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            if self.attentions is not None:
                probs = self.attentions[:, :, lo:hi, :hi].float()
            else:
                logits = self.logits(self.queries_rows(lo, hi), keys=hi)  # [b, h_q, c, hi]
                causal = torch.ones(hi - lo, hi, dtype=torch.bool, device=logits.device).triu(lo + 1)
                probs = torch.softmax(logits.masked_fill_(causal, float("-inf")), dim=-1)
            if transform is not None:
                probs = transform(probs)
            mass[:, :, :hi] += probs.sum(dim=2)
        return mass

    def queries_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Queries of tokens ``lo..hi`` as the model computes them: ``[b, h_q, hi - lo, d]``."""
        return hf.attention_queries(self.module, self.hidden_states[:, lo:hi], _rows(self.position_embeddings, lo, hi))

    def queries(self, last: int) -> torch.Tensor:
        """The last ``last`` tokens' queries as the model computes them (its q path and RoPE): ``[b, h_q, last, d]``."""
        return self.queries_rows(self.tokens - last, self.tokens)

    def to_kv_heads(self, per_query_head: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
        """``[b, h_q, ...]`` -> ``[b, h_kv, ...]``: mean (or sum) over each GQA group."""
        b, h_q = per_query_head.shape[:2]
        groups = h_q // self.kv_heads
        grouped = per_query_head.reshape(b, self.kv_heads, groups, *per_query_head.shape[2:])
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


def refusal(method: str, model: hf.HFModule, feature: str) -> UnsupportedArchitectureError:
    """The error refusing ``method`` on ``model``: names the method, the family (``model_type``) and the feature."""
    return UnsupportedArchitectureError(f"{method} does not support model type {hf.model_type(model)!r}: {feature}")


def attention_modules(model: hf.HFModule, method: str = "token pruning", *, queries: bool = False,
                      interface: bool = False) -> list[hf.HFModule]:
    """The self-attention modules of the model's full-attention layers (the ones a method prunes or selects in),
    in layer order, after checking everything the method needs; ``UnsupportedArchitectureError`` naming
    ``method``, the family and the feature otherwise (before any work).

    Args:
        queries: the method recomputes queries (``LayerInputs.queries``): the query path must be one
            ``hf.attention_queries`` knows.
        interface: the method runs as a registered attention function: the model's attention must call
            transformers' attention interface.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise UnsupportedArchitectureError(
            f"{method} supports HF decoder LMs (Llama-style, GPT-NeoX, Falcon, GPT-2 layouts); "
            f"{type(model).__name__} has no transformers config"
        )
    text = config.get_text_config(decoder=True)
    if getattr(text, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise refusal(method, model, "encoder-decoder models are not supported (decoder-only LMs)")
    types = hf.attention_layer_types(config)
    # a hybrid model: its recurrent-state layers are left as they are, its full-attention layers pruned
    states = sorted(set(types) & {"linear_attention", "conv", "hybrid"})
    try:
        modules = hf.self_attention_modules(model, some=bool(states))
    except UnsupportedModelError as exc:
        beside = f" beside its layers of types {states}, which keep a recurrent state" if states else ""
        raise refusal(method, model, f"no attention modules kvshelf can hook{beside} ({exc})") from exc
    problem = hf.absolute_position_problem(model)
    if problem is not None:
        raise refusal(method, model, problem)
    if states:
        if any(not 0 <= m.layer_idx < len(types) or types[m.layer_idx] in states for m in modules):
            raise refusal(method, model, f"its attention modules do not map to its attention layers (layers of types "
                                         f"{states} keep a recurrent state)")
    elif len(types) != len(modules):
        raise refusal(method, model, f"{len(types)} layer types for {len(modules)} attention layers")
    full = [m for m in modules if types[m.layer_idx] == hf.FULL_ATTENTION]
    if not full:
        raise refusal(method, model, f"every attention layer is {'/'.join(sorted(set(types)))} (sliding-window "
                                     f"attention, window {getattr(text, 'sliding_window', None)}): {method} prunes "
                                     "full-attention layers only, and a sliding layer's cache is bounded by its window")
    for module in full:
        try:
            if queries:
                hf.query_path(module)
            hf.attention_scaling(module)
        except UnsupportedModelError as exc:
            raise refusal(method, model, f"its queries cannot be recomputed exactly ({exc})") from exc
        if interface and not hf.uses_attention_interface(module):
            raise refusal(method, model, f"its attention ({type(module).__name__}) does not call transformers' "
                                         "attention interface, where a selection method runs")
    return full


def check_attn_implementation(model: hf.HFModule, method: str) -> None:
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

    Subclasses implement ``score`` (and set ``needs_attentions`` when they read attention weights,
    ``recomputes_queries`` when they call ``LayerInputs.queries``). Using a
    method as ``with method(model): ...`` hooks the model; the yielded ``PruningSession`` records the kept
    indices per layer.
    """

    budget: float | int = 0.5
    needs_attentions: ClassVar[bool] = False
    #: whether ``score`` recomputes queries (``LayerInputs.queries``): checked against the model's query path
    recomputes_queries: ClassVar[bool] = False
    #: whether ``score`` reads ``LayerInputs.attention_mass``: from recomputed queries where the model's query path
    #: allows (any attention implementation), else from eager attention weights (``needs_attention_weights``)
    attention_mass: ClassVar[bool] = False

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

    def check_model(self, model: hf.HFModule) -> list[hf.HFModule]:
        """The attention modules to hook; refuses (``UnsupportedArchitectureError``) what the method cannot do."""
        modules = attention_modules(model, self.name, queries=self.recomputes_queries)
        if needs_attention_weights(self, model):
            check_attn_implementation(model, self.name)
        return modules

    def __call__(self, model: hf.HFModule) -> Any:
        return hooked(model, self)


def queries_recomputable(model: hf.HFModule) -> bool:
    """Whether every full-attention layer's queries can be recomputed exactly (``LayerInputs.queries_rows``)."""
    try:
        attention_modules(model, queries=True)
    except UnsupportedArchitectureError:
        return False
    return True


def needs_attention_weights(method: PruningMethod, model: hf.HFModule) -> bool:
    """Whether ``method`` needs the prefill's eager attention weights on ``model``: it reads them itself
    (``needs_attentions``), or it reads ``attention_mass`` on a model whose queries cannot be recomputed (MLA,
    complex-pair RoPE): then the prefill runs eager."""
    return method.needs_attentions or (method.attention_mass and not queries_recomputable(model))


@dataclass
class PruningSession:
    """What a hooked prefill did: per layer, the kept indices ``[b, h_kv, k]`` and the tokens before pruning."""

    method: PruningMethod
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens_before: int = 0

    def kv_bytes(self, cache: Any) -> int:
        """Bytes of keys and values a (pruned) cache takes now (a ``GrowingLayer``'s headroom included)."""
        return cache_bytes(cache)


def _layer_inputs(module: hf.HFModule, args: tuple, kwargs: dict, output: Any) -> tuple[Any, LayerInputs] | None:
    """The cache and the layer's ``LayerInputs`` when this call is a prefill of an empty cache, else ``None``."""
    hidden, cache, embeddings = hf.attention_hook_inputs(args, kwargs)
    if cache is None or hidden is None:
        return None
    tensors = hf.layer_tensors(hf.cache_layers(cache)[module.layer_idx])
    if tensors is None or tensors[0].shape[2] != hidden.shape[1]:
        return None  # a decode step, or a continuation of an already filled cache
    attentions = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    return cache, LayerInputs(module, hidden, *tensors, embeddings, attentions)


#: the ``with method(model):`` blocks active in this context (thread): each block's hooks act only where it is
_ACTIVE: ContextVar[frozenset[object]] = ContextVar("kvshelf_pruning_blocks", default=frozenset())


@contextmanager
def _active(block: object) -> Iterator[None]:
    """Mark ``block`` active in the current context for the duration (contexts copied from it see it too)."""
    token = _ACTIVE.set(_ACTIVE.get() | {block})
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _is_active(block: object) -> bool:
    return block in _ACTIVE.get()


@contextmanager
def eager_prefill(model: hf.HFModule, block: object) -> Iterator[None]:
    """Eager attention for prefills of an empty cache (they must return attention weights), sdpa for decode steps,
    in the contexts where ``block`` is active only (the calls of the thread that entered the ``with`` block).

    A forward pre-hook on ``model`` switches between ``"eager"`` and ``"sdpa"`` only (any other implementation, e.g.
    TokenSelect's, is left alone) with ``hf.switch_attention`` inside an ``hf.attention_scope``: for the calling
    context only, so another thread using the model at the same time keeps its own attention; the block's exit
    puts back what the context had. A model without sdpa support (or whose implementation cannot be switched:
    Falcon) keeps eager throughout.
    """
    if not hf.supports_sdpa(model) or not hf.can_switch_attention(model):
        yield
        return

    def switch(module: hf.HFModule, args: tuple, kwargs: dict) -> None:
        if not _is_active(block):
            return
        cache = kwargs.get("past_key_values")
        prefill = cache is None or cache.get_seq_length() == 0
        impl = hf.attn_implementation(model)
        if prefill and impl == "sdpa":
            hf.switch_attention(model, "eager")
        elif not prefill and impl == "eager":
            hf.switch_attention(model, "sdpa")

    with hf.attention_scope(model):
        handle = model.register_forward_pre_hook(switch, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


@contextmanager
def hooked(model: hf.HFModule, method: PruningMethod) -> Iterator[PruningSession]:
    """Hook ``model`` so that every prefill of an empty cache is pruned by ``method``; yields the session.

    The hooks act only on calls made in the context (thread) that entered the block, or in contexts copied from
    it (``contextvars.copy_context``): other threads using the model meanwhile are neither pruned nor switched to
    eager, and blocks of different threads (each with its own method) prune only their own calls. Each block
    removes only its own hooks, whatever order blocks exit in."""
    modules = method.check_model(model)
    weights = needs_attention_weights(method, model)
    session = PruningSession(method)
    block = object()

    def hook(module: hf.HFModule, args: tuple, kwargs: dict, output: Any) -> None:
        if not _is_active(block):
            return
        found = _layer_inputs(module, args, kwargs, output)
        if found is None:
            return
        cache, inputs = found
        if weights and inputs.attentions is None:
            check_attn_implementation(model, method.name)
            raise AttentionImplementationError(f"{method.name} got no attention weights from the model")
        idx = method.keep_indices(inputs)
        session.tokens_before = inputs.tokens
        session.kept[module.layer_idx] = idx
        hf.set_cache_layer(cache, module.layer_idx, GrowingLayer.of(gather_tokens(inputs.keys, idx),
                                                                    gather_tokens(inputs.values, idx)))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        with _active(block), eager_prefill(model, block) if weights else nullcontext():
            yield session
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def scoring(model: hf.HFModule, methods: dict[str, PruningMethod]) -> Iterator[dict[str, dict[int, torch.Tensor]]]:
    """Score one prefill with several methods at once, pruning nothing: yields ``{name: {layer: idx [b,h_kv,k]}}``.

    The prefill's computation does not depend on pruning (each layer is pruned after it ran), so one prefill
    can serve every method; ``prune_cache`` then builds each method's cache. Used by ``bench/pruning.py``.
    """
    modules = attention_modules(model, "+".join(m.name for m in methods.values()),
                                queries=any(m.recomputes_queries for m in methods.values()))
    for method in methods.values():
        if needs_attention_weights(method, model):
            check_attn_implementation(model, method.name)
    kept: dict[str, dict[int, torch.Tensor]] = {name: {} for name in methods}
    block = object()

    def hook(module: hf.HFModule, args: tuple, kwargs: dict, output: Any) -> None:
        if not _is_active(block):
            return
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
        with _active(block):
            yield kept
    finally:
        for handle in handles:
            handle.remove()


def prune_cache(cache: Any, kept: dict[int, torch.Tensor]) -> Any:
    """A new ``DynamicCache`` holding, per layer, only the tokens ``kept[layer] [b, h_kv, k]`` of ``cache``.

    Pruned layers are ``GrowingLayer`` s (in-place decode appends), as in a cache pruned by ``with method(model):``;
    a layer without an entry in ``kept`` (a sliding-window layer, which methods do not prune) is copied as it is.
    """
    layers = []
    for i, layer in enumerate(hf.cache_layers(cache)):
        if i in kept:
            keys, values = hf.filled_layer_tensors(layer)
            layers.append(GrowingLayer.of(gather_tokens(keys, kept[i]), gather_tokens(values, kept[i])))
        else:
            layers.append(copy.deepcopy(layer))
    return hf.cache_of_layers(layers)
