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
from pathlib import Path
from typing import Any

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
    options = dict(memory_bytes=settings.memory_bytes or None, disk_codec=settings.disk_codec or "raw",
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


def serve(config: ServeConfig, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> int:
    """Run the server until SIGTERM/SIGINT (or ``stop`` is set); return the exit code (0).

    Prints ``kvshelf serving on HOST:PORT`` once it accepts calls (the real port when ``listen`` ends in :0).
    """
    from kvshelf.service.allocator import SERVER_ARENAS, keep_large_buffers, server_keep_bytes
    from kvshelf.service.arena import ArenaSweeper, shared_memory_supported
    from kvshelf.service.auth import TokenTable
    from kvshelf.service.history import StatsHistory
    from kvshelf.service.metrics import check_metrics_access, parse_namespaces, read_token_file, serve_metrics
    from kvshelf.service.server import start_server

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config.check()  # a config built in Python is checked as the sources' is, before anything is opened
    # reuse freed message buffers instead of faulting in fresh pages, in a bounded heap (service/allocator.py)
    limits = config.server_limits()
    keep_large_buffers(keep_bytes=server_keep_bytes(limits.inflight_bytes), arenas=SERVER_ARENAS)
    auth, metrics_settings = config.auth, config.metrics
    tokens = TokenTable.from_file(auth.tokens_file) if auth.tokens_file else None
    cert = Path(auth.tls_cert).read_bytes() if auth.tls_cert else None
    key = Path(auth.tls_key).read_bytes() if auth.tls_key else None
    metrics_token = read_token_file(metrics_settings.token_file) if metrics_settings.token_file else None
    metrics_namespaces = parse_namespaces(metrics_settings.namespaces)
    if metrics_settings.port:
        check_metrics_access(metrics_settings.addr, metrics_token)  # before anything is opened
    admin = config.admin
    admin_token = read_token_file(admin.token_file, "--admin-token-file") if admin.token_file else None
    admin_namespaces = parse_namespaces(admin.namespaces, "--admin-namespaces")
    if admin.port:
        from kvshelf.service.dashboard import check_dashboard_access

        check_dashboard_access(admin.addr, admin_token)  # before anything is opened
    store = open_store(config)
    history = StatsHistory(store, interval_s=config.server.history_interval).start()
    metrics = publisher = dashboard = None
    try:
        kv_events = config.kv_events.settings()
        if kv_events is not None:  # vLLM-format KV events for routers (an endpoint in use: ConfigError)
            from kvshelf.kvstore.vllm_events import VLLMEventPublisher

            publisher = VLLMEventPublisher(kv_events).attach(store)
            store.on_close(publisher.close)
        interceptors = []
        latency = None  # the request latency histogram the dashboard shows (/metrics' own when it is on)
        if metrics_settings.port:
            metrics = serve_metrics(store, metrics_settings.port, metrics_settings.addr, token=metrics_token,
                                    namespaces=metrics_namespaces)
            interceptors.append(metrics.interceptor)
            latency = metrics.interceptor.histogram
            if publisher is not None:
                from kvshelf.service.metrics import KVEventsCollector

                metrics.registry.register(KVEventsCollector(publisher))
        elif admin.port:
            from prometheus_client import CollectorRegistry

            from kvshelf.service.metrics import LatencyInterceptor

            interceptors.append(LatencyInterceptor(CollectorRegistry()))
            latency = interceptors[-1].histogram
        running = start_server(store, config.server.listen, tokens=tokens, limits=limits, tls_cert=cert, tls_key=key,
                               max_workers=config.server.workers, interceptors=interceptors, history=history,
                               events_dir=config.resolved_data_dir() / "events")
        if publisher is not None:
            running.servicer.clear_listeners.append(publisher.cleared)
        if admin.port:
            title = f"serve {config.server.listen.rsplit(':', 1)[0]}:{running.port}"
            dashboard = _start_dashboard(store, running.servicer, config, admin_token, admin_namespaces, title,
                                         history, latency)
    except BaseException:
        if dashboard is not None:
            dashboard.close()
        if metrics is not None:
            metrics.close()
        history.stop()
        store.close()
        raise
    sweeper = None
    if config.server.shared_memory and shared_memory_supported():  # arenas of killed clients: now and periodically
        sweeper = ArenaSweeper(config.server.arena_sweep_interval).start()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    host = config.server.listen.rsplit(":", 1)[0]
    mode = "tokens" if tokens else "dev mode: no tokens file, namespaces from requests"
    metrics_line = f"; metrics on {metrics.describe()}" if metrics is not None else ""
    if publisher is not None:
        metrics_line += f"; vLLM KV events on {publisher.settings.endpoint}"
    if dashboard is not None:
        metrics_line += f"; dashboard on {dashboard.describe()}"
    if running.data_port is not None:
        metrics_line += f"; data path on port {running.data_port}"
    print(f"kvshelf serving on {host}:{running.port} ({'TLS' if cert else 'plaintext'}; {mode}; "
          f"data {config.resolved_data_dir()}{metrics_line})", flush=True)
    if ready is not None:
        ready.set()
    stop.wait()
    print(f"kvshelf: stopping (draining in-flight calls for up to {config.server.grace:g} s)", flush=True)
    running.stop(config.server.grace)
    if sweeper is not None:
        sweeper.stop()
    if dashboard is not None:
        dashboard.close()
    if metrics is not None:
        metrics.close()
    history.stop()
    store.close()
    print("kvshelf: stopped", flush=True)
    sys.stdout.flush()
    return 0
