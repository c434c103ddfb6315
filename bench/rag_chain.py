"""``kvshelf bench rag-chain``: one LangChain RAG chain, answered by LangChain's own HuggingFace chat model and by
kvshelf's, on ``kvshelf bench rag``'s planted-fact questions over 8 retrieved chunks.

The chain: ``{"context": retriever | format, "question": ...} | ChatPromptTemplate | chat model |
StrOutputParser``. The prompt is ``bench rag``'s (its system prompt; the user turn holds its intro, the 8 chunks
and its question); its chunks are corpus abstracts cut to 150 tokens, one of them carrying a planted 4-digit code
(``bench.rag.make_cases``). Retrieval is simulated: the retriever returns the case's 8 chunks (the needle at a
random place), as ``bench serve`` does.

Systems, on the same model object:

* ``hf``: ``ChatHuggingFace`` over ``HuggingFacePipeline`` (``adapters.integrations.hf_baseline``); the context
  slot holds the chunks' text, every request prefills the whole prompt.
* ``kvshelf``: ``KVShelfChatModel`` (``adapters.integrations.langchain``), in its default mode or in each of
  ``modes`` (a row each); the context slot holds ``format_documents(docs)``, so each chunk's KV comes from the
  store. The chunks were stored before the run (not timed), as a RAG pipeline precomputes its corpus offline.

A case's answer is right when it holds the planted code (the chat models' answers are not opened with "The secret
code is", as ``bench rag``'s are: a chain's chat model writes the whole assistant turn). TTFT: from
``chain.stream(...)`` to its first non-empty piece, per case; the systems take turns, in reverse order every other
case.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench.common import corpus_texts, machine_description, save_results
from kvshelf.bench.rag import INTRO, QUESTION, SYSTEM, make_cases

NEW_TOKENS = 24  # room for a wordy answer that names the code late
SEPARATOR = "\n\n"
EXAMPLES = 5  # answers kept in the JSON


def _chain(retriever: Any, format_docs: Callable[[list[Any]], str], llm: Any) -> Any:
    from operator import itemgetter

    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", INTRO + "{context}" + QUESTION)])
    return ({"context": itemgetter("case") | retriever | format_docs, "question": itemgetter("question")}
            | prompt | llm | StrOutputParser())


def _retriever(cases: list[list[str]]) -> Any:
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    class CaseRetriever(BaseRetriever):
        """Returns case ``int(query)``'s chunks (simulated retrieval)."""

        chunks: list[list[str]]

        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
            return [Document(page_content=text) for text in self.chunks[int(query)]]

    return CaseRetriever(chunks=cases)


def _timed(chain: Any, inputs: dict[str, Any]) -> tuple[float, str]:
    started = time.perf_counter()
    first: float | None = None
    text = ""
    for piece in chain.stream(inputs):
        if piece and first is None:
            first = time.perf_counter() - started
        text += piece
    return (first if first is not None else time.perf_counter() - started), text


def run(*, json_path: str | None, corpus: str | None, cases: int = 20, model_name: str = "smollm2-135m",
        modes: Sequence[str] | None = None, console: Console | None = None,
        recompute_ratio: float | None = None) -> dict[str, Any]:
    """Run the chain with ``hf`` and with ``kvshelf`` in each of ``modes`` (default: the chat model's default
    mode), case by case in turn; one result row per system and mode. ``recompute_ratio``: ``reuse-blend``'s share
    of chunk tokens recomputed (default: ``RAGGenerator``'s)."""
    from kvshelf.adapters.integrations.core import DEFAULT_MODE, RAGChat
    from kvshelf.adapters.integrations.hf_baseline import hf_chat_model
    from kvshelf.adapters.integrations.langchain import KVShelfChatModel, format_documents
    from kvshelf.adapters.model import load_model
    from kvshelf.adapters.rag import precompute
    from kvshelf.kvstore import open_embedded_store
    from kvshelf.reuse.blend import DEFAULT_RATIO

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the baseline's classes must never reach for the network
    console = console or Console()
    modes = list(dict.fromkeys(modes or [DEFAULT_MODE]))
    model, tokenizer = load_model(model_name)
    texts = list(corpus_texts(corpus))
    _, needle_cases = make_cases(tokenizer, texts, cases)
    docs = [[tokenizer.decode(ids).rstrip("\n") for ids in case["chunks"]] for case in needle_cases]
    retriever = _retriever(docs)
    runs: list[tuple[str, str | None]] = [("hf", None), *(("kvshelf", m) for m in modes)]
    with tempfile.TemporaryDirectory(prefix="kvshelf-rag-chain-") as tmp:
        store = open_embedded_store(tmp)
        options = {"recompute_ratio": recompute_ratio} if recompute_ratio is not None else {}
        rags = {m: RAGChat(model, tokenizer, store, max_new_tokens=NEW_TOKENS, mode=m, **options) for m in modes}
        # offline (not timed): every case's chunks stored as the modes read them, after the chat prefix
        stored = 0
        rag = rags[modes[0]]
        for case_docs in docs:
            rendered = rag.render([{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": INTRO + format_documents(case_docs) + QUESTION}])
            stored += precompute(rendered.chunks, model, tokenizer, store, prefix=rendered.prefix,
                                 modes=[m for m in modes if m != "full"] or [DEFAULT_MODE], progress=False).computed
        chains = {("hf", None): _chain(retriever, lambda ds: "".join(d.page_content + SEPARATOR for d in ds),
                                       hf_chat_model(model, tokenizer, NEW_TOKENS))}
        for m in modes:
            chains["kvshelf", m] = _chain(retriever, format_documents, KVShelfChatModel(rag=rags[m]))
        for chain in chains.values():  # warm-up (first-call setup), not counted
            _timed(chain, {"case": "0", "question": QUESTION})
        rows: dict[tuple[str, str | None], dict[str, list]] = {r: {"ttft": [], "hit": [], "answers": []}
                                                             for r in runs}
        for n, case in enumerate(tqdm(needle_cases, desc="rag-chain cases", unit="case")):
            for key in runs if n % 2 == 0 else runs[::-1]:
                ttft, text = _timed(chains[key], {"case": str(n), "question": QUESTION})
                rows[key]["ttft"].append(ttft)
                rows[key]["hit"].append(case["code"] in text)
                rows[key]["answers"].append(text)
        for r in rags.values():
            r.close()
        store.close()
    hf_answers = rows["hf", None]["answers"]
    results = [{"system": system, "framework": "langchain", "mode": mode,
                "ttft_p50_s": round(statistics.median(rows[system, mode]["ttft"]), 4),
                "accuracy": round(sum(rows[system, mode]["hit"]) / len(rows[system, mode]["hit"]), 4),
                "ttft_mean_s": round(statistics.fmean(rows[system, mode]["ttft"]), 4),
                "cases": len(rows[system, mode]["hit"]),
                "same_answer_as_hf": sum(a == b for a, b in zip(hf_answers, rows[system, mode]["answers"],
                                                                strict=True))}
               for system, mode in runs]
    ratio = recompute_ratio if recompute_ratio is not None else DEFAULT_RATIO
    for r in results:
        if r["mode"] == "reuse-blend":
            r["recompute_ratio"] = ratio
    payload = {"results": results, "machine": machine_description(), "model": model_name, "cases": cases,
               "chunks_per_case": 8, "modes": modes, "new_tokens": NEW_TOKENS, "chunks_stored_offline": stored,
               "examples": [{"code": case["code"], **{system if mode is None else f"{system}/{mode}":
                                                      rows[system, mode]["answers"][n] for system, mode in runs}}
                            for n, case in enumerate(needle_cases[:EXAMPLES])]}
    console.print(results_table(payload))
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results as a table: one row per system, with the TTFT speedup and the accuracy against ``hf``."""
    base = next((r for r in payload["results"] if r["system"] == "hf"), None)
    table = Table(title=f"LangChain RAG chain, planted-fact QA over 8 chunks ({payload.get('machine', '?')})")
    for column in ("system", "mode", "framework", "TTFT p50 (s)", "speedup", "accuracy", "accuracy vs hf"):
        table.add_column(column, justify="right")
    for r in payload["results"]:
        speedup = f"{base['ttft_p50_s'] / r['ttft_p50_s']:.1f}x" if base and r["ttft_p50_s"] > 0 else "-"
        relative = f"{r['accuracy'] / base['accuracy']:.0%}" if base and base["accuracy"] > 0 else "-"
        mode = r.get("mode") or "-"
        if "recompute_ratio" in r:
            mode += f" (r={r['recompute_ratio']:g})"
        table.add_row(r["system"], mode, r["framework"], f"{r['ttft_p50_s']:.3f}", speedup,
                      f"{r['accuracy']:.1%}", relative)
    return table
