"""The embedded store: CPU memory over LMDB under one data directory. No server needed."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from kvshelf.kvstore.codec import get_codec
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.lmdb_tier import LMDBTier
from kvshelf.kvstore.memory_tier import MemoryTier
from kvshelf.kvstore.paths import cache_dir
from kvshelf.kvstore.protocol import DEFAULT_NAMESPACE
from kvshelf.kvstore.store import TieredStore, TierSpec

DEFAULT_MEMORY_BYTES = 2 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
          "tib": 1 << 40}


def parse_size(value: int | str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1000000"`` or an int -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read size {value!r}; use a number of bytes or e.g. '512MiB', '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
    write_policy: Literal["through", "back"] = "through",
    namespace: str = DEFAULT_NAMESPACE,
) -> TieredStore:
    """A ``TieredStore`` of a memory tier (omitted when ``memory_bytes`` is None) over LMDB in ``data_dir``;
    reads default to ``namespace``."""
    path = Path(data_dir) if data_dir is not None else default_data_dir()
    get_codec(memory_codec)  # check the codecs before anything is opened
    get_codec(disk_codec, disk_codec_params)
    specs: list[TierSpec] = []
    if memory_bytes is not None:
        specs.append(TierSpec(MemoryTier(parse_size(memory_bytes)), memory_codec))
    max_disk = parse_size(max_disk_bytes)
    specs.append(
        TierSpec(
            LMDBTier(path / "lmdb", max_map_bytes=max_disk, initial_map_bytes=min(256 << 20, max_disk),
                     durable=durable),
            disk_codec,
            dict(disk_codec_params or {}),
        )
    )
    return TieredStore(specs, write_policy=write_policy, namespace=namespace)
