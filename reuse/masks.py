"""Additive attention masks over a *layout*: the assembled context's rows in position order.

Every mask here is ``[1, 1, queries, kv_len]`` in the model's float dtype: 0 where a query may attend, the dtype's
minimum where it may not, plus an optional per-column bias (APE's log-scale on chunk columns). HF attention
(eager and SDPA) accepts such a 4-D mask as is. ``rows`` are the layout indices of the query tokens.
"""

from __future__ import annotations

import torch

PREFIX = -1  # a segment every row may see (the shared prefix)
GLOBAL = -2  # a row that sees every earlier row (the question / last block)


def causal_mask(
    rows: torch.Tensor, kv_len: int, dtype: torch.dtype = torch.float32, column_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Query at layout row ``r`` sees rows ``<= r``. ``rows``: ``[q]`` long; ``column_bias``: ``[kv_len]``."""
    cols = torch.arange(kv_len)
    allowed = cols[None, :] <= rows[:, None]  # [q, kv]
    return _additive(allowed, dtype, column_bias)


def block_mask(
    rows: torch.Tensor, segments: torch.Tensor, dtype: torch.dtype = torch.float32,
    column_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-Attention (Sun et al. 2024): a row sees earlier rows of its own block and the shared prefix; a
    ``GLOBAL`` row (the last block: the question) sees every earlier row.

    ``segments``: ``[kv_len]`` long, per layout row: ``PREFIX``, ``GLOBAL`` or a block id ``>= 0``.
    """
    kv_len = segments.shape[0]
    cols = torch.arange(kv_len)
    seg_q = segments[rows][:, None]
    seg_k = segments[None, :]
    visible = (seg_k == PREFIX) | (seg_k == seg_q) | (seg_q == GLOBAL)
    allowed = (cols[None, :] <= rows[:, None]) & visible
    return _additive(allowed, dtype, column_bias)


def _additive(allowed: torch.Tensor, dtype: torch.dtype, column_bias: torch.Tensor | None) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype)
    if column_bias is not None:
        mask = mask + column_bias.to(dtype)[None, :]
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
