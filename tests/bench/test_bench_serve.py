"""`kvshelf bench serve` at its smallest: SmolLM2, 2 clients (one chat, one RAG) for a few seconds, both systems."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvshelf.bench.serve import run
from kvshelf.cli.views.demo_job import make_documents

pytestmark = pytest.mark.slow  # a whole benchmark run: scheduled first (tests/conftest.py)

RESULT_KEYS = {"system", "workload", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "accuracy"}


def abstract_sized_corpus(path) -> str:
    """A JSONL corpus of records the size of the abstracts corpus's (~14 sentences, ~320 tokens), cut from the demo's
    synthetic documents: the run is the same with or without ``../shared`` (whose documents, 4 to a chat, would
    otherwise be ~1,800-token demo documents and make one HF chat request take ~40 s here)."""
    sentences = [s.strip() + "." for d in make_documents(count=4, target_tokens=None) for s in d.text.split(". ")]
    records = [sentences[i: i + 14] for i in range(0, len(sentences) - 13, 14)]
    path.write_text("".join(json.dumps({"title": f"Record {n}", "abstract": " ".join(r)}) + "\n"
                            for n, r in enumerate(records)))
    return str(path)


def test_bench_serve_small_run_writes_its_schema(tmp_path):
    out = tmp_path / "serve.json"
    corpus = abstract_sized_corpus(tmp_path / "corpus.jsonl")
    payload = run(json_path=str(out), corpus=corpus, seconds=2, clients=2, turns=2,
                  turn_new_tokens=4, pool=7, documents=2, console=Console(quiet=True), progress=False)
    written = json.loads(out.read_text())
    assert written["results"] == payload["results"]
    rows = {(r["system"], r["workload"]): r for r in written["results"]}
    assert set(rows) == {(s, w) for s in ("hf", "kvshelf") for w in ("chat", "rag", "all")}
    for r in written["results"]:
        assert set(r) == RESULT_KEYS, r
        assert r["requests_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"], r
        assert 0.0 <= r["accuracy"] <= 1.0, r
    for system in ("hf", "kvshelf"):  # every client finished at least the request it started before the deadline
        counts = written["requests"][system]
        assert counts["chat"]["requests"] >= 1 and counts["rag"]["requests"] >= 1, counts
        assert counts["chat"]["asked"] >= 1, counts  # a conversation's first turn asks for the planted code
    assert written["requests"]["hf"]["rag"]["reused_tokens"] == 0
    rag = written["requests"]["kvshelf"]["rag"]  # block attention: only the question is prefilled
    assert 0 < rag["reused_tokens"] < rag["prompt_tokens"], rag
    chat = written["requests"]["kvshelf"]["chat"]  # the first turn reuses its precomputed document
    assert chat["reused_tokens"] > 1000 and written["settings"]["chat"]["precomputed_documents"], chat
    assert written["settings"]["torch_threads"] == 1 and written["settings"]["clients"] == 2
    # chat reuse is exact: the kvshelf conversation answers as plain HF did on the same requests
    same = written["same_answers"]["chat"]
    assert same["requests"] >= 1 and same["same"] == same["requests"], same
    turns = written["chat_turns"]
    assert [t["turn"] for t in turns] == [1, 2]
    assert turns[1]["context_tokens"] > turns[0]["context_tokens"] + 4  # the first answer is in the history
    assert all(t["ttft_reuse_s"] > 0 and t["ttft_no_reuse_s"] > 0 for t in turns)
    assert turns[0]["reused_tokens"] == 0 and turns[1]["reused_tokens"] > 0  # turn 1's KV
