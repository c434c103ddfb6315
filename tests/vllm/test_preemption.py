"""A request preempted by vLLM (too few KV pages for two 1,020-token prompts to decode side by side) with kvshelf's
connector: its pages are freed mid-run, it comes back through the connector's lookup (its blocks stored while it
ran), and both answers equal vLLM's without the connector."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_engine import engine, generate, report, tokens_of

pytestmark = pytest.mark.slow


def _counter(llm: Any, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def test_a_preempted_request_answers_as_vllm_alone(model_dir: str, documents: dict, reference: dict,
                                                   tmp_path) -> None:
    # 17 pages of 128 tokens, one of them vLLM's null page: both prompts fit (8 pages each), their fifth decoded
    # tokens do not
    with engine(model_dir, {"store": f"embedded://{tmp_path}?memory=0"}, num_gpu_blocks_override=17,
                disable_log_stats=False) as llm:
        outputs = generate(llm, [documents["long0"], documents["long1"]])
        preemptions = _counter(llm, "vllm:num_preemptions")
    assert preemptions >= 1
    assert tokens_of(outputs) == [reference["long0"], reference["long1"]]
    assert all(report(o)["failed_tokens"] == 0 for o in outputs)
