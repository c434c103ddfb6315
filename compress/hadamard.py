"""An orthonormal Walsh-Hadamard rotation of ``head_dim`` (QuaRot / QuIP# style incoherence processing).

After QuaRot (Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", 2024) and QuIP#
(Tseng et al., 2024): multiplying each ``head_dim`` vector by ``H / sqrt(d)`` (Sylvester's Hadamard matrix,
``d`` a power of two) spreads a few outlier channels over all channels, so a uniform quantizer of the rotated
vector loses less. ``H / sqrt(d)`` is orthonormal and symmetric, so it is its own inverse and preserves the L2
norm of the quantization error.

The rotation is a fast Walsh-Hadamard transform (Fino & Algazi, "Unified Matrix Treatment of the Fast
Walsh-Hadamard Transform", IEEE Trans. Computers, 1976; the kernel QuaRot uses on GPU): Sylvester's matrix is a
Kronecker product, ``H_d = H_f1 (x) H_f2 (x) ... (x) H_fk`` with ``d = f1 * f2 * ... * fk``, so ``x @ H_d`` is
``k`` butterfly passes over ``x`` reshaped to ``[..., f1, f2, ..., fk]``, pass ``i`` mixing axis ``fi`` only.
Each pass is one small matrix product (``H_fi``, at most ``MAX_RADIX`` wide, built per call: no process-wide
cache), so the rotation takes ``O(n d (f1 + ... + fk))`` time, ``O(n d log d)`` for a bounded radix, and
``O(n d)`` memory: never the dense ``[d, d]`` matrix (for ``d = 8192`` that was 512 MiB of float64, built from
a block header's ``head_dim``). Radix-2 passes (``log2 d`` of them) would be the textbook butterfly, but each
would be a strided elementwise pass; a radix of up to 64 runs on the BLAS and is as fast as the dense product at
small ``d`` and faster above. For ``d <= MAX_RADIX`` it is one product with the ``[d, d]`` matrix, the same
float32 numbers as the dense rotation always used.
"""

from __future__ import annotations

import math

import torch

#: the widest butterfly (one ``[f, f]`` float32 matrix per pass, built per call: 256 KiB at 256)
MAX_RADIX = 256
#: the widest factor when ``d > MAX_RADIX`` (the passes are then balanced, each at most this wide)
_SPLIT_RADIX = 64


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def factors(d: int) -> list[int]:
    """The butterfly widths of a ``d``-point transform (powers of two whose product is ``d``): ``[d]`` up to
    ``MAX_RADIX``, else ``ceil(log2(d) / 6)`` balanced factors of at most 64."""
    if not is_power_of_two(d):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {d}")
    if d <= MAX_RADIX:
        return [d]
    bits = d.bit_length() - 1
    passes = -(-bits // (_SPLIT_RADIX.bit_length() - 1))  # ceil(log2(d) / log2(64))
    return [1 << (bits // passes + (1 if i < bits % passes else 0)) for i in range(passes)]


def sylvester(f: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester's ``[f, f]`` Hadamard matrix times ``scale`` in ``dtype``: ``H[i, j] = (-1) ** popcount(i & j)``
    (``f`` a power of two). Computed in float64 and rounded once (float32: ``(H / sqrt(d)).float()``)."""
    i = torch.arange(f)
    both = i[:, None] & i[None, :]
    parity = torch.zeros(f, f, dtype=torch.int64)
    while bool(both.any()):
        parity ^= both & 1
        both = both >> 1
    return ((1.0 - 2.0 * parity.double()) * scale).to(dtype)


def hadamard(d: int) -> torch.Tensor:
    """The dense orthonormal ``[d, d]`` float32 Hadamard matrix, ``H / sqrt(d)`` (``d`` a power of two).

    For tests and small ``d`` only (``d * d * 4`` bytes): ``rotate`` never builds it for ``d > MAX_RADIX``.
    """
    if not is_power_of_two(d):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {d}")
    return sylvester(d, 1.0 / math.sqrt(d))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` times the orthonormal Hadamard matrix ``H_d / sqrt(d)`` (its own inverse), as a new float
    tensor ``[..., d]`` in ``x``'s dtype (float32 or float64; ``d`` a power of two).

    A fast Walsh-Hadamard transform (see the module docstring): per butterfly width ``f`` (``factors(d)``, the
    last axis first), ``x`` viewed as ``[n, f, s]`` (``s``: the product of the widths already done) is multiplied
    by ``H_f`` along its middle axis; the ``1 / sqrt(d)`` is folded into the last pass's matrix. Peak memory
    beyond the input: two ``[..., d]`` buffers (one pass's input and output) and the ``[f, f]`` matrices.
    """
    d = x.shape[-1]
    widths = factors(d)
    shape = x.shape
    y = x.reshape(-1, d)
    done = 1  # the product of the widths already applied (the trailing axes of the current view)
    for n, f in enumerate(widths):
        h = sylvester(f, 1.0 / math.sqrt(d) if n == len(widths) - 1 else 1.0, y.dtype)
        # the last axis: one plain product (H_f is symmetric); else the middle axis of [rows, f, done]: H_f times
        # each [f, done] slice, a batched product
        y = y.view(-1, f) @ h if done == 1 else torch.matmul(h, y.view(-1, f, done))
        done *= f
    return y.reshape(shape)
