"""``kvshelf serve``: the server's lifecycle (SIGTERM/SIGINT: stop accepting, drain in-flight calls for a grace
period, close the store, exit 0) over the tiers its configuration names.

The settings, their sources (flags > ``KVSHELF_*`` environment > TOML file > defaults) and their parsing live in
``service/config.py`` (``ServeConfig``, ``load_config``), re-exported here. The tiers come from the tier registry
(``kvstore.tier_registry``), as those of ``open_embedded_store`` do.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvshelf.kvstore.embedded import open_embedded_store
from kvshelf.kvstore.errors import ConfigError, TierDamagedError
from kvshelf.kvstore.lmdb_tier.repair import move_aside
from kvshelf.kvstore.store import TieredStore, TierSpec
from kvshelf.service.config import (  # noqa: F401  (re-exported: the configuration's old home)
    DURABILITY,
    ENV_PREFIX,
    SETTINGS,
    ServeConfig,
    load_config,
    read_config_file,
)

if TYPE_CHECKING:
    from kvshelf.service.auth import TokenTable
    from kvshelf.service.history import StatsHistory

log = logging.getLogger(__name__)


def open_store(config: ServeConfig) -> TieredStore:
    """CPU memory + LMDB under the data directory, plus the shared Redis tier when ``config.store.redis`` is set.

    The tiers keep blocks in the codec their clients sent them in (``TierSpec.as_sent``: the server never decodes
    them; clients decode); with ``config.store.disk_codec`` set, the LMDB and Redis tiers re-encode into it
    instead."""
    config.check()
    store = _open_embedded(config)
    *memory, disk = store.specs  # the memory tier (if any) always as sent; LMDB unless the operator named its codec
    for spec in memory:
        spec.as_sent = True
    disk.as_sent = not config.store.disk_codec
    if not config.store.redis:
        return store
    return _with_redis(store, config)


def _open_embedded(config: ServeConfig) -> TieredStore:
    settings = config.store
    durable = settings.durability == "fsync"
    options: dict[str, Any] = dict(memory_bytes=settings.memory_bytes or None, disk_codec=settings.disk_codec or "raw",
                   max_disk_bytes=settings.max_disk_bytes, eviction_policy=settings.eviction_policy,
                   durable=durable, sync_interval_s=None if durable else settings.sync_interval)
    try:
        store = open_embedded_store(settings.resolved_data_dir(), **options)
    except TierDamagedError as exc:
        if not settings.reset_disk:
            raise
        moved = move_aside(settings.resolved_data_dir() / "lmdb")
        log.warning("--reset-disk: the damaged LMDB environment was moved to %s (kept, never deleted) and a new "
                    "empty one started; the damage: %s", moved, str(exc).split("; recover with", 1)[0])
        store = open_embedded_store(settings.resolved_data_dir(), **options)
    return store


def _with_redis(store: TieredStore, config: ServeConfig) -> TieredStore:
    from kvshelf.kvstore.tier_registry import open_tier

    try:
        from kvshelf.kvstore.redis_tier import DEFAULT_MAX_VALUE_BYTES
    except ImportError as exc:
        store.close()
        raise ConfigError(f"--redis needs the Redis tier (kvstore.redis_tier): {exc}") from exc
    try:
        # every Redis call bounded by --redis-timeout; values up to 4 blocks' worth (a block re-encoded by the
        # tier's codec may grow), at least 1 GiB: larger manifests are damage
        redis = open_tier(config.store.redis, socket_timeout=config.store.redis_timeout,
                          max_value_bytes=max(DEFAULT_MAX_VALUE_BYTES, 4 * config.limits.max_block_bytes))
    except ConfigError as exc:
        store.close()
        raise ConfigError(f"--redis: {exc}") from None
    codec = config.store.disk_codec
    return TieredStore([*store.specs, TierSpec(redis, codec or "raw", as_sent=not codec)],
                       write_policy=store.write_policy)


def _start_dashboard(store: TieredStore, servicer: Any, config: ServeConfig, token: str | None,
                     namespaces: frozenset[str] | None, title: str, history: Any, latency: Any) -> Any:
    """The admin dashboard over this server's store, KV event count, most reused prefixes, request latency
    (``latency``: the gRPC latency histogram) and kept history."""
    from kvshelf.service.dashboard import serve_dashboard
    from kvshelf.service.dashboard_data import CachedSource, ModelNames, TierHealth, history_points, local_snapshot

    names, health = ModelNames(), TierHealth()
    names.attach(store)

    def source() -> dict[str, Any]:
        return local_snapshot(store, events_seq=lambda: servicer.events.next_seq, hot=servicer.hot_prefixes,
                              namespaces=namespaces, names=names, health=health, latency=latency)

    return serve_dashboard(CachedSource(source), config.admin.port, config.admin.addr, token=token, title=title,
                           history=lambda: history_points(history.points(), namespaces))


@dataclass(frozen=True)
class _Access:
    """What the server reads and checks before it opens anything: the tokens file, TLS, and the metrics' and
    dashboard's tokens and namespaces (an open address without a token fails here)."""

    tokens: TokenTable | None
    cert: bytes | None
    key: bytes | None
    metrics_token: str | None
    metrics_namespaces: frozenset[str] | None
    admin_token: str | None
    admin_namespaces: frozenset[str] | None

    @classmethod
    def read(cls, config: ServeConfig) -> _Access:
        from kvshelf.service.auth import TokenTable
        from kvshelf.service.metrics import check_metrics_access, parse_namespaces, read_token_file

        auth, metrics, admin = config.auth, config.metrics, config.admin
        access = cls(
            tokens=TokenTable.from_file(auth.tokens_file) if auth.tokens_file else None,
            cert=Path(auth.tls_cert).read_bytes() if auth.tls_cert else None,
            key=Path(auth.tls_key).read_bytes() if auth.tls_key else None,
            metrics_token=read_token_file(metrics.token_file) if metrics.token_file else None,
            metrics_namespaces=parse_namespaces(metrics.namespaces),
            admin_token=read_token_file(admin.token_file, "--admin-token-file") if admin.token_file else None,
            admin_namespaces=parse_namespaces(admin.namespaces, "--admin-namespaces"))
        if metrics.port:
            check_metrics_access(metrics.addr, access.metrics_token)
        if admin.port:
            from kvshelf.service.dashboard import check_dashboard_access

            check_dashboard_access(admin.addr, access.admin_token)
        return access


@dataclass
class _Running:
    """A started server and what runs beside it, closed in reverse order of start (``close``)."""

    store: TieredStore
    history: StatsHistory
    server: Any = None  # service.server.RunningServer
    metrics: Any = None  # service.metrics.MetricsEndpoint
    publisher: Any = None  # kvstore.vllm_events.VLLMEventPublisher (closed with the store)
    dashboard: Any = None
    sweeper: Any = None  # service.arena.ArenaSweeper

    def close(self, grace_s: float | None = None) -> None:
        """Stop the server (draining in-flight calls for ``grace_s``), then the rest; the store last."""
        if self.server is not None:
            self.server.stop(grace_s)
        if self.sweeper is not None:
            self.sweeper.stop()
        for part in (self.dashboard, self.metrics):
            if part is not None:
                part.close()
        self.history.stop()
        self.store.close()

    def describe(self, config: ServeConfig, access: _Access) -> str:
        """The ``kvshelf serving on HOST:PORT (...)`` line."""
        host = config.server.listen.rsplit(":", 1)[0]
        mode = "tokens" if access.tokens else "dev mode: no tokens file, namespaces from requests"
        extra = f"; metrics on {self.metrics.describe()}" if self.metrics is not None else ""
        if self.publisher is not None:
            extra += f"; vLLM KV events on {self.publisher.settings.endpoint}"
        if self.dashboard is not None:
            extra += f"; dashboard on {self.dashboard.describe()}"
        if self.server.data_port is not None:
            extra += f"; data path on port {self.server.data_port}"
        return (f"kvshelf serving on {host}:{self.server.port} ({'TLS' if access.cert else 'plaintext'}; {mode}; "
                f"data {config.resolved_data_dir()}{extra})")


def _start_observers(parts: _Running, config: ServeConfig, access: _Access) -> list[Any]:
    """vLLM-format KV events (an endpoint in use: ``ConfigError``) and /metrics; returns the gRPC interceptors,
    the last one's ``histogram`` the request latency the dashboard shows (/metrics' own when it is on)."""
    kv_events = config.kv_events.settings()
    if kv_events is not None:
        from kvshelf.kvstore.vllm_events import VLLMEventPublisher

        parts.publisher = VLLMEventPublisher(kv_events).attach(parts.store)
        parts.store.on_close(parts.publisher.close)
    settings = config.metrics
    if settings.port:
        from kvshelf.service.metrics import KVEventsCollector, serve_metrics

        parts.metrics = serve_metrics(parts.store, settings.port, settings.addr, token=access.metrics_token,
                                      namespaces=access.metrics_namespaces)
        if parts.publisher is not None:
            parts.metrics.registry.register(KVEventsCollector(parts.publisher))
        return [parts.metrics.interceptor]
    if config.admin.port:
        from prometheus_client import CollectorRegistry

        from kvshelf.service.metrics import LatencyInterceptor

        return [LatencyInterceptor(CollectorRegistry())]
    return []


def _start(config: ServeConfig, access: _Access, limits: Any) -> _Running:
    """Open the store and start everything; on any failure close what was started and re-raise."""
    from kvshelf.service.history import StatsHistory
    from kvshelf.service.server import start_server

    store = open_store(config)
    parts = _Running(store, StatsHistory(store, interval_s=config.server.history_interval).start())
    try:
        interceptors = _start_observers(parts, config, access)
        parts.server = start_server(
            store, config.server.listen, tokens=access.tokens, limits=limits, tls_cert=access.cert,
            tls_key=access.key, max_workers=config.server.workers, interceptors=interceptors, history=parts.history,
            events_dir=config.resolved_data_dir() / "events")
        if parts.publisher is not None:
            parts.server.servicer.clear_listeners.append(parts.publisher.cleared)
        if config.admin.port:
            title = f"serve {config.server.listen.rsplit(':', 1)[0]}:{parts.server.port}"
            latency = interceptors[-1].histogram if interceptors else None
            parts.dashboard = _start_dashboard(store, parts.server.servicer, config, access.admin_token,
                                               access.admin_namespaces, title, parts.history, latency)
    except BaseException:
        parts.close(0)
        raise
    return parts


def serve(config: ServeConfig, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> int:
    """Run the server until SIGTERM/SIGINT (or ``stop`` is set); return the exit code (0).

    Prints ``kvshelf serving on HOST:PORT`` once it accepts calls (the real port when ``listen`` ends in :0).
    """
    from kvshelf.service.allocator import SERVER_ARENAS, keep_large_buffers, server_keep_bytes
    from kvshelf.service.arena import ArenaSweeper, shared_memory_supported

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config.check()  # a config built in Python is checked as the sources' is, before anything is opened
    # reuse freed message buffers instead of faulting in fresh pages, in a bounded heap (service/allocator.py)
    limits = config.server_limits()
    keep_large_buffers(keep_bytes=server_keep_bytes(limits.inflight_bytes), arenas=SERVER_ARENAS)
    access = _Access.read(config)
    parts = _start(config, access, limits)
    if config.server.shared_memory and shared_memory_supported():  # arenas of killed clients: now and periodically
        parts.sweeper = ArenaSweeper(config.server.arena_sweep_interval).start()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    print(parts.describe(config, access), flush=True)
    if ready is not None:
        ready.set()
    stop.wait()
    print(f"kvshelf: stopping (draining in-flight calls for up to {config.server.grace:g} s)", flush=True)
    parts.close(config.server.grace)
    print("kvshelf: stopped", flush=True)
    sys.stdout.flush()
    return 0
