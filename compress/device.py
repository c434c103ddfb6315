"""Moving a codec's compact payload to the device of the destination tensors (the codecs' portable decode path).

A codec whose decode runs where its output lives (``kivi``'s dequantization, ``xquant``'s rematerialization)
sends only its compact payload to that device: packed codes, fp16 scales and zero points, int8 symbol matrices.
``upload`` gathers a run's buffers into one host staging buffer (page-locked when CUDA is present, so the copy is
``non_blocking``) and sends it in one copy; the device then unpacks and decodes with torch ops.

Staging buffers are per thread, two of them used in turn (``slot``), so a thread fills the next while the device
still copies the last; before a buffer is written again the thread waits on the event recorded after its copy.
On the CPU (``portable`` chosen by a test) the same code runs: the "device" copy is the staging buffer itself.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

#: staging buffers up to this size are kept per thread (two of them); larger runs are cut by the codecs into
#: pieces of at most this many bytes (``kivi``: whole blocks; ``xquant``: whole layers)
STAGING_BYTES = 64 << 20
_THREADED_COPY = 1 << 20  # parts from this size are copied into the staging buffer by torch (threaded)
_ALIGN = 64  # each part starts at a multiple of this in the staging buffer: ``view(dtype)`` needs it aligned
_LOCAL = threading.local()


def portable(out: torch.Tensor, prefer_portable: bool = False) -> bool:
    """Whether a decode into ``out`` takes the portable torch path: any device but the CPU, or when asked."""
    return prefer_portable or out.device.type != "cpu"


def pinned_staging() -> bool:
    """Whether staging buffers are page-locked (``pin_memory``): only where CUDA is available."""
    return torch.cuda.is_available()


def _host_buffer(nbytes: int, slot: int, device: torch.device) -> torch.Tensor:
    """This thread's staging buffer ``slot`` (0 or 1) of at least ``nbytes`` (uint8), free to write: the device
    copy that last read it has completed. Larger than ``STAGING_BYTES``: a fresh buffer, not kept."""
    kept: dict[int, tuple[torch.Tensor | None, object | None]] = getattr(_LOCAL, "buffers", None) or {}
    _LOCAL.buffers = kept
    buffer, event = kept.get(slot, (None, None))
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]
        kept[slot] = (buffer, None)
    if buffer is not None and buffer.numel() >= nbytes:
        return buffer
    pin = pinned_staging() and device.type == "cuda"
    size = max(nbytes, 1 << 20) if nbytes <= STAGING_BYTES else nbytes
    with torch.inference_mode(False):  # a normal tensor: kept buffers are written in and out of inference mode
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    if nbytes <= STAGING_BYTES:
        kept[slot] = (buffer, None)
    return buffer


def _record(slot: int, device: torch.device) -> None:
    """Mark staging buffer ``slot`` busy until the copy just queued on ``device``'s current stream completes."""
    if device.type != "cuda":
        return
    kept = _LOCAL.buffers
    if slot in kept:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        kept[slot] = (kept[slot][0], event)


def _as_bytes(part: object) -> np.ndarray:
    """A flat uint8 numpy view of a byte buffer, numpy array or CPU tensor (no copy)."""
    if isinstance(part, torch.Tensor):
        part = part.detach().contiguous().numpy() if part.numel() else np.empty(0, np.uint8)
    if isinstance(part, np.ndarray):
        return np.ascontiguousarray(part).reshape(-1).view(np.uint8)
    return np.frombuffer(part, dtype=np.uint8) if len(part) else np.empty(0, np.uint8)  # type: ignore[arg-type]


def upload(parts: Sequence[object], device: torch.device | str, slot: int = 0) -> list[torch.Tensor]:
    """Send ``parts`` to ``device`` in one copy; returns each part as a flat uint8 tensor on ``device``
    (``.view(dtype)`` reads it in its own dtype: every part starts aligned).

    A part is a byte buffer, a numpy array or a CPU tensor, or a list of them, sent back to back as one part (the
    same section of several blocks: one tensor ``[blocks * bytes]`` on the device).

    The parts are copied into this thread's staging buffer ``slot`` (page-locked where CUDA is available), then
    sent with ``non_blocking=True``; on the CPU the results are views of the staging buffer, valid until this
    thread's next ``upload`` to the same slot.
    """
    device = torch.device(device)
    pieces = [[_as_bytes(q) for q in p] if isinstance(p, (list, tuple)) else [_as_bytes(p)] for p in parts]
    offsets, sizes, total = [], [], 0
    for piece in pieces:
        size = sum(a.size for a in piece)
        offsets.append(total)
        sizes.append(size)
        total += -(-size // _ALIGN) * _ALIGN
    host = _host_buffer(total, slot, device)
    view = host.numpy()
    for piece, off in zip(pieces, offsets, strict=True):
        for a in piece:
            if a.size >= _THREADED_COPY:  # torch's copy runs on its threads: several GB/s more than one
                host[off : off + a.size].copy_(torch.from_numpy(a))
            else:
                view[off : off + a.size] = a
            off += a.size
    staged = host[:total]
    if device.type == "cpu":
        moved = staged
    else:
        moved = staged.to(device, non_blocking=staged.is_pinned())
        _record(slot, device)
    return [moved[off : off + size] for off, size in zip(offsets, sizes, strict=True)]


def typed(flat: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A flat uint8 tensor from ``upload`` read as ``dtype`` in ``shape``."""
    if flat.numel() == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=flat.device)
    return flat.view(dtype).view(tuple(shape))


def unpack_bits(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """``compress.bitpack.unpack_bits`` with torch ops on ``packed``'s device: the ``count`` codes of ``bits``
    bits (1, 2, 4 or 8; little-endian within each byte) held in the last axis of uint8 ``packed``
    (``[..., bytes]``), as uint8 ``[..., count]``."""
    if bits == 8:
        return packed[..., :count]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., bytes, 8 // bits]
    return codes.flatten(-2)[..., :count]
