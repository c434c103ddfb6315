"""The embedded store: CPU memory over LMDB under one data directory. No server needed."""

from __future__ import annotations

import math
import os
import re
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvshelf.kvstore.codec import get_codec
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction import DEFAULT_POLICY, make_policy
from kvshelf.kvstore.paths import cache_dir
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE
from kvshelf.kvstore.store import TieredStore, TierSpec
from kvshelf.kvstore.tier_registry import lmdb_url, open_tier

if TYPE_CHECKING:
    from kvshelf.kvstore.vllm_events import KVEventsSettings

DEFAULT_MEMORY_BYTES = 2 << 30
MAX_SIZE_BYTES = 1 << 60  # 1 EiB: a larger size is a typo, never a capacity
MIN_DISK_BYTES = 1 << 20  # the smallest disk capacity (LMDB's own pages come on top, in the tier's slack)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
          "tib": 1 << 40, "p": 1 << 50, "pb": 1000**5, "pib": 1 << 50, "e": 1 << 60, "eb": 1000**6, "eib": 1 << 60}
_SIZE = re.compile(r"\s*(-?)(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | float | str, setting: str = "size") -> int:
    """``"512MiB"``, ``"2G"``, ``"1000000"`` or an int -> bytes; errors start with ``setting``.

    A size is a whole number of bytes in ``[0, 1 EiB]``. A fraction is accepted only with a unit larger than a
    byte (``"1.5GiB"``) and is rounded down to whole bytes (an amount that rounds down to 0 is refused); a bare
    ``"1.5"``, a non-integral float, a bool, NaN, infinity, a negative or a larger size is a ``ConfigError``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{setting}: {value!r} is not a size; use a number of bytes or e.g. '512MiB', '2GiB'")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(f"{setting}: {value!r} is not a whole number of bytes")
        value = int(value)
    if isinstance(value, int):
        amount, negative = Fraction(abs(value)), value < 0
    else:
        match = _SIZE.fullmatch(value)
        if not match or match.group(3).lower() not in _UNITS:
            raise ConfigError(f"{setting}: cannot read size {value!r}; use a number of bytes or e.g. '512MiB', '2GiB'")
        sign, number, unit = match.group(1), match.group(2), _UNITS[match.group(3).lower()]
        if len(number) > 30:
            raise ConfigError(f"{setting}: size {value[:40]!r}... is too large (at most 1 EiB)")
        if "." in number and unit == 1:
            raise ConfigError(f"{setting}: {value!r} is not a whole number of bytes (a fraction needs a unit, "
                              "e.g. '1.5GiB')")
        amount, negative = Fraction(number) * unit, sign == "-" and Fraction(number) != 0
    if negative:
        raise ConfigError(f"{setting}: size {value!r} is negative")
    if amount > MAX_SIZE_BYTES:
        raise ConfigError(f"{setting}: size {value!r} is too large (at most {MAX_SIZE_BYTES} bytes, 1 EiB)")
    if 0 < amount < 1:
        raise ConfigError(f"{setting}: size {value!r} is less than one byte")
    return math.floor(amount)


def default_data_dir() -> Path:
    """``$KVSHELF_DATA_DIR``, else ``store`` under the kvshelf cache (``kvstore.paths.cache_dir``)."""
    override = os.environ.get("KVSHELF_DATA_DIR", "")
    return Path(override).expanduser() if override else cache_dir() / "store"


def open_embedded_store(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    memory_bytes: int | str | None = DEFAULT_MEMORY_BYTES,
    memory_codec: str = "raw",
    disk_codec: str = "raw",
    disk_codec_params: dict[str, Any] | None = None,
    max_disk_bytes: int | str = 1 << 40,
    durable: bool = True,
    sync_interval_s: float | None = None,
    write_policy: Literal["through", "back"] = "through",
    namespace: str = DEFAULT_NAMESPACE,
    eviction_policy: str = DEFAULT_POLICY,
    kv_events: KVEventsSettings | None = None,
    gpu_bytes: int | str | None = None,
    device: str = "cuda",
    pin_memory: bool | None = None,
) -> TieredStore:
    """A ``TieredStore`` of a memory tier (omitted when ``memory_bytes`` is None) over LMDB in ``data_dir``;
    reads default to ``namespace``. ``eviction_policy`` (a name of ``kvstore.eviction.POLICIES``) picks what
    each bounded tier evicts.

    ``durable``: each commit to LMDB is flushed to the disk before the put returns; ``False``: commits reach the
    operating system before the put returns (a crash of this process loses nothing) and are flushed every
    ``sync_interval_s`` seconds when given (``kvstore.periodic_sync``), else when the OS writes them back.

    ``max_disk_bytes`` is the LMDB tier's capacity: it holds at most that many bytes of blocks and evicts (by
    ``eviction_policy``) to stay under it; its file stays under the capacity plus a slack for LMDB's own pages
    (``kvstore.lmdb_tier.lmdb_slack_bytes``: 39.25 MiB for 256 MiB, ~2.7% for 1 TiB). (Before, it was only a
    size limit: past it every put failed with ``StoreFullError``.)

    ``gpu_bytes``: a GPU tier of that many bytes of decoded blocks on ``device`` above the memory tier
    (``kvstore.device_tier``; a ``ConfigError`` when ``device`` is a CUDA device this machine lacks). ``pin_memory``:
    the memory tier keeps its values in page-locked memory, which a GPU reads by DMA
    (``kvstore.pinned_memory``); default: when the GPU tier is on CUDA.

    ``kv_events``: publish the store's block events in vLLM's format over ZeroMQ (``kvstore.vllm_events``); the
    publisher closes with the store. An endpoint in use is a ``ConfigError`` before anything is opened.

    The tiers come from the tier registry (``kvstore.tier_registry``: ``memory://`` and ``lmdb://``), as those of
    ``kvshelf serve`` do.

    Raises ``TierDamagedError`` (naming the path and the recovery) when ``data_dir/lmdb`` is damaged: salvage it
    with ``kvshelf repair`` (``kvstore.lmdb_tier.repair``) or move it aside (``lmdb_tier.repair.move_aside``)."""
    path = Path(data_dir) if data_dir is not None else default_data_dir()
    get_codec(memory_codec)  # check the codecs before anything is opened
    get_codec(disk_codec, disk_codec_params)
    make_policy(eviction_policy, 1)  # an unknown name fails before anything is opened
    memory = None if memory_bytes is None else parse_size(memory_bytes, "memory_bytes")
    if memory == 0:
        raise ConfigError("memory_bytes: must be > 0 (None: no memory tier)")
    max_disk = parse_size(max_disk_bytes, "max_disk_bytes")
    if max_disk < MIN_DISK_BYTES:
        raise ConfigError(f"max_disk_bytes: {max_disk_bytes!r} is below the minimum disk capacity of "
                          f"{MIN_DISK_BYTES} bytes (1 MiB)")
    gpu = None
    if gpu_bytes is not None:
        from kvshelf.kvstore.device_tier import DeviceTier

        gpu = DeviceTier(parse_size(gpu_bytes, "gpu_bytes"), device, policy=eviction_policy)
    if pin_memory is None:
        pin_memory = gpu is not None and gpu.device.type == "cuda"
    publisher = None
    if kv_events is not None:
        from kvshelf.kvstore.vllm_events import VLLMEventPublisher

        publisher = VLLMEventPublisher(kv_events)
    try:
        specs: list[TierSpec] = []
        if memory is not None:
            specs.append(TierSpec(open_tier("memory://", capacity_bytes=memory, policy=eviction_policy,
                                            pinned=pin_memory), memory_codec))
        disk = open_tier(lmdb_url(path / "lmdb"), capacity_bytes=max_disk, policy=eviction_policy, durable=durable,
                         sync_interval_s=sync_interval_s)
        specs.append(TierSpec(disk, disk_codec, dict(disk_codec_params or {})))
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    store = TieredStore(specs, write_policy=write_policy, namespace=namespace, device_tier=gpu)
    if publisher is not None:
        store.on_close(publisher.attach(store).close)
    return store
