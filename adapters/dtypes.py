"""The model dtypes kvshelf's commands accept by name: torch only (a command checks one before transformers
loads)."""

from __future__ import annotations

import torch

from kvshelf.kvstore.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype ``dtype`` names (a ``ModelLoadError`` listing the names for an unknown one)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]
