"""kvshelf's one RoPE (``reuse.rope``): HF's convention bit for bit, the rotations it replaced bit for bit, and the
``xquant`` codec's private twin in ``compress`` (which may not import ``reuse``) equal to it."""

from __future__ import annotations

import pytest
import torch

from kvshelf.compress import xquant
from kvshelf.reuse.rope import apply_rope, rerotate_keys, rope_cos_sin, rotate_half, unrope

DIM = 16


def _inv_freq(theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _hf_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, ...]:
    """HF's rotary embedding (``LlamaRotaryEmbedding.forward``): full-width ``[..., DIM]``."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [1.0, 1.2])
def test_apply_rope_is_hf_bit_for_bit(dtype, scaling):
    x = torch.randn(2, 3, 7, DIM, generator=torch.Generator().manual_seed(0)).to(dtype)  # [b, h, n, d]
    cos_full, sin_full = (t.to(dtype)[None, None] for t in _hf_cos_sin(torch.arange(100, 107), _inv_freq(), scaling))
    expected = x * cos_full + rotate_half(x) * sin_full  # HF's apply_rotary_pos_emb
    cos, sin = rope_cos_sin(torch.arange(100, 107), _inv_freq(), scaling=scaling)
    assert torch.equal(_bits(cos), _bits(_hf_cos_sin(torch.arange(100, 107), _inv_freq(), scaling)[0][..., : DIM // 2]))
    assert torch.equal(_bits(apply_rope(x, cos.to(dtype), sin.to(dtype))), _bits(expected))
    assert torch.equal(_bits(apply_rope(x, cos_full, sin_full)), _bits(expected))  # HF's full-width tables too


def test_rerotation_is_the_float64_rotation_it_replaced():
    keys = torch.randn(2, 2, 5, DIM, generator=torch.Generator().manual_seed(1))
    for delta in (7, -3, torch.tensor([0, 1, 2, 40, 5000])):
        angles = torch.as_tensor(delta, dtype=torch.float64)[..., None] * _inv_freq().to(torch.float64)
        emb = torch.cat((angles, angles), dim=-1)
        old = keys * emb.cos().float() + rotate_half(keys) * emb.sin().float()
        assert torch.equal(_bits(rerotate_keys(keys, delta, _inv_freq())), _bits(old))


@pytest.mark.parametrize("scaling", [1.0, 1.2])
def test_unrope_inverts_and_is_the_calibration_formula_it_replaced(scaling):
    keys = torch.randn(2, 2, 9, DIM, generator=torch.Generator().manual_seed(2))
    freqs = torch.arange(9, dtype=torch.float32)[:, None] * _inv_freq()[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos_full, sin_full = emb.cos() * scaling, emb.sin() * scaling
    a, b = keys.chunk(2, dim=-1)
    old = (keys * cos_full - torch.cat([-b, a], dim=-1) * sin_full) / scaling**2
    cos, sin = rope_cos_sin(torch.arange(9), _inv_freq(), scaling=scaling)
    assert torch.equal(_bits(unrope(keys, cos, sin, scaling)), _bits(old))
    assert torch.allclose(unrope(apply_rope(keys, cos, sin), cos, sin, scaling), keys, atol=1e-5)


@pytest.fixture(params=[1.0, 1.2], ids=["plain", "scaled"])
def bound(request):
    tables = xquant.XQuantTables(torch.eye(2 * 2 * DIM).expand(2, -1, -1), torch.ones(2, 2 * 2 * DIM), _inv_freq(),
                                 2, DIM, request.param)
    digest = xquant.bind_tables(tables)
    yield digest, request.param
    xquant.unbind_tables(digest)


def test_the_xquant_codec_twin_equals_reuse_rope(bound):
    """``compress.xquant``'s ``_cos_sin`` / ``_rope`` (kept in compress next to its fused kernel) are ``reuse.rope``'s
    ``rope_cos_sin`` / ``apply_rope`` bit for bit; its inverse equals ``unrope`` to float rounding."""
    digest, scaling = bound
    start, tokens = 300, 11
    cos_c, sin_c = xquant._cos_sin(digest, start, tokens)  # noqa: SLF001 - [T, 1, D/2]
    cos, sin = rope_cos_sin(torch.arange(start, start + tokens), _inv_freq(), scaling=scaling)  # [T, D/2]
    assert torch.equal(_bits(cos_c[:, 0]), _bits(cos)) and torch.equal(_bits(sin_c[:, 0]), _bits(sin))
    x = torch.randn(2, tokens, 2, DIM, generator=torch.Generator().manual_seed(3))  # [L, T, H, D]
    rotated = xquant._rope(x, cos_c, sin_c, inverse=False)  # noqa: SLF001
    assert torch.equal(_bits(rotated), _bits(apply_rope(x, cos[:, None], sin[:, None])))
    back = xquant._rope(rotated, cos_c, sin_c, inverse=True)  # noqa: SLF001
    assert torch.allclose(back, unrope(rotated, cos[:, None], sin[:, None], scaling), atol=1e-6)
    assert torch.allclose(back, x, atol=1e-5)


def _hf_partial(x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor) -> torch.Tensor:
    """HF's partial rotary (Phi3, StableLM, GPT-NeoX): the first ``cos.shape[-1]`` dims rotate, the rest pass."""
    rot, rest = x[..., : cos_full.shape[-1]], x[..., cos_full.shape[-1]:]
    return torch.cat([rot * cos_full + rotate_half(rot) * sin_full, rest], dim=-1)


def _cohere_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Cohere's ``rotate_half``: interleaved pairs ``(x_2i, x_2i+1) -> (-x_2i+1, x_2i)``."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_is_hf_bit_for_bit(dtype):
    """Partial rotary (``rotary_dim`` < head dim): HF's rotation of the first dims, the rest unchanged, bit for bit
    with half-width or HF's full-width tables; rerotation moves only the rotated dims."""
    inv_freq = _inv_freq()[: DIM // 4]  # rotary_dim = DIM / 2 (Phi3's partial_rotary_factor=0.5)
    rotary_dim = 2 * inv_freq.numel()
    x = torch.randn(2, 3, 7, DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    freqs = torch.arange(100, 107)[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_full, sin_full = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = _hf_partial(x, cos_full, sin_full)
    cos, sin = rope_cos_sin(torch.arange(100, 107), inv_freq)
    assert torch.equal(_bits(apply_rope(x, cos.to(dtype), sin.to(dtype), rotary_dim=rotary_dim)), _bits(expected))
    assert torch.equal(_bits(apply_rope(x, cos_full, sin_full, rotary_dim=rotary_dim)), _bits(expected))
    keys = torch.randn(2, 2, 5, DIM, generator=torch.Generator().manual_seed(5))
    cos0, sin0 = rope_cos_sin(torch.arange(5), inv_freq)
    at_zero = apply_rope(keys, cos0, sin0, rotary_dim=rotary_dim)
    cos37, sin37 = rope_cos_sin(torch.arange(37, 42), inv_freq)
    moved = rerotate_keys(at_zero, 37, inv_freq)
    assert torch.allclose(moved, apply_rope(keys, cos37, sin37, rotary_dim=rotary_dim), atol=1e-5)
    assert torch.equal(moved[..., rotary_dim:], keys[..., rotary_dim:])  # the pass-through dims are untouched
    scaled = apply_rope(keys, cos37 * 1.2, sin37 * 1.2, rotary_dim=rotary_dim)  # HF's attention scaling
    assert torch.allclose(unrope(scaled, cos37 * 1.2, sin37 * 1.2, 1.2, rotary_dim=rotary_dim), keys, atol=1e-5)


def test_interleaved_rotary_is_cohere_bit_for_bit():
    """Interleaved pairs ``(2i, 2i + 1)`` (Cohere's ``repeat_interleave`` tables and ``rotate_half``) bit for bit;
    rerotating interleaved keys equals computing them at the new position, and differs from the halves
    convention (what moving Cohere's keys used to do)."""
    x = torch.randn(2, 3, 7, DIM, generator=torch.Generator().manual_seed(6))
    freqs = torch.arange(100, 107)[:, None].float() * _inv_freq()
    emb = torch.repeat_interleave(freqs, 2, dim=-1)
    expected = x * emb.cos() + _cohere_rotate_half(x) * emb.sin()
    cos, sin = rope_cos_sin(torch.arange(100, 107), _inv_freq())
    assert torch.equal(_bits(apply_rope(x, cos, sin, interleaved=True)), _bits(expected))
    assert torch.equal(_bits(apply_rope(x, emb.cos(), emb.sin(), interleaved=True)), _bits(expected))
    cos0, sin0 = rope_cos_sin(torch.arange(7), _inv_freq())
    at_zero = apply_rope(x, cos0, sin0, interleaved=True)
    moved = rerotate_keys(at_zero, 100, _inv_freq(), interleaved=True)
    assert torch.allclose(moved, expected, atol=1e-4)
    assert (rerotate_keys(at_zero, 100, _inv_freq()) - expected).abs().max() > 0.5
    back = unrope(expected, cos, sin, interleaved=True)
    assert torch.allclose(back, x, atol=1e-5)
