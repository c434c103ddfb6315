"""RoPE position re-encoding of cached keys (TurboRAG, Lu et al. 2024; also Block-Attention, Sun et al. 2024).

Rotary embeddings rotate each pair of key dimensions by ``position * inv_freq``. Rotations compose, so a key
computed at position ``p`` becomes the key at position ``p + delta`` by one more rotation by ``delta * inv_freq``;
values carry no position. This is exact up to floating-point rounding: a chunk computed alone at position 0 and
re-rotated to ``p`` equals the chunk computed alone at ``p`` (attention inside it depends only on relative
positions). It is *not* the KV the chunk would have in the middle of a longer context: that is what
selective recompute (``reuse.blend``) approximates.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` on the last dimension (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotation(delta: torch.Tensor | int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotation by ``delta`` positions, each ``[*delta.shape, head_dim]`` in float64.

    ``inv_freq``: ``[head_dim / 2]``, the model's RoPE inverse frequencies (after any static scaling).
    """
    delta_t = torch.as_tensor(delta, dtype=torch.float64)
    angles = delta_t[..., None] * inv_freq.to(torch.float64)  # [..., head_dim/2]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rerotate_keys(keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE'd keys ``delta`` positions (may be negative, a scalar or one delta per token).

    Args:
        keys: ``[..., tokens, head_dim]`` (e.g. a block's ``[layers, kv_heads, tokens, head_dim]``).
        delta: an int, or a ``[tokens]`` tensor of per-token shifts.
        inv_freq: ``[head_dim / 2]``.
    Returns:
        A new tensor like ``keys``. The rotation is computed in float64 and applied in float32 (or the keys'
        dtype if wider), so fp32 keys are re-encoded to within ~1e-6 relative error.
    """
    if isinstance(delta, int) and delta == 0:
        return keys.clone()
    cos, sin = rotation(delta, inv_freq)  # [head_dim] or [tokens, head_dim]
    work = torch.float64 if keys.dtype == torch.float64 else torch.float32
    k = keys.to(work)
    out = k * cos.to(work) + rotate_half(k) * sin.to(work)
    return out.to(keys.dtype)
