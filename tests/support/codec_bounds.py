"""Round-trip bounds of the codecs: what each registered codec promises about its reconstruction error.

``BOUNDS`` names the bound of every codec in the registry; the codec tests iterate ``available_codecs()`` itself
and fail for a codec without an entry (``bound_of``), so a new codec cannot go untested. ``case(name)`` gives the
parameters and block layout its round trips run with: a codec that needs the model (``needs_model``) is bound to
the tables of a tiny random Llama (``MODEL_CASES``), and its blocks take that model's layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers import key_of, make_block

from kvshelf.compress import get_codec
from kvshelf.kvstore import KVBlock
from kvshelf.kvstore.encoding import decode_block, encode_block

LOSSLESS_BOUND = "lossless"
#: every registered codec -> the bound its round trip is checked against (``check_round_trip``)
BOUNDS: dict[str, str] = {
    "raw": LOSSLESS_BOUND,
    "zstd": LOSSLESS_BOUND,
    "fp16": "fp16",  # round to nearest fp16: 2^-11 |x| + 2^-24
    "bf16": "bf16",  # round to nearest bf16: 2^-8 |x|
    "int8": "kivi",  # half a step of each group (keys per channel, values per token) + the fp16 minimum's rounding
    "int4": "kivi",
    "int2": "kivi",
    "cachegen": "cachegen",  # the codec's own per-layer error_bound; sink tokens in fp16
    "sparse": "inner",  # the inner codec's bound on the kept tokens (dropped ones decode to ``fill``)
    "xquant": "token_l2",  # per token, L2 of [K_pre | V] within sqrt(C) * max step / 2 (drop_below 0, fp32 product)
}
LOSSLESS = [n for n, b in BOUNDS.items() if b == LOSSLESS_BOUND]
LOSSY = ["fp16", "bf16", "int8", "int4", "int2", "cachegen"]  # lossy, model-free, not wrapping another codec
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUT_EPS = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def bound_of(name: str) -> str:
    """The bound of codec ``name``; a registered codec without one fails the test that asked (never skipped)."""
    if name not in BOUNDS:
        pytest.fail(f"codec {name!r} is registered but has no round-trip bound: add it to BOUNDS in "
                    f"tests/support/codec_bounds.py (LOSSLESS_BOUND, or its documented error bound, with a branch in "
                    f"check_round_trip / error_bound for a new kind of bound)", pytrace=False)
    return BOUNDS[name]


@dataclass(frozen=True)
class Case:
    """How a codec's round trips run: its parameters, and the layout of its blocks when a model fixes it."""

    params: dict[str, Any] = field(default_factory=dict)
    layout: tuple[int, int, int] | None = None  # (layers, kv_heads, head_dim) of the model the codec is bound to

    def block(self, tokens: int, *, layers: int = 3, heads: int = 2, head_dim: int = 16, **kwargs: Any) -> KVBlock:
        """``make_block`` in the asked layout, or in the model's when the codec is bound to one."""
        if self.layout is not None:
            layers, heads, head_dim = self.layout
        return make_block(tokens, layers=layers, heads=heads, head_dim=head_dim, **kwargs)


@functools.cache
def _xquant_case() -> Case:
    """xquant bound to a tiny random Llama's tables (2 layers, 2 KV heads, head dim 16: C = 64), in the exact
    setting of its documented bound: nothing dropped, no fp16 sinks, the fp32 product."""
    from kvshelf.adapters.model import tiny_llama
    from kvshelf.adapters.xquant import xquant_params

    model = tiny_llama(seed=7, layers=2)
    calibration = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    params = xquant_params(model, calibration, drop_below=0.0, max_sinks=0, matmul="fp32", step=0.05)
    return Case(params, layout=(2, 2, 16))


#: codecs that need the model -> their case (a tiny model's tables bound in this process)
MODEL_CASES = {"xquant": _xquant_case}


def case(name: str) -> Case:
    bound_of(name)
    if not get_codec(name).needs_model:
        return Case()
    if name not in MODEL_CASES:
        pytest.fail(f"codec {name!r} needs the model: add a tiny-model case to MODEL_CASES in "
                    "tests/support/codec_bounds.py", pytrace=False)
    return MODEL_CASES[name]()


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
    """Per-element bounds ``(keys, values)`` of codec ``name`` (built as ``codec``) on ``keys`` / ``values``."""
    k, v = keys.float(), values.float()
    layers, heads, tokens, dim = k.shape
    kind = bound_of(name)
    if kind == LOSSLESS_BOUND:
        return torch.zeros_like(k), torch.zeros_like(v)
    if kind == "inner":
        return error_bound(codec.inner, codec._inner, keys, values)  # noqa: SLF001
    if kind == "fp16":
        return k.abs() * 2**-11 + 2**-24, v.abs() * 2**-11 + 2**-24
    if kind == "bf16":
        return k.abs() * 2**-8, v.abs() * 2**-8
    if kind == "kivi":
        kb = _groups_bound(k.permute(0, 1, 3, 2).reshape(-1, tokens), codec.group_size, codec.bits)
        vb = _groups_bound(v.permute(0, 2, 1, 3).reshape(layers * tokens, -1), codec.group_size, codec.bits)
        return (kb.view(layers, heads, dim, tokens).permute(0, 1, 3, 2),
                vb.view(layers, tokens, heads, dim).permute(0, 2, 1, 3))
    assert kind == "cachegen", f"{name}: no per-element bound of kind {kind!r}"
    bound = codec.error_bound(keys, values)  # [2, layers]: per element, in the block's units
    b = bound[:, :, None, None, None].expand(2, layers, heads, tokens, dim) * (1 + 2**-9) + 1e-6
    fp32 = 2**-21 * torch.stack([k, v]).abs().amax(dim=(2, 3, 4), keepdim=True)  # float32 reconstruction
    b = b + fp32
    sinks = codec.sink_tokens(values)  # stored in fp16
    b[:, :, :, sinks] = torch.stack([k, v])[:, :, :, sinks].abs() * 2**-11 + 2**-24
    return b[0], b[1]


def _token_l2_bound(codec, params: dict[str, Any]) -> float:  # noqa: ANN001
    """xquant's documented per-token L2 bound on ``[K_pre | V]`` (drop_below 0), plus float32 slack."""
    from kvshelf.compress.xquant import bound_tables

    steps = codec._plan().steps  # noqa: SLF001
    return math.sqrt(bound_tables(params["model"]).width) * float(steps.max()) / 2 * 1.0001 + 1e-4


def _per_token(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[layers, tokens, 2 * kv_heads * head_dim]``: each token's keys and values of all heads, side by side."""
    return torch.cat([keys.float().permute(0, 2, 1, 3).flatten(2), values.float().permute(0, 2, 1, 3).flatten(2)],
                     dim=-1)


def check_round_trip(name: str, block: KVBlock, params: dict | None = None) -> None:
    """Encode and decode ``block`` with codec ``name`` (its ``case`` parameters, updated by ``params``) and check
    the result against the codec's bound."""
    kind = bound_of(name)
    params = {**case(name).params, **(params or {})}
    codec = get_codec(name, params)
    data = encode_block(block, key_of(block), name, params)
    back = decode_block(data, expected_key=key_of(block))
    assert back.keys.shape == block.keys.shape and back.values.shape == block.values.shape
    assert back.keys.dtype == block.dtype and back.values.dtype == block.dtype
    if kind == LOSSLESS_BOUND:
        assert torch.equal(back.keys, block.keys)
        assert torch.equal(back.values, block.values)
        return
    if kind == "token_l2":
        bound = _token_l2_bound(codec, params)
        err = (_per_token(back.keys, back.values) - _per_token(block.keys, block.values)).norm(dim=-1)
        rounding = torch.finfo(block.dtype).eps * (_per_token(block.keys, block.values).norm(dim=-1) + bound)
        assert bool((err <= bound + rounding).all()), f"{name}: max excess {(err - bound - rounding).max().item()}"
        return
    kb, vb = error_bound(name, codec, block.keys, block.values)
    eps = OUT_EPS[block.dtype]
    for got, want, bound in ((back.keys, block.keys, kb), (back.values, block.values, vb)):
        err = (got.float() - want.float()).abs()
        assert bool((err <= bound + eps * want.float().abs() * 2 + eps * bound).all()), (
            f"{name}: max excess {(err - bound).max().item()}"
        )
