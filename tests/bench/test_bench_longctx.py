"""``kvshelf bench longctx``: a short real run (SmolLM2, one 1K sample per task, two methods, no kvpress) writes the
JSON the issue fixes; the tables and averages are pure functions of the payload."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvshelf.bench.longctx import averages, passed, results_tables, run

pytestmark = pytest.mark.slow  # a whole benchmark run: scheduled first (tests/conftest.py)

FIELDS = {"method": str, "impl": str, "task": str, "tokens": int, "kv_fraction": float, "resident_fraction": float,
          "accuracy": float, "ttft_s": float, "tpot_s": float}


def _row(method: str, impl: str, budget: float, task: str, accuracy: float) -> dict:
    return {"method": method, "impl": impl, "budget": budget, "task": task, "tokens": 4096, "kv_fraction": budget,
            "resident_fraction": 1.0, "accuracy": accuracy, "dppl_rel": None, "ttft_s": 1.0, "tpot_s": 0.1}


def test_averages_count_only_the_tasks_full_attention_passes() -> None:
    rows = [_row("full", "kvshelf", 1.0, "vt", 0.8), _row("full", "kvshelf", 1.0, "cwe", 0.1),
            _row("snapkv", "kvshelf", 0.25, "vt", 0.6), _row("snapkv", "kvshelf", 0.25, "cwe", 0.0),
            _row("snapkv", "kvpress", 0.25, "vt", 0.4), _row("snapkv", "kvpress", 0.25, "cwe", 0.0)]
    payload = {"model": "m", "machine": "x", "samples": 1, "kvpress": "kvpress 0.5.5", "results": rows}
    before = json.dumps(payload)
    assert passed(payload) == [("vt", 4096)]
    got = {(a["impl"], a["method"]): a["accuracy"] for a in averages(payload)}
    assert got == {("kvshelf", "full"): 0.8, ("kvshelf", "snapkv"): 0.6, ("kvpress", "snapkv"): 0.4}
    console = Console(record=True, width=250)
    for table in results_tables(payload):
        console.print(table)
    text = console.export_text()
    assert "cwe@4K ✗" in text and "+0.200" in text and json.dumps(payload) == before


def test_short_run_writes_the_json(tmp_path, corpus_path) -> None:
    """One run (a static method and tier-sparse, two budgets): every row of the schema, and tier-sparse's rows at
    each budget from one prefill."""
    out = tmp_path / "longctx.json"
    run(json_path=str(out), corpus=corpus_path, tasks=("niah_single", "ppl"), lengths=(1024,),
        methods=("snapkv", "tier-sparse"), budgets=(0.25, 0.5), samples=1, kvpress=False, console=Console(width=200))
    payload = json.loads(out.read_text())
    assert payload["status"] == "complete" and payload["machine"]
    rows = payload["results"]
    assert {(r["method"], r["budget"], r["task"]) for r in rows} == {
        (m, b, t) for m, b in (("full", 1.0), ("snapkv", 0.25), ("snapkv", 0.5), ("tier-sparse", 0.25),
                               ("tier-sparse", 0.5)) for t in ("niah_single", "ppl")}
    for row in rows:
        for name, kind in FIELDS.items():
            assert isinstance(row[name], kind), (name, row)
        assert row["impl"] == "kvshelf" and row["tokens"] == 1024
        assert 0.0 <= row["accuracy"] <= 1.0 and row["ttft_s"] > 0 and row["tpot_s"] > 0
        if row["method"] == "full":
            assert row["kv_fraction"] == 1.0 and row["resident_fraction"] == 1.0
        elif row["method"] == "snapkv":
            assert abs(row["kv_fraction"] - row["budget"]) < 0.01 and row["resident_fraction"] == 1.0
        else:
            assert abs(row["kv_fraction"] - row["budget"]) < 0.07
        if row["task"] == "ppl":
            assert isinstance(row["dppl_rel"], float)
            assert row["dppl_rel"] == 0.0 if row["method"] == "full" else row["dppl_rel"] > -0.5
        else:
            assert row["dppl_rel"] is None
    for task in ("niah_single", "ppl"):
        narrow = next(r for r in rows if r["method"] == "tier-sparse" and r["task"] == task and r["budget"] == 0.25)
        assert 0.0 < narrow["resident_fraction"] < 1.0
