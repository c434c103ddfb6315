"""The connector's counts in vLLM's KV connector stats (no engine: the stats class vLLM's logger aggregates)."""

from __future__ import annotations

from kvshelf.adapters.vllm import KVShelfConnector
from kvshelf.adapters.vllm.connector import STAT_NAMES, KVShelfConnectorStats


def test_stats_aggregate_reduce_and_reset() -> None:
    built = KVShelfConnector.build_kv_connector_stats({"loaded_blocks": 2, "loaded_tokens": 512})
    assert isinstance(built, KVShelfConnectorStats) and not built.is_empty()
    built.aggregate(KVShelfConnectorStats(data={"failed_blocks": 1, "loaded_blocks": 1}))
    assert built.reduce() == {"loaded_blocks": 3, "loaded_tokens": 512, "failed_blocks": 1, "saved_blocks": 0}
    built.reset()
    assert built.is_empty() and set(built.to_dict()) == set(STAT_NAMES)
    assert KVShelfConnector.build_kv_connector_stats(None).is_empty()
