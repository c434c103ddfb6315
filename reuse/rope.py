"""RoPE position re-encoding of cached keys (TurboRAG, Lu et al. 2024; also Block-Attention, Sun et al. 2024).

Rotary embeddings rotate each pair of key dimensions by ``position * inv_freq``. Rotations compose, so a key
computed at position ``p`` becomes the key at position ``p + delta`` by one more rotation by ``delta * inv_freq``;
values carry no position. This is exact up to floating-point rounding: a chunk computed alone at position 0 and
re-rotated to ``p`` equals the chunk computed alone at ``p`` (attention inside it depends only on relative
positions). It is *not* the KV the chunk would have in the middle of a longer context: that is what
selective recompute (``reuse.blend``) approximates.

This module is kvshelf's one RoPE implementation (HF's ``rotate_half`` convention: dimension ``i`` pairs with
``i + head_dim / 2``): ``rope_cos_sin`` (the angles' cos and sin), ``apply_rope`` (the rotation), ``unrope`` and
``rerotate_keys``, used by chunk re-rotation (``adapters.rag``), token pruning (recomputed queries) and the
``xquant`` calibration (pre-RoPE keys). The ``xquant`` codec in ``compress`` (below ``reuse``, so it cannot import
this) keeps a private twin of ``rope_cos_sin`` / ``apply_rope`` next to its fused decode kernel;
``tests/reuse/test_rope.py`` checks the two agree bit for bit (the codec's inverse to float rounding).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` on the last dimension (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(positions: torch.Tensor | int, inv_freq: torch.Tensor, *, scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the RoPE angles ``position * inv_freq``, times ``scaling``: each
    ``[*positions.shape, head_dim / 2]`` in ``dtype``.

    ``positions``: an int (a shift) or a tensor of positions; ``inv_freq``: ``[head_dim / 2]``, the model's
    inverse frequencies (after any static scaling); ``scaling``: HF's ``attention_scaling`` (1 for plain RoPE).
    With the float32 default the angles are HF's own (``position_ids.float() * inv_freq.float()``).
    """
    angles = torch.as_tensor(positions).to(dtype)[..., None] * inv_freq.to(dtype)
    if scaling == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scaling, angles.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., head_dim]``: each pair ``(x_i, x_{i + head_dim/2})`` by the angle of ``cos`` / ``sin``.

    ``cos`` / ``sin``: ``[..., head_dim / 2]`` (``rope_cos_sin``), or HF's ``[..., head_dim]`` (both halves equal),
    broadcast against ``x``. Bit for bit HF's ``x * cos + rotate_half(x) * sin``, in ``x``'s dtype unless
    ``cos`` / ``sin`` are wider.
    """
    half = x.shape[-1] // 2
    if cos.shape[-1] != half:
        cos, sin = cos[..., :half], sin[..., :half]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """The inverse of ``apply_rope(., cos, sin)`` when ``cos`` / ``sin`` include ``scaling`` (HF's attention
    scaling): the rotation by the opposite angle, divided by ``scaling ** 2``. Shapes as ``apply_rope``."""
    out = apply_rope(x, cos, -sin)
    return out if scaling == 1.0 else out / scaling**2


def rotation(delta: torch.Tensor | int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotation by ``delta`` positions, each ``[*delta.shape, head_dim / 2]`` in float64."""
    return rope_cos_sin(delta, inv_freq, dtype=torch.float64)


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
    cos, sin = rotation(delta, inv_freq)  # [head_dim / 2] or [tokens, head_dim / 2]
    work = torch.float64 if keys.dtype == torch.float64 else torch.float32
    return apply_rope(keys.to(work), cos.to(work), sin.to(work)).to(keys.dtype)
