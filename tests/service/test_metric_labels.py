"""Model names as metric labels are bounded: a real ``kvshelf serve`` looked up with 20,000 made-up model names
exports at most ``MAX_MODELS_PER_NAMESPACE`` of them per namespace (the rest as ``(other)``), each label at most
``MAX_LABEL_CHARS`` characters; a model name longer than any fingerprint is INVALID_ARGUMENT, named."""

from __future__ import annotations

import re

import grpc
import pytest
from service_helpers import scrape

from kvshelf.kvstore.stats import (
    MAX_LABEL_CHARS,
    MAX_MODELS_PER_NAMESPACE,
    OTHER_MODELS,
    Counters,
    Metric,
    bounded_label,
)
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.service.server import SERVICE_NAME

NAMES = 20_000
KEY = bytes(range(16))


def _lookup(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(f"/{SERVICE_NAME}/LookupPrefix",
                               request_serializer=pb.LookupPrefixRequest.SerializeToString,
                               response_deserializer=pb.LookupPrefixResponse.FromString)


def test_twenty_thousand_model_names_export_a_bounded_set(serving):
    # 64 lookups in flight at a time: with hundreds in flight from the server's own process, a busy machine reads
    # some request messages late, and late unary calls are capped (service/fairness.py, tested there)
    running = serving()
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    with grpc.insecure_channel(running.grpc) as channel:
        lookup = _lookup(channel)
        for start in range(0, NAMES, 64):
            calls = [lookup.future(pb.LookupPrefixRequest(namespace="tenant-a", keys=[KEY], model=f"made-up-{i}"))
                     for i in range(start, min(start + 64, NAMES))]
            for call in calls:
                assert call.result(timeout=60).found == 0
        long_name = "m" * 1000  # within a fingerprint's 1024 characters: counted, its label cut
        lookup(pb.LookupPrefixRequest(namespace="tenant-b", keys=[KEY], model=long_name), timeout=30)
    status, body = scrape(url)
    assert status == 200
    labels = set(re.findall(r'model="([^"]*)"', body))
    tenant_a = {m for m in labels if m.startswith("made-up-") or m == OTHER_MODELS}
    assert len(tenant_a) == MAX_MODELS_PER_NAMESPACE + 1 and OTHER_MODELS in tenant_a
    assert f'kvshelf_lookup_blocks_total{{model="{OTHER_MODELS}",namespace="tenant-a"}} ' \
           f'{float(NAMES - MAX_MODELS_PER_NAMESPACE)}' in body  # nothing lost: the rest counted under (other)
    assert max(map(len, labels)) <= MAX_LABEL_CHARS
    assert bounded_label(long_name) in labels
    assert len(body) < 256 << 10, len(body)


@pytest.mark.parametrize("method", ["LookupPrefix", "GetBlocks", "OpenDataPath"])
def test_a_model_name_of_8_mib_is_invalid_argument(serving, method):
    running = serving()
    name = "m" * (8 << 20)
    with grpc.insecure_channel(running.grpc) as channel:
        if method == "LookupPrefix":
            call = _lookup(channel)
            request = pb.LookupPrefixRequest(namespace="tenant-a", keys=[KEY], model=name)
        else:
            response = pb.LookupPrefixResponse.FromString  # never reached: the call fails first
            call = channel.unary_stream(f"/{SERVICE_NAME}/{method}",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=lambda raw: response)
            request = (pb.GetBlocksRequest(namespace="tenant-a", keys=[KEY], fingerprint=name)
                       if method == "GetBlocks" else
                       pb.DataPathRequest(namespace="tenant-a", op=pb.DataPathRequest.GET, keys=[KEY],
                                          fingerprint=name))
        with pytest.raises(grpc.RpcError) as caught:
            result = call(request, timeout=30)
            if method != "LookupPrefix":
                list(result)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"of {8 << 20} characters: a model fingerprint is at most 1024" in caught.value.details()
    status, body = scrape(f"http://127.0.0.1:{running.metrics_port}/metrics")
    assert status == 200 and "mmmm" not in body


def test_counters_bound_labels_per_namespace():
    counters = Counters(max_models=2)
    for model in ("a", "b", "c", "d", "a", "x" * 1000):
        counters.add("disk", "ns", model, Metric.HITS)
    counters.add("disk", "other-ns", "c", Metric.HITS)  # each namespace has its own labels
    rows = {(r.namespace, r.model): r.get(Metric.HITS) for r in counters.counter_rows()}
    assert rows == {("ns", "a"): 2, ("ns", "b"): 1, ("ns", OTHER_MODELS): 3, ("other-ns", "c"): 1}
    assert [r.namespace for r in counters.counter_rows(namespaces={"other-ns"})] == ["other-ns"]
    long_a, long_b = bounded_label("x" * 1000), bounded_label("x" * 999 + "y")
    assert len(long_a) == MAX_LABEL_CHARS and long_a != long_b and bounded_label("short") == "short"
