"""Prometheus metrics of a kvshelf store and service.

``StoreCollector`` turns a ``TieredStore``'s counters and usage into Prometheus metrics at scrape time (no
double bookkeeping): per tier, namespace and model hits, misses, bytes, evictions, corrupt and foreign
misses; bytes and blocks held per tier; lookup and retrieve hit counts in blocks and in tokens.
``LatencyInterceptor`` adds a request latency histogram per gRPC method.

Access: the rows name every tenant's namespace and model, so ``serve_metrics`` binds to ``127.0.0.1`` by
default, can require ``Authorization: Bearer <token>`` (others get 401) and can export only some namespaces
(the others are not even named). Binding to an address other than loopback without a token is refused with a
``ConfigError``: put the token in a file (``--metrics-token-file``) and give it to Prometheus
(``authorization: {credentials_file: ...}``). Without a token, only requests whose ``Host`` is ``localhost`` or a
loopback address are answered (421 otherwise: no DNS rebinding). Served by ``prometheus_client.make_wsgi_app``
under a small WSGI wrapper (the token check, before anything else of the request is looked at) in the bounded
server of ``service.http_server`` (a fixed pool of workers, a read deadline, capped request heads).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import socket
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvshelf.kvstore.errors import ConfigError, TierUnavailableError
from kvshelf.kvstore.stats import ALL_TIERS, STORE_METRICS, TIER_METRICS, Metric
from kvshelf.service.http_server import HttpLimits, HttpServer, serve_wsgi

log = logging.getLogger(__name__)
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 b64token: what a Bearer header can carry

_HELP: dict[Metric, str] = {
    Metric.HITS: "blocks served by this tier",
    Metric.MISSES: "blocks asked of this tier and not found there",
    Metric.BYTES_READ: "encoded bytes served by this tier",
    Metric.BYTES_WRITTEN: "encoded bytes written to this tier",
    Metric.BLOCKS_WRITTEN: "blocks written to this tier",
    Metric.EVICTIONS: "blocks this tier evicted",
    Metric.CORRUPT: "damaged values found (a miss; the value is dropped)",
    Metric.FOREIGN: "values of another key, namespace or model (a miss)",
    Metric.REJECTED: "blocks this tier refused (too large, or room only by evicting pinned blocks), and blocks read "
                     "from it that would take more than the reader's max_decode_bytes to decode (a miss; the value "
                     "is kept)",
    Metric.UNAVAILABLE: "operations skipped because the tier was unreachable",
    Metric.LOOKUP_BLOCKS: "blocks asked for by prefix lookups",
    Metric.LOOKUP_HIT_BLOCKS: "blocks found by prefix lookups",
    Metric.RETRIEVE_BLOCKS: "blocks asked for by retrievals",
    Metric.RETRIEVE_HIT_BLOCKS: "blocks served by retrievals",
    Metric.LOOKUP_TOKENS: "tokens asked for by prefix lookups",
    Metric.LOOKUP_HIT_TOKENS: "tokens found by prefix lookups",
    Metric.RETRIEVE_TOKENS: "tokens asked for by retrievals",
    Metric.RETRIEVE_HIT_TOKENS: "tokens served by retrievals",
}


class StoreCollector(Collector):
    """Reads ``store.counters`` and ``store.typed_stats()`` on every scrape; with ``namespaces``, only the rows of
    those namespaces (the per-tier totals, which name no namespace, are always exported)."""

    def __init__(self, store: Any, prefix: str = "kvshelf", namespaces: Collection[str] | None = None) -> None:
        self.store = store
        self.prefix = prefix
        self.namespaces = frozenset(namespaces) if namespaces is not None else None

    def collect(self) -> Iterator[Any]:
        rows = self.store.counters.counter_rows(self.namespaces)  # other tenants' counts are not even sorted
        tier_families = {
            m: CounterMetricFamily(f"{self.prefix}_tier_{m}", _HELP[m], labels=["tier", "namespace", "model"])
            for m in TIER_METRICS
        }
        store_metrics = sorted(STORE_METRICS)
        store_families = {
            m: CounterMetricFamily(f"{self.prefix}_{m}", _HELP[m], labels=["namespace", "model"])
            for m in store_metrics
        }
        for row in rows:
            tier, ns, model = row.tier, row.namespace, row.model
            for metric, value in row.counts.items():
                if tier == ALL_TIERS and metric in store_families:
                    store_families[metric].add_metric([ns, model], float(value))
                elif tier != ALL_TIERS and metric in tier_families:
                    tier_families[metric].add_metric([tier, ns, model], float(value))
        yield from tier_families.values()
        yield from store_families.values()
        held_bytes = GaugeMetricFamily(f"{self.prefix}_tier_bytes", "encoded bytes held", labels=["tier"])
        held_blocks = GaugeMetricFamily(f"{self.prefix}_tier_blocks", "blocks held", labels=["tier"])
        up = GaugeMetricFamily(f"{self.prefix}_tier_available", "1 when the tier is reachable", labels=["tier"])
        for name, usage in _tier_usage(self.store):
            up.add_metric([name], 1.0 if usage is not None else 0.0)
            if usage is not None:
                held_bytes.add_metric([name], float(usage.bytes))
                held_blocks.add_metric([name], float(usage.blocks or 0))
        yield from (held_bytes, held_blocks, up)


def _tier_usage(store: Any) -> Iterator[tuple[str, Any]]:
    """``(name, usage or None when unreachable)`` of each tier of ``store`` (a ``TieredStore``): its device tier,
    then its specs; read from the tiers themselves (not ``typed_stats``, which also sums every counter)."""
    device = getattr(store, "device_tier", None)
    if device is not None:
        yield device.name, device.usage()
    for spec in store.specs:
        try:
            usage = spec.tier.usage()
        except TierUnavailableError:
            usage = None
        yield spec.tier.name, usage


class KVEventsCollector(Collector):
    """The vLLM-format KV event publisher's counters (``kvstore.vllm_events.VLLMEventPublisher.stats``)."""

    def __init__(self, publisher: Any, prefix: str = "kvshelf") -> None:
        self.publisher = publisher
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        stats = self.publisher.stats()
        p = f"{self.prefix}_kv_events"
        published = CounterMetricFamily(f"{p}_published", "vLLM-format KV events published", labels=[])
        published.add_metric([], float(stats["published_events"]))
        batches = CounterMetricFamily(f"{p}_batches", "vLLM-format KV event batches published", labels=[])
        batches.add_metric([], float(stats["published_batches"]))
        dropped = CounterMetricFamily(f"{p}_dropped", "KV events or batches dropped: 'queue' (events, publisher "
                                      "behind), 'hwm' (batches a subscriber at its high-water mark lost)",
                                      labels=["reason"])
        dropped.add_metric(["queue"], float(stats["queue_drops"]))
        dropped.add_metric(["hwm"], float(stats["hwm_drops"]))
        replays = CounterMetricFamily(f"{p}_replays", "replay requests: 'ok' (replayed), 'malformed', 'refused' "
                                      "(too many replays at once: the end marker alone)", labels=["result"])
        replays.add_metric(["ok"], float(stats["replays"]))
        replays.add_metric(["malformed"], float(stats["bad_replay_requests"]))
        replays.add_metric(["refused"], float(stats["replays_refused"]))
        resets = CounterMetricFamily(f"{p}_socket_resets", "publisher sockets closed and opened again (subscriptions "
                                     "or payloads pinned by slow peers past their bounds)", labels=[])
        resets.add_metric([], float(stats["socket_resets"]))
        guard = CounterMetricFamily(f"{p}_guard_drops", "peer connections the publisher's memory guard dropped",
                                    labels=[])
        guard.add_metric([], float(stats["guard_drops"]))
        buffered = GaugeMetricFamily(f"{p}_buffer_bytes", "payload bytes kept for replay", labels=[])
        buffered.add_metric([], float(stats["buffer_bytes"]))
        pinned = GaugeMetricFamily(f"{p}_pinned_bytes", "payload bytes out of the replay buffer, still queued for "
                                   "a peer", labels=[])
        pinned.add_metric([], float(stats["pinned_bytes"]))
        yield from (published, batches, dropped, replays, resets, guard, buffered, pinned)


class LatencyInterceptor(grpc.ServerInterceptor):
    """Observes the duration of every unary and streaming call in ``kvshelf_request_seconds{method}``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            "kvshelf_request_seconds", "gRPC request latency", ["method"], registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        observe = self.histogram.labels(method).time

        def wrap_unary(fn: Callable) -> Callable:
            def inner(request: Any, context: Any) -> Any:
                with observe():
                    return fn(request, context)
            return inner

        def wrap_stream(fn: Callable) -> Callable:
            def inner(request: Any, context: Any) -> Iterator[Any]:
                start = time.perf_counter()
                try:
                    yield from fn(request, context)
                finally:
                    self.histogram.labels(method).observe(time.perf_counter() - start)
            return inner

        if handler.unary_unary:
            return handler._replace(unary_unary=wrap_unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=wrap_unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=wrap_stream(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=wrap_stream(handler.stream_stream))
        return handler


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an IP address or a host name) only reaches this machine."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def read_token_file(path: str | Path, flag: str = "--metrics-token-file") -> str:
    """The bearer token in ``path`` (surrounding whitespace ignored); a ``ConfigError`` starting with ``flag`` and
    naming what is wrong."""
    path = Path(path)
    try:
        token = path.read_text(encoding="ascii").strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc}") from None
    if not token:
        raise ConfigError(f"{flag}: {path} is empty")
    if _TOKEN.fullmatch(token) is None:
        raise ConfigError(f"{flag}: {path} must hold one token of letters, digits and -._~+/ (no spaces)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s (%s) is readable by other users (chmod 600 it)", path, flag)
    return token


def parse_namespaces(text: str, flag: str = "--metrics-namespaces") -> frozenset[str] | None:
    """``"a, b"`` -> ``{"a", "b"}``; ``""`` -> None (every namespace); ``","``: a ``ConfigError`` naming ``flag``."""
    if not text.strip():
        return None
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ConfigError(f"{flag}: no namespace in {text!r}")
    return names


def check_metrics_access(addr: str, token: str | None) -> None:
    """Refuse an unauthenticated endpoint on an address other than loopback (it would list every tenant)."""
    if token is None and not is_loopback(addr):
        raise ConfigError(
            f"--metrics-addr {addr!r} is not a loopback address and /metrics names every tenant's namespace and "
            "model: set --metrics-token-file (Prometheus: authorization.credentials_file) or bind to 127.0.0.1"
        )


def start_wsgi(app: Callable, addr: str, port: int, *, flag: str, thread_name: str,
               loopback_hosts: bool = False, limits: HttpLimits = HttpLimits()) -> tuple[HttpServer, str, int]:
    """Serve ``app`` on ``addr:port`` (port 0: a free one; IPv6 in brackets or bare) with the bounded server of
    ``service.http_server`` (a fixed pool of workers, a read deadline, capped heads), on daemon threads:
    ``(server, host, bound port)``. ``loopback_hosts``: only ``Host: localhost`` or a loopback address is
    answered (421 otherwise). An address that cannot be listened on is a ``ConfigError`` naming ``flag``."""
    try:
        server = serve_wsgi(app, addr, port, name=thread_name, limits=limits, loopback_hosts=loopback_hosts)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot listen on {addr}:{port}: {exc.strerror or exc}") from None
    return server, server.host, server.port


def _require_token(app: Callable, token: str) -> Callable:
    """``app`` behind ``Authorization: Bearer <token>`` (compared in constant time); others get 401."""
    expected = token.encode()

    def guarded(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        scheme, _, given = str(environ.get("HTTP_AUTHORIZATION", "")).strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "replace"), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="kvshelf metrics"')])
        return [b"401: /metrics needs the header Authorization: Bearer <token>\n"]

    return guarded


@dataclass
class MetricsEndpoint:
    """A started ``/metrics`` endpoint: give ``interceptor`` to the gRPC server; ``close`` stops it."""

    registry: CollectorRegistry
    interceptor: LatencyInterceptor
    host: str
    port: int
    token_required: bool
    namespaces: frozenset[str] | None
    _server: HttpServer | None = field(repr=False, default=None)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def describe(self) -> str:
        """``http://127.0.0.1:9100/metrics (bearer token; namespaces a, b)`` for the start-up line."""
        access = "bearer token" if self.token_required else "no token: loopback only"
        scope = f"namespaces {', '.join(sorted(self.namespaces))}" if self.namespaces is not None else "all namespaces"
        return f"{self.url} ({access}; {scope})"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def serve_metrics(store: Any, port: int, addr: str = "127.0.0.1", *, token: str | None = None,
                  namespaces: Collection[str] | None = None) -> MetricsEndpoint:
    """Start the ``/metrics`` HTTP endpoint on ``addr:port`` (port 0: a free one) in a daemon thread.

    ``token``: requests need ``Authorization: Bearer <token>``; ``namespaces``: only their rows are exported.
    A non-loopback ``addr`` without a token is a ``ConfigError`` (``check_metrics_access``).
    """
    check_metrics_access(addr, token)
    registry = CollectorRegistry()
    registry.register(StoreCollector(store, namespaces=namespaces))
    interceptor = LatencyInterceptor(registry)
    app = make_wsgi_app(registry)
    if token is not None:
        app = _require_token(app, token)

    server, host, bound_port = start_wsgi(app, addr, port, flag="--metrics-port", thread_name="kvshelf-metrics",
                                          loopback_hosts=token is None)
    return MetricsEndpoint(registry, interceptor, host, bound_port, token is not None,
                           frozenset(namespaces) if namespaces is not None else None, server)
