"""The attention function of tier-backed sparse attention, registered with transformers as ``kvshelf_tiersparse``.

A session switches the model to it for the calling context only (``hf.attention_implementation``); the session
each managed attention module belongs to is found in a ``ContextVar`` (by module ``id``), so other threads using
the model keep their attention. Modules the session does not manage (a sliding-window layer) run full attention as
the model did before (``tokenselect._full_attention``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvshelf.adapters import hf
from kvshelf.adapters.pruning.tokenselect import _full_attention

if TYPE_CHECKING:
    from kvshelf.adapters.longctx.session import SparseSession

IMPLEMENTATION = "kvshelf_tiersparse"
_MANAGED: ContextVar[dict[int, tuple[SparseSession | None, str]] | None] = ContextVar("kvshelf_tiersparse",
                                                                                    default=None)


def tiersparse_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None,
                         softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``query [1, h*g, q, d]``, ``key/value [1, h, m, d]`` (a managed layer: its in-memory sinks + tail)."""
    session, fallback = (_MANAGED.get() or {}).get(id(module), (None, "sdpa"))
    if session is None:
        return _full_attention(module, query, key, value, attention_mask, scaling, softcap, fallback, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return session.attend(int(module.layer_idx), query, key, value, scale), None


@contextmanager
def managing(model: nn.Module, session: SparseSession, modules: list[nn.Module]) -> Iterator[None]:
    """Run the block with ``modules`` attending through ``session`` (this context only)."""
    hf.register_attention(IMPLEMENTATION, tiersparse_attention, sdpa_masks=True)
    every = hf.self_attention_modules(model, some=True)
    with hf.attention_implementation(model, IMPLEMENTATION) as previous:
        managed = dict(_MANAGED.get() or {})
        managed.update({id(m): (None, previous) for m in every})
        managed.update({id(m): (session, previous) for m in modules})
        token = _MANAGED.set(managed)
        try:
            yield
        finally:
            _MANAGED.reset(token)
