"""The embedded store: CPU memory over LMDB under one data directory. No server needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvshelf.kvstore.codec import get_codec
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.eviction import DEFAULT_POLICY, make_policy
from kvshelf.kvstore.paths import cache_dir
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE
from kvshelf.kvstore.sizes import parse_size
from kvshelf.kvstore.store import TieredStore, TierSpec
from kvshelf.kvstore.tier_registry import lmdb_url, open_tier

if TYPE_CHECKING:
    from kvshelf.kvstore.device_tier import DeviceTier
    from kvshelf.kvstore.vllm_events import KVEventsSettings

DEFAULT_MEMORY_BYTES = 2 << 30
MIN_DISK_BYTES = 1 << 20  # the smallest disk capacity (LMDB's own pages come on top, in the tier's slack)


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
    (``kvstore.lmdb_tier.lmdb_slack_bytes``: 39.25 MiB for 256 MiB, ~2.7% for 1 TiB).

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
    max_disk = _disk_capacity(max_disk_bytes)
    gpu = _gpu_tier(gpu_bytes, device, eviction_policy)
    if pin_memory is None:
        pin_memory = gpu is not None and gpu.device.type == "cuda"
    publisher = None
    if kv_events is not None:
        from kvshelf.kvstore.vllm_events import VLLMEventPublisher

        publisher = VLLMEventPublisher(kv_events)
    try:
        specs = [TierSpec(open_tier("memory://", capacity_bytes=memory, policy=eviction_policy, pinned=pin_memory),
                          memory_codec)] if memory is not None else []
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


def _disk_capacity(max_disk_bytes: int | str) -> int:
    max_disk = parse_size(max_disk_bytes, "max_disk_bytes")
    if max_disk < MIN_DISK_BYTES:
        raise ConfigError(f"max_disk_bytes: {max_disk_bytes!r} is below the minimum disk capacity of "
                          f"{MIN_DISK_BYTES} bytes (1 MiB)")
    return max_disk


def _gpu_tier(gpu_bytes: int | str | None, device: str, policy: str) -> DeviceTier | None:
    """The GPU tier of ``gpu_bytes`` on ``device`` (None without ``gpu_bytes``); torch is imported only for one."""
    if gpu_bytes is None:
        return None
    from kvshelf.kvstore.device_tier import DeviceTier

    return DeviceTier(parse_size(gpu_bytes, "gpu_bytes"), device, policy=policy)
