"""``kvshelf demo``: long-document QA on SmolLM2 with the embedded store (no server, no corpus needed).

It writes its own documents (made-up project handbooks with facts to ask about), asks several questions per
document and shows cold TTFT (full prefill), warm TTFT from memory, and warm TTFT from disk after the store
is reopened in a new process, with the speedups, the hit rate and the bytes per tier.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.kvstore.stats import Metric

if TYPE_CHECKING:
    from kvshelf.kvstore.protocol import BlockStore

_FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena"]
_LAST = ["Moreau", "Okafor", "Lindqvist", "Tanaka", "Rossi", "Novak", "Haddad", "Keller", "Silva", "Brandt"]
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Montreal", "Osaka", "Tallinn", "Porto", "Quito", "Graz", "Perth"]
_PROJECTS = ["Falcon", "Juniper", "Quartz", "Meridian", "Lantern", "Cobalt", "Harbor", "Nimbus", "Saffron"]
_MONTHS = ["January", "March", "April", "June", "August", "September", "October", "December"]
_TEAMS = ["platform", "research", "finance", "design", "operations", "security", "data", "support"]
_THINGS = ["release plan", "risk register", "hiring budget", "test results", "vendor contract", "roadmap",
           "incident report", "customer survey", "capacity forecast", "training schedule"]
_VERBS = ["reviewed", "updated", "approved", "questioned", "summarised", "rewrote", "audited", "presented"]


@dataclass(frozen=True)
class Document:
    """A made-up handbook and questions about it with their expected answers."""

    title: str
    text: str
    questions: tuple[tuple[str, str], ...]


def make_documents(count: int = 2, target_tokens: int | None = 1800, seed: int = 7) -> list[Document]:
    """``count`` documents of roughly ``target_tokens`` tokens (about 23 tokens a sentence)."""
    rng = random.Random(seed)
    sentences = (target_tokens or 1500) // 23
    docs = []
    for d in range(count):
        projects = rng.sample(_PROJECTS, 3)
        facts = {}
        lines = [f"Handbook {d + 1} of the Northwind Group, internal edition."]
        for p in projects:
            leader = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
            city, budget, month = rng.choice(_CITIES), rng.randrange(120, 990), rng.choice(_MONTHS)
            facts[p] = (leader, city, budget)
            lines.append(
                f"Project {p} is led by {leader}, who works from the {city} office. The budget of project {p} "
                f"is {budget} thousand euros, and its launch is planned for {month}."
            )
        while len(lines) < sentences:
            lines.append(
                f"In {rng.choice(_MONTHS)} the {rng.choice(_TEAMS)} team {rng.choice(_VERBS)} the "
                f"{rng.choice(_THINGS)} of project {rng.choice(projects)} and recorded {rng.randrange(2, 60)} "
                f"open items for the {rng.choice(_TEAMS)} team."
            )
        fact_lines, filler = lines[1 : 1 + len(projects)], lines[1 + len(projects) :]
        for line in fact_lines:  # spread the facts through the document
            filler.insert(rng.randrange(len(filler) + 1), line)
        p0, p1, p2 = projects
        questions = (
            (f"Who leads project {p0}?", facts[p0][0]),
            (f"Which office does the leader of project {p1} work from?", facts[p1][1]),
            (f"What is the budget of project {p2}, in thousand euros?", str(facts[p2][2])),
        )
        docs.append(Document(f"Handbook {d + 1}", " ".join([lines[0], *filler]), questions))
    return docs


def _template_pieces(tokenizer: Any) -> tuple[str, str]:
    """The chat template split around the user message: (text before it, text after it)."""
    marker = "\x00DOC\x00"
    system = "Answer questions about the document in a few words."
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": marker}],
            tokenize=False, add_generation_prompt=True,
        )
        before, after = text.split(marker)
        return before, after
    return f"{system}\n\n", "\nAnswer:"


def prompt_ids(tokenizer: Any, document: Document, question: str) -> tuple[list[int], int]:
    """Header + document + question, tokenized in pieces so the document's tokens never change;
    returns the ids and the length of the reusable context (header + document)."""
    before, after = _template_pieces(tokenizer)

    from kvshelf.adapters.prompts import prompt_ids as ids_of

    def enc(text: str) -> list[int]:
        return ids_of(text, tokenizer, add_special_tokens=False)

    context = enc(before + "Document:\n") + enc(document.text)
    return context + enc(f"\n\nQuestion: {question}" + after), len(context)


def _ask(generator: Any, tokenizer: Any, doc: Document, question: str, **kw: Any) -> dict[str, Any]:
    ids, context = prompt_ids(tokenizer, doc, question)
    result = generator.generate(ids, max_new_tokens=16, cacheable_prefix=context, **kw)
    return {"ttft_s": result.ttft_s, "answer": (result.text or "").strip(), "new_ids": result.new_ids,
            "reused": result.reused_tokens, "prompt_tokens": len(result.prompt_ids)}


def _open_store(data_dir: str, remote: str | None) -> BlockStore:
    """The embedded store in ``data_dir``, or a ``RemoteStore`` on ``remote`` (then ``data_dir`` holds only
    the demo's scratch files)."""
    if remote:
        from kvshelf.service.client import RemoteStore

        return RemoteStore(remote)
    from kvshelf.kvstore.embedded import open_embedded_store

    return open_embedded_store(data_dir)


def disk_phase(spec_path: str) -> None:
    """The new process: reopen the store (memory empty, LMDB holding the blocks) and ask again."""
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = load_model(spec["model"])
    store = _open_store(spec["data_dir"], spec.get("remote"))
    generator = CachedGenerator(model, tokenizer, store)
    generator.generate(list(range(10, 60)), max_new_tokens=2, reuse=False, store=False)  # warm-up
    reopened = store.stats()
    answers = [_ask(generator, tokenizer, doc, doc.questions[0][0], store=False)
               for doc in make_documents(spec["documents"], spec["tokens"])]
    Path(spec["out"]).write_text(json.dumps({"answers": answers, "stats": store.stats(), "reopened": reopened}))
    store.close()


def run_demo(
    *, model_name: str = "smollm2-135m", documents: int = 2, tokens: int = 1800, data_dir: str | None = None,
    console: Console | None = None, remote: str | None = None,
) -> dict[str, Any]:
    """Run the demo; with ``remote`` (HOST:PORT of `kvshelf serve`) both phases use that server's store."""
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.model import load_model

    console = console or Console()
    console.rule("[bold]kvshelf demo[/bold]: long-document QA with prefix reuse")
    started = time.perf_counter()
    with console.status(f"loading {model_name} (the first run converts the bundled GGUF: ~30 s)"):
        model, tokenizer = load_model(model_name)
    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvshelf-demo-")
        data_dir = tmp.name
    docs = make_documents(documents, tokens)
    store = _open_store(data_dir, remote)
    generator = CachedGenerator(model, tokenizer, store)
    generator.generate(list(range(10, 60)), max_new_tokens=2, reuse=False, store=False)  # warm-up
    rows = []
    for doc in tqdm(docs, desc="cold + warm-memory questions", unit="doc"):
        q0 = doc.questions[0][0]
        cold = _ask(generator, tokenizer, doc, q0, reuse=False, wait=True)  # full prefill, stores the blocks
        again = _ask(generator, tokenizer, doc, q0)
        others = [_ask(generator, tokenizer, doc, q) for q, _ in doc.questions[1:]]
        rows.append({"doc": doc, "cold": cold, "warm": [again, *others]})
    memory_stats = store.stats()
    store.close()
    with console.status("reopening the store in a new process (warm from disk)..."):
        spec = Path(data_dir) / "demo-spec.json"
        out = Path(data_dir) / "demo-disk.json"
        spec.write_text(json.dumps({"model": model_name, "data_dir": data_dir, "documents": documents,
                                    "tokens": tokens, "out": str(out), "remote": remote}))
        subprocess.run([sys.executable, "-m", "kvshelf.cli.views.demo_job", "--disk-phase", str(spec)], check=True)
        disk = json.loads(out.read_text())
    for row, answer in zip(rows, disk["answers"], strict=True):
        row["disk"] = answer
    summary = _report(console, rows, memory_stats, disk)
    console.print(f"[dim]demo finished in {time.perf_counter() - started:.0f} s; store at {data_dir}"
                  f"{' (temporary, removed now)' if tmp else ''}[/dim]")
    if tmp is not None:
        tmp.cleanup()
    return summary


def _report(console: Console, rows: list[dict], memory_stats: dict, disk: dict) -> dict[str, Any]:
    ttft = Table(title="Time to first token: cold (full prefill) vs warm (memory; disk in a new process)")
    for col in ("document", "tokens", "reused", "cold", "warm mem", "speedup", "warm disk", "speedup", "same"):
        ttft.add_column(col, justify="right")
    summary_rows = []
    for row in rows:
        cold, warm, disk_answer = row["cold"], row["warm"], row["disk"]
        warm_ttft = sorted(w["ttft_s"] for w in warm)[len(warm) // 2]
        same = warm[0]["new_ids"] == cold["new_ids"] and disk_answer["new_ids"] == cold["new_ids"]
        ttft.add_row(row["doc"].title, str(cold["prompt_tokens"]), str(warm[0]["reused"]),
                     f"{cold['ttft_s']:.2f}s", f"{warm_ttft:.3f}s", f"{cold['ttft_s'] / warm_ttft:.1f}x",
                     f"{disk_answer['ttft_s']:.3f}s", f"{cold['ttft_s'] / disk_answer['ttft_s']:.1f}x",
                     "yes" if same else "NO")
        summary_rows.append({"document": row["doc"].title, "cold_s": cold["ttft_s"], "warm_memory_s": warm_ttft,
                             "warm_disk_s": disk_answer["ttft_s"], "same_answer": same})
    console.print(ttft)
    qa = Table(title="Answers")
    for col in ("document", "question", "expected", "answer (warm)"):
        qa.add_column(col)
    for row in rows:
        for (question, expected), answer in zip(row["doc"].questions, row["warm"], strict=True):
            qa.add_row(row["doc"].title, question, expected, answer["answer"])
    console.print(qa)
    tiers = Table(title="Store (after the new process read from disk)")
    for col in ("tier", "codec", "blocks", "bytes", "hits", "misses", "bytes read"):
        tiers.add_column(col, justify="right")
    for t in disk["stats"]["tiers"]:
        tiers.add_row(t["name"], t["codec"], str(t["blocks"]), _mib(t["bytes"]), str(t[Metric.HITS]),
                      str(t[Metric.MISSES]), _mib(t[Metric.BYTES_READ]))
    console.print(tiers)
    first, second = memory_stats["retrieve_hit_rate"], disk["stats"]["retrieve_hit_rate"]
    console.print(
        f"lookup hit rate (blocks): first process {_pct(memory_stats['lookup_hit_rate'])}, "
        f"new process {_pct(disk['stats']['lookup_hit_rate'])}; retrieve hit rate: {_pct(first)}, {_pct(second)}"
    )
    return {"rows": summary_rows, "memory_stats": memory_stats, "disk_stats": disk["stats"]}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--disk-phase":
        disk_phase(sys.argv[2])
    else:
        raise SystemExit("run the demo with `kvshelf demo`")
