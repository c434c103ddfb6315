"""The name a person knows a model by, carried in the blocks it makes (``MODEL_NAME_EXTRA``) so that a server's
dashboard and stats can show ``smollm2-135m`` where the key material only has a fingerprint."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.keys import MODEL_NAME_EXTRA

#: a label longer than this is cut (a path or an id is never that long in practice)
MAX_LABEL_CHARS = 80


def model_label(model: Any) -> str:
    """The model's name: the folder it was loaded from (``smollm2-135m`` for the bundled model's converted copy,
    ``org/name`` for a HF id), else its ``model_type`` (a model built from a config), else its class name."""
    config = getattr(model, "config", None)
    source = str(getattr(config, "_name_or_path", "") or "").strip()
    if source:
        parts = PurePath(source).parts
        is_hub_id = len(parts) == 2 and not source.startswith(("/", ".", "~"))
        label = source if is_hub_id else parts[-1]
    else:
        label = str(getattr(config, "model_type", "") or type(model).__name__)
    return "".join(c for c in label if c.isprintable())[:MAX_LABEL_CHARS] or type(model).__name__


def label_blocks(blocks: list[KVBlock], model: Any) -> list[KVBlock]:
    """Name ``model`` in each block's header (``MODEL_NAME_EXTRA``), unless a block names one already."""
    label = model_label(model)
    for block in blocks:
        block.extra.setdefault(MODEL_NAME_EXTRA, label)
    return blocks
