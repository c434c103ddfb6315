"""An orthonormal Walsh-Hadamard rotation of ``head_dim`` (QuaRot / QuIP# style incoherence processing).

After QuaRot (Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", 2024) and QuIP#
(Tseng et al., 2024): multiplying each ``head_dim`` vector by ``H / sqrt(d)`` (Sylvester's Hadamard matrix,
``d`` a power of two) spreads a few outlier channels over all channels, so a uniform quantizer of the rotated
vector loses less. ``H / sqrt(d)`` is orthonormal and symmetric, so it is its own inverse and preserves the L2
norm of the quantization error.
"""

from __future__ import annotations

import functools
import math

import torch


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@functools.lru_cache(maxsize=8)
def hadamard(d: int) -> torch.Tensor:
    """The orthonormal ``[d, d]`` float32 Hadamard matrix (``d`` a power of two)."""
    if not is_power_of_two(d):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(d)).float()


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` times the orthonormal Hadamard matrix (its own inverse)."""
    return x @ hadamard(x.shape[-1])
