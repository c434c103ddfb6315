"""TokenSelect: dynamic per-head top-k of the cached tokens at each decode step, with a selection cache.

Wu et al., "TokenSelect: Efficient Long-Context Inference and Length Extrapolation for LLMs via Dynamic
Token-Level KV Cache Selection" (2024). The cache stays whole (it may live on a lower tier); each query attends
only to the ``budget`` tokens each KV head scores highest by a per-head soft vote (softmax of every query head's
logits, summed over its GQA group). Consecutive decode queries are similar, so a selection is reused while the
cosine similarity of the new query to the one that made it stays >= ``similarity`` (the "selection cache").

How it hooks transformers 5.x: a custom attention function registered in ``AttentionInterface`` (plus the
sdpa mask in ``AttentionMaskInterface``) under ``kvshelf_tokenselect``; ``with TokenSelect(...)(model):``
switches the model to it and back for the calling context only (``hf.attention_implementation``: other threads
using the model keep their attention), and the method each attention module selects with is found in a
``ContextVar``, not on the module. A ``TokenSelect`` object holds its selection cache: one per thread.
The prefill of an empty cache runs as plain sdpa (full attention);
afterwards a single query gathers its selection, and a chunk of queries (teacher forcing) masks per query to
the top-k of the earlier cache plus its causal part of the chunk.

Model families: it selects in full-attention layers only (a sliding-window layer attends to its window as usual:
its cache is bounded already), and refuses (``UnsupportedArchitectureError``, when the ``with`` block is entered)
models whose attention does not go through transformers' attention interface (Falcon) and models without any
full-attention layer (Mistral with its window). Soft-capped attention logits (Gemma 2) are capped in the vote and
the attention, and its full-attention fallback is then the eager formula (sdpa does not cap).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from kvshelf.adapters import hf
from kvshelf.adapters.pruning.base import attention_modules, gather_tokens
from kvshelf.adapters.pruning.budget import check_budget, resolve_budget
from kvshelf.adapters.pruning.errors import PruningError

IMPLEMENTATION = "kvshelf_tokenselect"
#: per attention module (by ``id``), in the context that entered a ``with TokenSelect(...)(model):`` block: the
#: method selecting in it (``None``: a layer it does not select in) and the implementation the model ran with
#: before ("sdpa", "eager"), for full attention
_SELECTING: ContextVar[dict[int, tuple[TokenSelect | None, str]] | None] = ContextVar("kvshelf_tokenselect",
                                                                                       default=None)


@dataclass
class _LayerState:
    query: torch.Tensor | None = None  # [b, h_q, d] query that made the selection
    ranked: torch.Tensor | None = None  # [b, h_kv, k] selected indices, best first
    tokens: int = 0  # cache length when it was made


@dataclass
class TokenSelect:
    """Dynamic selection. ``budget``: ratio of the cached tokens (or a token count) each head attends per query.

    Attributes after a run: ``steps`` decode steps seen, ``reused`` of them served from the selection cache.
    """

    budget: float | int = 0.125
    similarity: float = 0.9
    steps: int = 0
    reused: int = 0
    layers: dict[int, _LayerState] = field(default_factory=dict)
    first_layer: int = 0  # the first layer it selects in (counts ``steps`` and ``reused``)

    def __post_init__(self) -> None:
        check_budget(self.budget)

    @property
    def name(self) -> str:
        return "TokenSelect"

    def keep(self, past: int) -> int:
        """Tokens attended out of ``past`` cached ones (a count larger than the cache raises ``BudgetError``)."""
        return resolve_budget(self.budget, past)

    def vote(self, module: hf.HFModule, query: torch.Tensor, key: torch.Tensor, scaling: float,
             softcap: float | None = None) -> torch.Tensor:
        """Per-head soft vote: ``query [b, h_q, q, d]``, ``key [b, h_kv, n, d]`` -> ``[b, h_kv, q, n]``."""
        g = query.shape[1] // key.shape[1]
        probs = torch.softmax(_logits(query, key, scaling, softcap), dim=-1)
        b, h_q, q, n = probs.shape
        return probs.view(b, h_q // g, g, q, n).sum(2)

    def decode(self, module: hf.HFModule, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """One query ``[b, h_q, 1, d]`` over its selection: returns ``[b, 1, h_q, d_v]`` (``value``'s head dim)."""
        n = key.shape[2]
        k = self.keep(n)
        state = self.layers.setdefault(int(module.layer_idx), _LayerState())
        q = query[:, :, 0]
        fresh = n - state.tokens
        reuse = (
            state.query is not None and state.ranked is not None and 0 < fresh < k
            and float(torch.cosine_similarity(q.float(), state.query.float(), dim=-1).min()) >= self.similarity
        )
        if reuse and state.ranked is not None:  # the newest tokens, then the best of the earlier selection
            b, h_kv = key.shape[:2]
            new = torch.arange(state.tokens, n, device=key.device).expand(b, h_kv, -1)
            idx = torch.cat([new, state.ranked[..., : k - fresh]], dim=-1)
            if int(module.layer_idx) == self.first_layer:
                self.reused += 1
        else:
            votes = self.vote(module, query, key, scaling, softcap)[:, :, 0]  # [b, h_kv, n]
            votes[..., -1] = float("inf")  # the current token always sees itself
            idx = torch.topk(votes, k, dim=-1).indices
            state.query, state.ranked, state.tokens = q, idx, n
        if int(module.layer_idx) == self.first_layer:
            self.steps += 1
        ks, vs = gather_tokens(key, idx), gather_tokens(value, idx)
        g = query.shape[1] // key.shape[1]
        b, h_q, _, d = query.shape
        qg = query.view(b, h_q // g, g, d)
        weights = torch.softmax(_logits(qg, ks, scaling, softcap), dim=-1)
        out = (weights @ vs.float()).to(query.dtype)  # [b, h_kv, g, d_v] (MLA: values' head dim differs from d)
        return out.reshape(b, h_q, 1, vs.shape[-1]).transpose(1, 2)

    def chunk(self, module: hf.HFModule, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scaling: float, softcap: float | None = None) -> torch.Tensor:
        """``q`` queries after a cache of ``n - q``: each attends to the top-k of the earlier cache (its own vote)
        plus the chunk causally. Returns ``[b, q, h_q, d]``."""
        n, q = key.shape[2], query.shape[2]
        past = n - q
        k = min(self.keep(past), past)
        votes = self.vote(module, query, key[:, :, :past], scaling, softcap)  # [b, h_kv, q, past]
        chosen = torch.zeros_like(votes, dtype=torch.bool).scatter_(-1, torch.topk(votes, k, dim=-1).indices, True)
        causal = torch.ones(q, q, dtype=torch.bool, device=key.device).tril()
        allowed = torch.cat([chosen, causal.expand(*chosen.shape[:3], q)], dim=-1)  # [b, h_kv, q, n]
        g = query.shape[1] // key.shape[1]
        logits = _logits(query, key, scaling, softcap)
        logits = logits.masked_fill(~allowed.repeat_interleave(g, dim=1), float("-inf"))
        out = torch.softmax(logits, dim=-1) @ value.float().repeat_interleave(g, dim=1)
        return out.to(query.dtype).transpose(1, 2)

    @contextmanager
    def __call__(self, model: hf.HFModule) -> Iterator[TokenSelect]:
        modules = attention_modules(model, self.name, interface=True)  # full-attention layers only
        register()
        every = hf.self_attention_modules(model, some=True)  # a hybrid's state layers have none
        with hf.attention_implementation(model, IMPLEMENTATION) as previous:
            self.first_layer = min(int(m.layer_idx) for m in modules)
            selecting = dict(_SELECTING.get() or {})
            # full attention (a prefill, a sliding layer) as the model ran it before
            selecting.update({id(m): (None, previous) for m in every})
            selecting.update({id(m): (self, previous) for m in modules})
            self.layers.clear()
            token = _SELECTING.set(selecting)
            try:
                yield self
            finally:
                _SELECTING.reset(token)


def _logits(query: torch.Tensor, key: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """``query [b, h_q, q, d]`` x ``key [b, h_kv, n, d]`` -> float32 logits ``[b, h_q, q, n]``, scaled and (Gemma 2)
    soft-capped as the model's own attention does."""
    g = query.shape[1] // key.shape[1]
    logits = (query.float() @ key.float().repeat_interleave(g, dim=1).transpose(2, 3)) * scaling
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _full_attention(module: hf.HFModule, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None, softcap: float | None,
                    fallback: str, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over the whole cache, as the model computes it without TokenSelect: sdpa, or the model's own eager
    function when it ran eager before (the same numbers in bf16) or caps its logits (Gemma 2; sdpa does not), under
    the sdpa-style mask turned additive (``[b, 1, q, n]`` bool, ``True`` = attend; ``None`` = causal, the queries
    being the last ``q`` positions). Returns ``([b, q, h_q, d], None)``."""
    if softcap is None and fallback != "eager":
        return hf.sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    q, n = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(q, n, dtype=torch.bool, device=query.device).tril(n - q)
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    extra = {"softcap": softcap} if softcap is not None else {}
    kwargs.pop("dropout", None)
    out, _ = hf.eager_attention_function(module)(module, query, key, value, attention_mask, scaling=scaling,
                                                 dropout=0.0, **extra, **kwargs)
    return out, None


def tokenselect_attention(module: hf.HFModule, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None,
                          softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``query [b, h_q, q, d]``, ``key/value [b, h_kv, n, d]`` (whole cache)."""
    method, fallback = (_SELECTING.get() or {}).get(id(module), (None, "sdpa"))
    q, n = query.shape[2], key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if method is not None and query.shape[0] != 1:
        raise PruningError(f"TokenSelect runs with batch size 1, got {query.shape[0]}")
    if method is None or q >= n:
        if method is not None:  # a new prefill: selections of an earlier prompt are stale
            method.layers.pop(int(module.layer_idx), None)
        return _full_attention(module, query, key, value, attention_mask, scaling, softcap, fallback, **kwargs)
    if q == 1:
        if method.keep(n) >= n:
            return _full_attention(module, query, key, value, attention_mask, scaling, softcap, fallback, **kwargs)
        return method.decode(module, query, key, value, scale, softcap), None
    return method.chunk(module, query, key, value, scale, softcap), None


def register() -> None:
    """Register ``kvshelf_tokenselect`` with transformers (idempotent)."""
    hf.register_attention(IMPLEMENTATION, tokenselect_attention, sdpa_masks=True)
