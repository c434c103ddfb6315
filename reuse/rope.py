"""RoPE position re-encoding of cached keys (TurboRAG, Lu et al. 2024; also Block-Attention, Sun et al. 2024).

Rotary embeddings rotate each pair of key dimensions by ``position * inv_freq``. Rotations compose, so a key
computed at position ``p`` becomes the key at position ``p + delta`` by one more rotation by ``delta * inv_freq``;
values carry no position. This is exact up to floating-point rounding: a chunk computed alone at position 0 and
re-rotated to ``p`` equals the chunk computed alone at ``p`` (attention inside it depends only on relative
positions). It is *not* the KV the chunk would have in the middle of a longer context: that is what
selective recompute (``reuse.blend``) approximates.

This module is kvshelf's one RoPE implementation. By default HF's ``rotate_half`` convention: dimension ``i`` pairs
with ``i + rotary_dim / 2``; ``interleaved=True``: dimensions ``2i`` and ``2i + 1`` pair (Cohere, GPT-J). With
partial rotary (Phi3's ``partial_rotary_factor``, StableLM, GPT-NeoX's ``rotary_pct``) only the first
``rotary_dim = 2 * len(inv_freq)`` dimensions of a head rotate; the rest pass through unchanged.
``rope_cos_sin`` (the angles' cos and sin), ``apply_rope`` (the rotation), ``unrope`` and
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rotary_dim: int | None = None,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` ``[..., head_dim]``: each pair ``(x_i, x_{i + rotary_dim/2})`` (``interleaved``: each pair
    ``(x_2i, x_2i+1)``) of its first ``rotary_dim`` dimensions (all by default) by the angle of ``cos`` / ``sin``;
    the other dimensions pass through (partial rotary).

    ``cos`` / ``sin``: ``[..., rotary_dim / 2]`` (``rope_cos_sin``), or HF's ``[..., rotary_dim]`` (both halves
    equal; interleaved: each angle twice in a row), broadcast against ``x``. Bit for bit HF's
    ``x * cos + rotate_half(x) * sin``, in ``x``'s dtype unless ``cos`` / ``sin`` are wider.
    """
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    if dim != x.shape[-1]:
        rotated = apply_rope(x[..., :dim], cos, sin, interleaved=interleaved)
        return torch.cat([rotated, x[..., dim:]], dim=-1)
    half = dim // 2
    if interleaved:
        if cos.shape[-1] != half:
            cos, sin = cos[..., ::2], sin[..., ::2]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    if cos.shape[-1] != half:
        cos, sin = cos[..., :half], sin[..., :half]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float = 1.0, *,
           rotary_dim: int | None = None, interleaved: bool = False) -> torch.Tensor:
    """The inverse of ``apply_rope(., cos, sin)`` when ``cos`` / ``sin`` include ``scaling`` (HF's attention
    scaling): the rotation by the opposite angle, divided by ``scaling ** 2``. Shapes as ``apply_rope``."""
    out = apply_rope(x, cos, -sin, rotary_dim=rotary_dim, interleaved=interleaved)
    if scaling == 1.0:
        return out
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    if dim == x.shape[-1]:
        return out / scaling**2
    return torch.cat([out[..., :dim] / scaling**2, out[..., dim:]], dim=-1)


def rotation(delta: torch.Tensor | int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotation by ``delta`` positions, each ``[*delta.shape, head_dim / 2]`` in float64."""
    return rope_cos_sin(delta, inv_freq, dtype=torch.float64)


def rerotate_keys(keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor, *,
                  interleaved: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Move RoPE'd keys ``delta`` positions (may be negative, a scalar or one delta per token).

    Args:
        keys: ``[..., tokens, head_dim]`` (e.g. a block's ``[layers, kv_heads, tokens, head_dim]``).
        delta: an int, or a ``[tokens]`` tensor of per-token shifts.
        inv_freq: ``[rotary_dim / 2]``: the first ``rotary_dim`` dimensions of each head rotate, the rest (partial
            rotary) pass through.
        interleaved: the model pairs dimensions ``(2i, 2i + 1)`` (Cohere), not halves.
        out: where to write the result (a tensor, or a view such as rows of a larger cache, shaped like ``keys``
            and of its dtype, on any device): the same values, without an intermediate copy of the whole result
            when it is on the keys' device.
    Returns:
        A new tensor like ``keys`` (``out`` when given). The rotation is computed in float64 and applied in
        float32 (or the keys' dtype if wider), so fp32 keys are re-encoded to within ~1e-6 relative error.
    """
    if out is not None and (out.shape != keys.shape or out.dtype != keys.dtype):
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, the keys {tuple(keys.shape)} {keys.dtype}")
    if isinstance(delta, int) and delta == 0:
        return keys.clone() if out is None else out.copy_(keys)
    rotary_dim = 2 * inv_freq.shape[-1]
    if rotary_dim > keys.shape[-1]:
        raise ValueError(f"{inv_freq.shape[-1]} rotary frequencies for keys of head dim {keys.shape[-1]}")
    cos, sin = rotation(delta, inv_freq)  # [rotary_dim / 2] or [tokens, rotary_dim / 2]
    work = torch.float64 if keys.dtype == torch.float64 else torch.float32
    if (out is not None and out.device == keys.device and keys.dtype == work and rotary_dim == keys.shape[-1]
            and not interleaved):
        # apply_rope's arithmetic, written into the two halves of ``out`` (the same bits, no concatenation)
        half = rotary_dim // 2
        cos, sin = cos.to(work), sin.to(work)
        a, b = keys[..., :half], keys[..., half:]
        torch.sub(a * cos, b * sin, out=out[..., :half])
        torch.add(b * cos, a * sin, out=out[..., half:])
        return out
    moved = apply_rope(keys.to(work), cos.to(work), sin.to(work), rotary_dim=rotary_dim,
                       interleaved=interleaved).to(keys.dtype)
    return moved if out is None else out.copy_(moved)
