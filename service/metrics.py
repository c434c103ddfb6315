"""Prometheus metrics of a kvshelf store and service.

``StoreCollector`` turns a ``TieredStore``'s counters and usage into Prometheus metrics at scrape time (no
double bookkeeping): per tier, namespace and model hits, misses, bytes, evictions, corrupt and foreign
misses; bytes and blocks held per tier; lookup and retrieve hit counts in blocks and in tokens.
``LatencyInterceptor`` adds a request latency histogram per gRPC method.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvshelf.kvstore.stats import ALL_TIERS, STORE_METRICS, TIER_METRICS

_HELP = {
    "hits": "blocks served by this tier",
    "misses": "blocks asked of this tier and not found there",
    "bytes_read": "encoded bytes served by this tier",
    "bytes_written": "encoded bytes written to this tier",
    "blocks_written": "blocks written to this tier",
    "evictions": "blocks this tier evicted",
    "corrupt": "damaged values found (a miss; the value is dropped)",
    "foreign": "values of another key, namespace or model (a miss)",
    "rejected": "blocks this tier refused (too large, or room only by evicting pinned blocks)",
    "unavailable": "operations skipped because the tier was unreachable",
    "lookup_blocks": "blocks asked for by prefix lookups",
    "lookup_hit_blocks": "blocks found by prefix lookups",
    "retrieve_blocks": "blocks asked for by retrievals",
    "retrieve_hit_blocks": "blocks served by retrievals",
    "lookup_tokens": "tokens asked for by prefix lookups",
    "lookup_hit_tokens": "tokens found by prefix lookups",
    "retrieve_tokens": "tokens asked for by retrievals",
    "retrieve_hit_tokens": "tokens served by retrievals",
}


class StoreCollector(Collector):
    """Reads ``store.counters`` and ``store.stats()`` on every scrape."""

    def __init__(self, store: Any, prefix: str = "kvshelf") -> None:
        self.store = store
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        rows = self.store.counters.rows()
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
            tier, ns, model = str(row["tier"]), str(row["namespace"]), str(row["model"])
            for metric, value in row.items():
                if metric in ("tier", "namespace", "model"):
                    continue
                if tier == ALL_TIERS and metric in store_families:
                    store_families[metric].add_metric([ns, model], float(value))
                elif tier != ALL_TIERS and metric in tier_families:
                    tier_families[metric].add_metric([tier, ns, model], float(value))
        yield from tier_families.values()
        yield from store_families.values()
        held_bytes = GaugeMetricFamily(f"{self.prefix}_tier_bytes", "encoded bytes held", labels=["tier"])
        held_blocks = GaugeMetricFamily(f"{self.prefix}_tier_blocks", "blocks held", labels=["tier"])
        up = GaugeMetricFamily(f"{self.prefix}_tier_available", "1 when the tier is reachable", labels=["tier"])
        for tier in self.store.stats()["tiers"]:
            up.add_metric([tier["name"]], 1.0 if tier.get("available", True) else 0.0)
            if tier.get("bytes") is not None:
                held_bytes.add_metric([tier["name"]], float(tier["bytes"]))
                held_blocks.add_metric([tier["name"]], float(tier["blocks"]))
        yield from (held_bytes, held_blocks, up)


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


def serve_metrics(store: Any, port: int, addr: str = "127.0.0.1") -> tuple[CollectorRegistry, LatencyInterceptor]:
    """Start the ``/metrics`` HTTP endpoint; return the registry and the interceptor to give the gRPC server."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    interceptor = LatencyInterceptor(registry)
    start_http_server(port, addr=addr, registry=registry)
    return registry, interceptor
