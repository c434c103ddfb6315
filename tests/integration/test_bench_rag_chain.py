"""``kvshelf bench rag-chain``: a short run writes the JSON the issue fixes (a row per system, LangChain, TTFT p50
and accuracy, the machine) and its table; the table function is pure."""

from __future__ import annotations

import json

from rich.console import Console

from kvshelf.bench.common import default_corpus
from kvshelf.bench.rag_chain import results_table, run


def test_results_table_is_pure_and_shows_the_speedup() -> None:
    payload = {"machine": "m", "results": [
        {"system": "hf", "framework": "langchain", "ttft_p50_s": 2.0, "accuracy": 0.8},
        {"system": "kvshelf", "framework": "langchain", "ttft_p50_s": 0.25, "accuracy": 0.8}]}
    before = json.dumps(payload)
    console = Console(record=True, width=160)
    console.print(results_table(payload))
    text = console.export_text()
    assert "8.0x" in text and "100%" in text and json.dumps(payload) == before


def test_short_run_writes_the_json(tmp_path) -> None:
    out = tmp_path / "rag-chain.json"
    corpus = default_corpus()
    run(json_path=str(out), corpus=str(corpus) if corpus else None, cases=2, modes=["reuse-blend", "block-attention"],
        console=Console(width=160))
    payload = json.loads(out.read_text())
    assert [(r["system"], r["framework"], r["mode"]) for r in payload["results"]] == [
        ("hf", "langchain", None), ("kvshelf", "langchain", "reuse-blend"), ("kvshelf", "langchain", "block-attention")]
    for row in payload["results"]:
        assert isinstance(row["ttft_p50_s"], float) and row["ttft_p50_s"] > 0
        assert isinstance(row["accuracy"], float) and 0 <= row["accuracy"] <= 1
    assert payload["machine"]
    assert payload["chunks_stored_offline"] >= 8
    hf, blend, block = payload["results"]
    assert block["ttft_p50_s"] < blend["ttft_p50_s"] < hf["ttft_p50_s"]
