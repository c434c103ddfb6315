"""Recurrent-state snapshots of hybrid models, as their own stored records.

Layers whose cache is a state rather than per-token KV (gated delta-net / linear attention, Mamba SSM and conv
state, short convolutions) cannot be rebuilt from blocks: a prefix hit needs the blocks up to a boundary *and*
the state exactly after that boundary's last token. That state is saved at chosen block boundaries as a record of
its own, keyed ``keys.state_key(boundary_block_key)``.

Record format: the state travels in the block's encoded form (``kvstore.encoding``: magic, version, JSON header
with codec name and parameters, shapes, dtype, model fingerprint, namespace, the record's own key; payload;
xxh3 checksum over both), so every tier, the remote store and the codec registry carry it unchanged, and a
damaged, truncated or foreign record is detected as a block is. The tensors of every state (per state layer:
conv then recurrent state, per state index) are flattened in the widest dtype among them and split in two halves,
the block's ``keys`` and ``values`` ``[rows, heads, 1, width]`` (zero padded). ``extra[STATE_EXTRA]`` is the
layout, JSON: ``{"v": 1, "tokens": boundary, "numel": n, "entries": [[layer, kind, index, shape, dtype], ...]}``;
``token_ids`` holds the boundary's last token and ``start_pos`` its position. A record without a valid layout
(``CorruptBlockError``) is a miss, never a state.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import CorruptBlockError

#: the ``KVBlock.extra`` entry holding a snapshot record's layout
STATE_EXTRA = "kvshelf.state"
STATE_FORMAT = 1
_WIDTH = 1024  # elements per row of the packed record (<= limits.MAX_HEAD_DIM)
_HEADS = 1024  # rows per "layer" of the packed record (<= limits.MAX_KV_HEADS)
KINDS = ("conv", "recurrent")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class StateEntry:
    """Where one state tensor lives in a model's cache: layer index, ``"conv"`` or ``"recurrent"``, state index,
    shape (batch first) and dtype name."""

    layer: int
    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class StateSnapshot:
    """The recurrent state of every state layer after ``tokens`` tokens: ``tensors[i]`` is ``entries[i]``'s."""

    tokens: int
    entries: tuple[StateEntry, ...]
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layout(self) -> tuple[tuple[int, str, int, tuple[int, ...], str], ...]:
        """The entries as plain tuples (compared against the model's expected layout)."""
        return tuple((e.layer, e.kind, e.index, e.shape, e.dtype) for e in self.entries)


def _packed_dtype(tensors: tuple[torch.Tensor, ...]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        if dtype in dtypes:
            if dtypes <= {dtype} or dtype in (torch.float64, torch.float32):
                return dtype
            return torch.float32  # bf16 with fp16: both fit fp32 exactly
    raise CorruptBlockError(f"state tensors of dtypes {sorted(map(str, dtypes))} cannot be packed")


def pack(snapshot: StateSnapshot, *, last_token: int, fingerprint: str, namespace: str) -> KVBlock:
    """The snapshot as a record in block form (see the module docstring). Copies to the CPU."""
    if not snapshot.tensors or snapshot.tokens < 1:
        raise CorruptBlockError("an empty snapshot, or one before any token, is not stored")
    dtype = _packed_dtype(snapshot.tensors)
    flat = torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=dtype) for t in snapshot.tensors])
    n = flat.numel()
    half = -(-n // 2)
    width = min(_WIDTH, half)
    rows = -(-half // width)
    heads = min(rows, _HEADS)
    layers = -(-rows // heads)
    per = layers * heads * width
    padded = torch.zeros(2 * per, dtype=dtype)
    padded[:n] = flat
    layout = {"v": STATE_FORMAT, "tokens": snapshot.tokens, "numel": n,
              "entries": [[e.layer, e.kind, e.index, list(e.shape), e.dtype] for e in snapshot.entries]}
    keys, values = padded[:per].view(layers, heads, 1, width), padded[per:].view(layers, heads, 1, width)
    return KVBlock(keys, values, (int(last_token),), snapshot.tokens - 1, fingerprint, namespace,
                   extra={STATE_EXTRA: json.dumps(layout, separators=(",", ":"))})


def unpack(block: KVBlock) -> StateSnapshot:
    """The snapshot a record holds; ``CorruptBlockError`` for a record without a consistent layout."""
    raw = block.extra.get(STATE_EXTRA)
    if not isinstance(raw, str):
        raise CorruptBlockError("the record has no state layout: not a state snapshot")
    try:
        layout = json.loads(raw)
        if layout.get("v") != STATE_FORMAT:
            raise CorruptBlockError(f"state layout version {layout.get('v')!r} is not {STATE_FORMAT}")
        tokens, n = int(layout["tokens"]), int(layout["numel"])
        entries = tuple(
            StateEntry(int(layer), str(kind), int(index), tuple(int(d) for d in shape), str(dtype))
            for layer, kind, index, shape, dtype in layout["entries"]
        )
    except CorruptBlockError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CorruptBlockError(f"malformed state layout: {exc}") from exc
    for entry in entries:
        if entry.kind not in KINDS or entry.dtype not in _DTYPES or any(d < 0 for d in entry.shape):
            raise CorruptBlockError(f"malformed state layout entry {entry}")
    total = block.keys.numel() + block.values.numel()
    if sum(e.numel for e in entries) != n or not 0 < n <= total or tokens != block.start_pos + 1:
        raise CorruptBlockError(f"the state layout ({n} elements at token {tokens}) does not match its record "
                            f"({total} elements at position {block.start_pos})")
    flat = torch.cat([block.keys.reshape(-1), block.values.reshape(-1)])[:n]
    tensors, at = [], 0
    for entry in entries:
        tensors.append(flat[at:at + entry.numel].view(entry.shape).to(_DTYPES[entry.dtype]).clone())
        at += entry.numel
    return StateSnapshot(tokens, entries, tuple(tensors))


def dtype_name(dtype: torch.dtype) -> str:
    """The layout's name of a state dtype; ``CorruptBlockError`` for a dtype a record cannot hold."""
    if dtype not in _NAMES:
        raise CorruptBlockError(f"state dtype {dtype} cannot be stored")
    return _NAMES[dtype]
