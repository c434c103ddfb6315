"""``kvshelf bench rag-chain``: a short run writes the JSON the issue fixes (a row per system, LangChain, TTFT p50
and accuracy, the machine) and its table; the table function is pure."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvshelf.bench.rag_chain import results_table, run

pytestmark = pytest.mark.slow  # a whole benchmark run: scheduled first (tests/conftest.py)


def test_results_table_is_pure_and_shows_the_speedup() -> None:
    payload = {"machine": "m", "results": [
        {"system": "hf", "framework": "langchain", "ttft_p50_s": 2.0, "accuracy": 0.8},
        {"system": "kvshelf", "framework": "langchain", "ttft_p50_s": 0.25, "accuracy": 0.8}]}
    before = json.dumps(payload)
    console = Console(record=True, width=160)
    console.print(results_table(payload))
    text = console.export_text()
    assert "8.0x" in text and "100%" in text and json.dumps(payload) == before


def test_short_run_writes_the_json(tmp_path, corpus_path) -> None:
    out = tmp_path / "rag-chain.json"
    run(json_path=str(out), corpus=corpus_path, cases=2, modes=["reuse-blend", "block-attention"],
        console=Console(width=160), recompute_ratio=0.1)
    payload = json.loads(out.read_text())
    assert [(r["system"], r["framework"], r["mode"]) for r in payload["results"]] == [
        ("hf", "langchain", None), ("kvshelf", "langchain", "reuse-blend"), ("kvshelf", "langchain", "block-attention")]
    for row in payload["results"]:
        assert isinstance(row["ttft_p50_s"], float) and row["ttft_p50_s"] > 0
        assert isinstance(row["accuracy"], float) and 0 <= row["accuracy"] <= 1
    assert payload["machine"]
    assert payload["chunks_stored_offline"] >= 8
    hf, blend, block = payload["results"]
    assert blend["recompute_ratio"] == 0.1 and "recompute_ratio" not in block and "recompute_ratio" not in hf


def test_a_recompute_ratio_outside_0_1_is_one_line_and_exit_2() -> None:
    from service_helpers import kvshelf_cli

    result = kvshelf_cli("bench", "rag-chain", "--recompute-ratio", "1.5")
    assert result.returncode == 2 and "recompute ratio must be in [0, 1]" in result.stderr
    assert "Traceback" not in result.stderr
