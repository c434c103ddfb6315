"""Recomputing an attention module's queries as its own forward does (projection, q norm, RoPE) for token pruning and
selection.
"""

from __future__ import annotations

import functools
import sys

import torch

from kvshelf.adapters.hf.dynamic import HFModule
from kvshelf.adapters.hf.modules import attention_head_dim
from kvshelf.kvstore.errors import UnsupportedModelError

#: the submodules an attention module may have for ``attention_queries`` to know its query path
_QUERY_PATH_CHILDREN = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "q_layernorm", "k_layernorm", "qkv_proj",
    "query_key_value", "dense", "c_attn", "c_proj", "attn_dropout", "resid_dropout", "attention_dropout"})


@functools.cache
def _interleaved_rotation(cls: type) -> bool:
    """The rotary convention of the attention class's modeling module, read from its own ``rotate_half`` on a probe:
    halves (Llama's ``[-x2, x1]``) or interleaved pairs (Cohere's)."""
    rotate_half = getattr(sys.modules[cls.__module__], "rotate_half", None)
    probe: HFModule = rotate_half(torch.arange(4.0)) if callable(rotate_half) else None
    out = probe.tolist() if probe is not None else None
    if out == [-2.0, -3.0, 0.0, 1.0]:
        return False
    if out == [-1.0, 0.0, -3.0, 2.0]:
        return True
    raise UnsupportedModelError(f"attention module {cls.__name__}: unknown rotary convention (no rotate_half with "
                                "halves or interleaved pairs in its modeling module)")


def query_path(module: HFModule) -> str:
    """How ``attention_queries`` recomputes the module's queries: ``"q_proj"`` (Llama-style, with any q norm),
    ``"qkv_proj"`` (Phi3), ``"gpt_neox"`` / ``"falcon"`` (fused ``query_key_value``), ``"gpt2"`` (``c_attn``).
    ``UnsupportedModelError`` naming what it does not know (then queries cannot be recomputed exactly)."""
    unknown = {name for name, _ in module.named_children()} - _QUERY_PATH_CHILDREN
    if unknown:
        raise UnsupportedModelError(f"attention module {type(module).__name__} has submodules kvshelf does not know "
                                    f"on its query path ({', '.join(sorted(unknown))})")
    if hasattr(module, "q_proj"):
        path = "q_proj"
    elif hasattr(module, "qkv_proj"):
        path = "qkv_proj"
    elif hasattr(module, "query_key_value"):
        path = "falcon" if hasattr(module, "new_decoder_architecture") else "gpt_neox"
    elif hasattr(module, "c_attn") and not getattr(module, "is_cross_attention", False):
        path = "gpt2"
    else:
        raise UnsupportedModelError(f"attention module {type(module).__name__}: no query projection kvshelf knows")
    if path != "gpt2":
        _interleaved_rotation(type(module))
    return path


def _fused_queries(module: HFModule, hidden: torch.Tensor, path: str, d: int) -> torch.Tensor:
    """``[b, n, h_q, d]`` queries of the fused projections (before any norm or RoPE)."""
    b, n, _ = hidden.shape
    if path == "qkv_proj":  # Phi3: [q | k | v] along the output
        return module.qkv_proj(hidden)[..., : module.config.num_attention_heads * d].view(b, n, -1, d)
    if path == "gpt_neox":  # per head [q | k | v]
        return module.query_key_value(hidden).view(b, n, -1, 3 * d)[..., :d]
    if path == "gpt2":
        return module.c_attn(hidden).split(module.split_size, dim=2)[0].view(b, n, -1, d)
    fused = module.query_key_value(hidden)  # Falcon, as its _split_heads
    if module.new_decoder_architecture:
        return fused.view(b, n, -1, module.num_heads // module.num_kv_heads + 2, d)[:, :, :, :-2].flatten(2, 3)
    if not module.multi_query:
        return fused.view(b, n, module.num_heads, 3, d)[..., 0, :]
    return fused.view(b, n, module.num_heads + 2, d)[..., :-2, :]


def attention_queries(module: HFModule, hidden: torch.Tensor,
                      embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The module's queries of ``hidden`` ``[b, n, hidden]`` (its normed input), as its own forward computes them
    before attending: projection (``query_path``), q norm where the family puts it (OLMo2: over all heads before
    the head split; Qwen3, Gemma3, Cohere: per head; StableLM: per-head layer norms), then RoPE with
    ``embeddings`` (HF's ``(cos, sin)`` ``[b, n, rotary_dim]``; partial rotary: only the first ``rotary_dim`` dims
    of each head rotate; Cohere's interleaved pairs), none for GPT-2. Returns ``[b, h_q, n, d]``."""
    from kvshelf.reuse.rope import apply_rope

    path, d = query_path(module), attention_head_dim(module)
    b, n, _ = hidden.shape
    if path == "q_proj":
        q = module.q_proj(hidden)
        norm = getattr(module, "q_norm", None)
        if norm is not None and getattr(module, "use_qk_norm", True):
            weight = getattr(norm, "weight", None)
            if weight is not None and weight.dim() == 1 and weight.numel() == q.shape[-1] != d:
                q = norm(q).view(b, n, -1, d)  # OLMo2: one norm over every head's dims
            else:
                q = norm(q.view(b, n, -1, d))  # Qwen3, Gemma3, Cohere: per head
        else:
            q = q.view(b, n, -1, d)
    else:
        q = _fused_queries(module, hidden, path, d)
    q = q.transpose(1, 2)  # [b, h_q, n, d]
    if getattr(module, "qk_layernorm", False):
        q = module.q_layernorm(q)  # StableLM: per-head layer norms on [b, h_q, n, d]
    if path == "gpt2" or embeddings is None:
        return q
    cos, sin = (t.unsqueeze(1) for t in embeddings)  # [b, 1, n, rotary_dim]
    return apply_rope(q, cos.to(q.dtype), sin.to(q.dtype), rotary_dim=cos.shape[-1],
                      interleaved=_interleaved_rotation(type(module)))
