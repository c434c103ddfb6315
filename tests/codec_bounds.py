"""Round-trip bounds of the codecs: what each codec promises about its reconstruction error."""

from __future__ import annotations

import torch
from helpers import key_of

from kvshelf.compress import get_codec
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore.encoding import decode_block, encode_block

LOSSLESS = ["raw", "zstd"]
LOSSY = ["fp16", "bf16", "int8", "int4", "int2", "cachegen"]
ALL = LOSSLESS + LOSSY + ["sparse"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUT_EPS = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _groups_bound(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """The documented per-element bound s/2 + 2^-11 |min| of a group quantizer over rows of ``x`` ``[rows, n]``."""
    rows, n = x.shape
    groups = (n + group - 1) // group
    pad = groups * group - n
    padded = torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1) if pad else x
    g = padded.view(rows, groups, group)
    lo, hi = g.amin(2), g.amax(2)
    step = (hi - lo.half().float()).clamp_min(0) / ((1 << bits) - 1)
    bound = step * (1 + 2**-9) / 2 + 2**-11 * lo.abs() + 1e-6
    return bound.repeat_interleave(group, dim=1)[:, :n]


def error_bound(name: str, codec, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    k, v = keys.float(), values.float()
    layers, heads, tokens, dim = k.shape
    if name in LOSSLESS:
        return torch.zeros_like(k), torch.zeros_like(v)
    if name == "fp16":
        return k.abs() * 2**-11 + 2**-24, v.abs() * 2**-11 + 2**-24
    if name == "bf16":
        return k.abs() * 2**-8, v.abs() * 2**-8
    if name in ("int8", "int4", "int2"):
        kb = _groups_bound(k.permute(0, 1, 3, 2).reshape(-1, tokens), codec.group_size, codec.bits)
        vb = _groups_bound(v.permute(0, 2, 1, 3).reshape(layers * tokens, -1), codec.group_size, codec.bits)
        return (kb.view(layers, heads, dim, tokens).permute(0, 1, 3, 2),
                vb.view(layers, tokens, heads, dim).permute(0, 2, 1, 3))
    assert name == "cachegen"
    bound = codec.error_bound(keys, values)  # [2, layers]: per element, in the block's units
    b = bound[:, :, None, None, None].expand(2, layers, heads, tokens, dim) * (1 + 2**-9) + 1e-6
    fp32 = 2**-21 * torch.stack([k, v]).abs().amax(dim=(2, 3, 4), keepdim=True)  # float32 reconstruction
    b = b + fp32
    sinks = codec.sink_tokens(values)  # stored in fp16
    b[:, :, :, sinks] = torch.stack([k, v])[:, :, :, sinks].abs() * 2**-11 + 2**-24
    return b[0], b[1]


def check_round_trip(name: str, block: KVBlock, params: dict | None = None) -> None:
    codec = get_codec(name, params)
    data = encode_block(block, key_of(block), name, params)
    back = decode_block(data, expected_key=key_of(block))
    assert back.keys.shape == block.keys.shape and back.values.shape == block.values.shape
    assert back.keys.dtype == block.dtype and back.values.dtype == block.dtype
    if name in LOSSLESS:
        assert torch.equal(back.keys, block.keys)
        assert torch.equal(back.values, block.values)
        return
    kb, vb = error_bound(name, codec, block.keys, block.values)
    eps = OUT_EPS[block.dtype]
    for got, want, bound in ((back.keys, block.keys, kb), (back.values, block.values, vb)):
        err = (got.float() - want.float()).abs()
        assert bool((err <= bound + eps * want.float().abs() * 2 + eps * bound).all()), (
            f"{name}: max excess {(err - bound).max().item()}"
        )
