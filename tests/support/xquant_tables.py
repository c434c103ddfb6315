"""XQuant tables of no model, for timing and exercising xquant's decode on a model's shape."""

from __future__ import annotations

import torch

from kvshelf.compress.xquant import XQuantTables


def random_xquant_tables(layers: int, kv_heads: int, head_dim: int, *, seed: int = 0,
                         rope_theta: float = 10000.0) -> XQuantTables:
    """``XQuantTables`` of no model: a random orthonormal basis ``[layers, C, C]`` (``C = 2 * kv_heads *
    head_dim``), unit calibration spreads and RoPE of ``rope_theta``: for timing xquant's decode on a model's shape
    (its quality means nothing)."""
    width = 2 * kv_heads * head_dim
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(layers, width, width, generator=generator)).Q
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return XQuantTables(basis, torch.ones(layers, width), inv_freq, kv_heads, head_dim)
