"""``kvshelf serve``: configuration (flags > ``KVSHELF_*`` environment > TOML file > defaults) and the
server's lifecycle (SIGTERM/SIGINT: stop accepting, drain in-flight calls for a grace period, close the
store, exit 0).

The TOML file holds the same settings as the flags, with ``_`` or ``-``, at top level or under ``[serve]``::

    listen = "0.0.0.0:50051"
    data_dir = "/var/lib/kvshelf"
    memory = "8GiB"
    redis = "redis://cache:6379/0"
    tokens_file = "/etc/kvshelf/tokens.toml"
    quota = "50GiB"
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshelf.kvstore.embedded import MIN_DISK_BYTES, default_data_dir, open_embedded_store, parse_size
from kvshelf.kvstore.errors import ConfigError, TierDamagedError
from kvshelf.kvstore.eviction import DEFAULT_POLICY, make_policy
from kvshelf.kvstore.lmdb_tier.repair import move_aside
from kvshelf.kvstore.store import TieredStore, TierSpec

log = logging.getLogger(__name__)
ENV_PREFIX = "KVSHELF_"


@dataclass(frozen=True)
class ServeConfig:
    """Every setting of ``kvshelf serve`` (sizes accept ``"512MiB"``-style strings)."""

    listen: str = "127.0.0.1:50051"
    data_dir: str = ""  # "" -> $KVSHELF_DATA_DIR, else $KVSHELF_CACHE/store (~/.cache/kvshelf/store)
    memory: str = "2GiB"  # memory tier capacity; "0" disables it
    max_disk: str = "1TiB"
    disk_codec: str = ""  # "": every tier keeps blocks as clients sent them; a codec: LMDB and Redis re-encode
    eviction_policy: str = DEFAULT_POLICY  # what the memory and LMDB tiers evict (kvstore.eviction.POLICIES)
    redis: str = ""  # redis://host:port/db or redis+cluster://host:port: adds the shared tier
    tokens_file: str = ""  # TOML [tokens] "token" = "namespace"; empty: dev mode (namespace from the request)
    tls_cert: str = ""
    tls_key: str = ""
    max_block: str = "256MiB"
    max_call: str = "1GiB"
    quota: str = ""  # per-namespace byte quota; empty: unlimited
    grace: float = 10.0  # seconds to drain in-flight calls on SIGTERM
    workers: int = 32
    metrics_port: int = 0  # Prometheus /metrics on this port; 0: off
    metrics_addr: str = "127.0.0.1"
    history_interval: float = 10.0  # seconds between the stats-history samples `kvshelf stats --plot` draws
    shared_memory: bool = True  # same-host gets through client arenas in /dev/shm (loopback/Unix peers only)
    tenant_streams: int = 8  # streaming calls (PutBlocks, GetBlocks) one tenant may have open at once
    idle_timeout: float = 10.0  # seconds a stream may make no progress before the server cancels it
    min_rate: str = "1MiB"  # slowest accepted PutBlocks upload, bytes per second (checked after idle_timeout)
    max_inflight: str = ""  # put bytes buffered at once, all tenants together; empty: 2 x max_call
    strike_burst: int = 20  # failed calls (the client's fault) at which a tenant's streams are refused; 0: never
    strike_rate: float = 5.0  # failed calls per second a tenant is forgiven (service/strikes.py)
    redis_timeout: float = 1.0  # seconds one Redis call may take before the tier counts as unreachable
    metrics_token_file: str = ""  # file holding the bearer token /metrics requires; empty: no token
    metrics_namespaces: str = ""  # comma-separated namespaces /metrics shows; empty: every namespace
    reset_disk: bool = False  # a damaged LMDB environment is moved aside and a new empty one started
    arena_sweep_interval: float = 30.0  # seconds between sweeps of dead clients' /dev/shm arenas (shared_memory)
    events_log: str = "64MiB"  # bound of the KV event log in DATA_DIR/events (how far back a replay reaches)
    max_subscriptions: int = 8  # SubscribeEvents streams open at once, all tenants (each has a thread of its own)
    tenant_subscriptions: int = 2  # SubscribeEvents streams one tenant may have open at once
    subscriber_queue: int = 10_000  # events waiting for one subscriber before it is cut off as too slow
    durability: str = "fsync"  # fsync: each put flushed to disk before it is acknowledged; interval: see DURABILITY
    sync_interval: float = 1.0  # seconds between flushes to disk with durability "interval"

    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir) if self.data_dir else default_data_dir()


#: ``--durability``: what an acknowledged put survives. ``fsync``: anything (power cut included): each put's commit is
#: flushed to the disk before the put returns. ``interval``: a crash or SIGKILL of the server (the commit is in the
#: operating system before the put returns); the disk is flushed every ``--sync-interval`` seconds, so an OS crash
#: or power cut loses at most that many seconds of puts (lost blocks are misses; the file is checked at open).
DURABILITY = ("fsync", "interval")

FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}
# the size settings and the least each accepts; quota and max_inflight may also be "" (unset)
SIZE_SETTINGS = {"memory": 0, "max_disk": MIN_DISK_BYTES, "max_block": 1, "max_call": 1, "quota": 1, "min_rate": 0,
                 "max_inflight": 1, "events_log": 4096}
_UNSET_ALLOWED = ("quota", "max_inflight")


def size_setting(name: str, value: Any, label: str | None = None) -> int | None:
    """The size setting ``name`` in bytes (None when unset and allowed); a ``ConfigError`` starting with
    ``label`` (default ``--name``) when it is not a size or below the least the setting accepts."""
    label = label or f"--{name.replace('_', '-')}"
    if name in _UNSET_ALLOWED and str(value).strip() == "":
        return None
    size = parse_size(value if isinstance(value, int | float) and not isinstance(value, bool) else str(value), label)
    if size < SIZE_SETTINGS[name]:
        raise ConfigError(f"{label}: {value!r} is too small (at least {SIZE_SETTINGS[name]} bytes)")
    return size


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = type(getattr(ServeConfig(), name))
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{source}: {name} must be true or false, got {value!r}")
    try:
        if kind is float:
            return float(value)
        if kind is int:
            return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {name} must be a number, got {value!r}") from None
    if name in SIZE_SETTINGS:
        size_setting(name, value, source if source.startswith(("--", "$")) else f"{source}: {name}")
    return str(value)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML file (top level or ``[serve]``); unknown keys are errors."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    data = data.get("serve", data)
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"config file {path}: unknown setting {key!r}; known: {', '.join(FIELDS)}")
        out[name] = _coerce(name, value, str(path))
    return out


def load_config(flags: Mapping[str, Any], env: Mapping[str, str] | None = None,
                config_file: str | Path | None = None) -> ServeConfig:
    """Merge the sources: ``flags`` (None values = not given) > ``KVSHELF_<NAME>`` in ``env`` > the TOML file
    (``config_file``, else ``$KVSHELF_CONFIG``) > defaults."""
    env = os.environ if env is None else env
    config_file = config_file or env.get(f"{ENV_PREFIX}CONFIG") or None
    merged: dict[str, Any] = read_config_file(config_file) if config_file else {}
    for name in FIELDS:
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None and value != "":
            merged[name] = _coerce(name, value, f"${ENV_PREFIX}{name.upper()}")
    for name, value in flags.items():
        if name not in FIELDS:
            raise ConfigError(f"unknown setting {name!r}")
        if value is not None:
            merged[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    config = ServeConfig(**merged)
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    if config.grace < 0 or config.workers < 1:
        raise ConfigError("grace must be >= 0 and workers >= 1")
    if config.tenant_streams < 1 or config.idle_timeout <= 0 or config.redis_timeout <= 0:
        raise ConfigError("tenant_streams must be >= 1, idle_timeout and redis_timeout > 0")
    make_policy(config.eviction_policy, 1)  # an unknown name: ConfigError listing the known ones
    if config.strike_burst < 0 or config.strike_rate <= 0:
        raise ConfigError("strike_burst must be >= 0 (0: off) and strike_rate > 0")
    if not 0 <= config.metrics_port < 65536 or config.history_interval <= 0:
        raise ConfigError("metrics_port must be in [0, 65535] and history_interval > 0")
    if min(config.max_subscriptions, config.tenant_subscriptions, config.subscriber_queue) < 1:
        raise ConfigError("max_subscriptions, tenant_subscriptions and subscriber_queue must be >= 1")
    if not 0 < config.arena_sweep_interval < float("inf"):
        raise ConfigError(f"arena_sweep_interval must be > 0 seconds, got {config.arena_sweep_interval!r}")
    if config.durability not in DURABILITY:
        raise ConfigError(f"durability must be one of {', '.join(DURABILITY)}, got {config.durability!r}")
    if not 0 < config.sync_interval < float("inf"):
        raise ConfigError(f"sync_interval must be > 0 seconds, got {config.sync_interval!r}")
    return config


def open_store(config: ServeConfig) -> TieredStore:
    """CPU memory + LMDB under the data directory, plus Redis when ``config.redis`` is set.

    The tiers keep blocks in the codec their clients sent them in (``TierSpec.as_sent``: the server never decodes
    them; clients decode); with ``config.disk_codec`` set, the LMDB and Redis tiers re-encode into it instead."""
    store = _open_embedded(config)
    *memory, disk = store.specs  # the memory tier (if any) always as sent; LMDB unless the operator named its codec
    for spec in memory:
        spec.as_sent = True
    disk.as_sent = not config.disk_codec
    if not config.redis:
        return store
    return _with_redis(store, config)


def _open_embedded(config: ServeConfig) -> TieredStore:
    memory = size_setting("memory", config.memory)
    disk_codec = config.disk_codec or "raw"
    durable = config.durability == "fsync"
    sync_interval_s = None if durable else config.sync_interval
    try:
        store = open_embedded_store(config.resolved_data_dir(), memory_bytes=memory or None,
                                    disk_codec=disk_codec, max_disk_bytes=config.max_disk,
                                    eviction_policy=config.eviction_policy, durable=durable,
                                    sync_interval_s=sync_interval_s)
    except TierDamagedError as exc:
        if not config.reset_disk:
            raise
        moved = move_aside(config.resolved_data_dir() / "lmdb")
        log.warning("--reset-disk: the damaged LMDB environment was moved to %s (kept, never deleted) and a new "
                    "empty one started; the damage: %s", moved, str(exc).split("; recover with", 1)[0])
        store = open_embedded_store(config.resolved_data_dir(), memory_bytes=memory or None,
                                    disk_codec=disk_codec, max_disk_bytes=config.max_disk,
                                    eviction_policy=config.eviction_policy, durable=durable,
                                    sync_interval_s=sync_interval_s)
    return store


def _with_redis(store: TieredStore, config: ServeConfig) -> TieredStore:
    if not config.redis.startswith(("redis://", "rediss://", "redis+cluster://")):
        store.close()
        raise ConfigError(f"--redis must be a redis:// or redis+cluster:// URL, got {config.redis!r}")
    try:
        from kvshelf.kvstore.redis_tier import DEFAULT_MAX_VALUE_BYTES, RedisTier
    except ImportError as exc:
        store.close()
        raise ConfigError(f"--redis needs the Redis tier (kvstore.redis_tier): {exc}") from exc
    try:
        # every Redis call bounded by --redis-timeout; values up to 4 blocks' worth (a block re-encoded by the
        # tier's codec may grow), at least 1 GiB: larger manifests are damage
        max_block = size_setting("max_block", config.max_block) or 0
        redis = RedisTier.from_url(config.redis, socket_timeout=config.redis_timeout,
                                   max_value_bytes=max(DEFAULT_MAX_VALUE_BYTES, 4 * max_block))
    except ConfigError:
        store.close()
        raise
    return TieredStore([*store.specs, TierSpec(redis, config.disk_codec or "raw", as_sent=not config.disk_codec)],
                       write_policy=store.write_policy)


def serve(config: ServeConfig, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> int:
    """Run the server until SIGTERM/SIGINT (or ``stop`` is set); return the exit code (0).

    Prints ``kvshelf serving on HOST:PORT`` once it accepts calls (the real port when ``listen`` ends in :0).
    """
    from kvshelf.service.allocator import keep_large_buffers
    from kvshelf.service.arena import ArenaSweeper, shared_memory_supported
    from kvshelf.service.auth import TokenTable
    from kvshelf.service.history import StatsHistory
    from kvshelf.service.metrics import check_metrics_access, parse_namespaces, read_token_file, serve_metrics
    from kvshelf.service.server import ServerLimits, start_server

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_large_buffers()  # reuse freed message buffers instead of faulting in fresh pages (service/allocator.py)
    tokens = TokenTable.from_file(config.tokens_file) if config.tokens_file else None
    sizes = {name: size_setting(name, getattr(config, name)) for name in SIZE_SETTINGS}
    limits = ServerLimits(max_block_bytes=sizes["max_block"], max_call_bytes=sizes["max_call"],
                          quota_bytes=sizes["quota"], shared_memory=config.shared_memory,
                          tenant_streams=config.tenant_streams, idle_timeout_s=config.idle_timeout,
                          min_rate_bytes=sizes["min_rate"], max_inflight_bytes=sizes["max_inflight"],
                          strike_burst=config.strike_burst, strike_leak_per_s=config.strike_rate,
                          max_subscriptions=config.max_subscriptions,
                          tenant_subscriptions=config.tenant_subscriptions,
                          subscriber_queue=config.subscriber_queue, events_log_bytes=sizes["events_log"])
    cert = Path(config.tls_cert).read_bytes() if config.tls_cert else None
    key = Path(config.tls_key).read_bytes() if config.tls_key else None
    metrics_token = read_token_file(config.metrics_token_file) if config.metrics_token_file else None
    metrics_namespaces = parse_namespaces(config.metrics_namespaces)
    if config.metrics_port:
        check_metrics_access(config.metrics_addr, metrics_token)  # before anything is opened
    store = open_store(config)
    history = StatsHistory(store, interval_s=config.history_interval).start()
    metrics = None
    try:
        interceptors = []
        if config.metrics_port:
            metrics = serve_metrics(store, config.metrics_port, config.metrics_addr, token=metrics_token,
                                    namespaces=metrics_namespaces)
            interceptors.append(metrics.interceptor)
        running = start_server(store, config.listen, tokens=tokens, limits=limits, tls_cert=cert, tls_key=key,
                               max_workers=config.workers, interceptors=interceptors, history=history,
                               events_dir=config.resolved_data_dir() / "events")
    except BaseException:
        if metrics is not None:
            metrics.close()
        history.stop()
        store.close()
        raise
    sweeper = None
    if config.shared_memory and shared_memory_supported():  # arenas of killed clients: now and periodically
        sweeper = ArenaSweeper(config.arena_sweep_interval).start()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    host = config.listen.rsplit(":", 1)[0]
    mode = "tokens" if tokens else "dev mode: no tokens file, namespaces from requests"
    metrics_line = f"; metrics on {metrics.describe()}" if metrics is not None else ""
    print(f"kvshelf serving on {host}:{running.port} ({'TLS' if cert else 'plaintext'}; {mode}; "
          f"data {config.resolved_data_dir()}{metrics_line})", flush=True)
    if ready is not None:
        ready.set()
    stop.wait()
    print(f"kvshelf: stopping (draining in-flight calls for up to {config.grace:g} s)", flush=True)
    running.stop(config.grace)
    if sweeper is not None:
        sweeper.stop()
    if metrics is not None:
        metrics.close()
    history.stop()
    store.close()
    print("kvshelf: stopped", flush=True)
    sys.stdout.flush()
    return 0
