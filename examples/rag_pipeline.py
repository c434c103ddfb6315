"""A small RAG pipeline: chunks precomputed once, retrieved by TF-IDF, answered without prefilling them.

Shows: ``kvshelf.precompute`` stores the KV of every chunk of the documents; a tiny TF-IDF retriever (standard
library only) picks the chunks closest to the question; ``kvshelf.RAGGenerator`` assembles the retrieved chunks'
stored KV (``on_missing="error"``: it would raise rather than recompute one) and prefills only the question.
The same question is then answered with ``mode="full"`` (everything prefilled) to compare TTFT. (SmolLM2-135M is a
test model: its answers may be wrong; a larger model is loaded the same way, ``kvshelf.load_model(DIR)``.)

Run (from a checkout after ``make install``)::

    .venv/bin/python examples/rag_pipeline.py                     # a few built-in paragraphs
    .venv/bin/python examples/rag_pipeline.py ../shared/data/abstracts.jsonl --limit 40 \\
        --question "How are talking videos generated from a portrait?"

A corpus is a JSONL file of ``{"title", "abstract"}`` records or plain text files (one document each).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
from collections import Counter
from pathlib import Path

import kvshelf

PARAGRAPHS = [
    "Holloway Bikes repairs bicycles in its workshop on Canal Street. A standard service costs 45 euros and takes "
    "two working days; brakes and gears are adjusted and the chain is cleaned.",
    "Holloway Bikes rents city bikes by the day for 15 euros and electric bikes for 35 euros. A deposit of 100 "
    "euros is taken and returned when the bike comes back undamaged.",
    "The Holloway Bikes shop is open from 9:00 to 18:00 on weekdays and from 10:00 to 16:00 on Saturdays. It is "
    "closed on Sundays and public holidays.",
    "Customers who buy a new bike at Holloway Bikes get their first service free within six months. Frames carry "
    "a five-year warranty, electric motors two years.",
    "Holloway Bikes was founded in 2011 by Ada Holloway, a former courier. It employs eight mechanics and sponsors "
    "a youth cycling club every summer.",
]
SYSTEM = "<|im_start|>system\nAnswer the question using the passages below.<|im_end|>\n<|im_start|>user\n"


def read_corpus(paths: list[Path], limit: int) -> list[str]:
    docs: list[str] = []
    for path in paths:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            docs += [f"{r.get('title', '')}. {r['abstract']}" for r in records]
        else:
            docs.append(path.read_text())
    return docs[:limit]


def terms(text: str) -> list[str]:
    """Lower-case words of 3+ letters, a plural's "s" dropped: a crude stemmer that is good enough here."""
    return [w[:-1] if len(w) > 3 and w.endswith("s") else w for w in re.findall(r"[a-z0-9]{3,}", text.lower())]


def tf_idf_top(question: str, texts: list[str], k: int) -> list[int]:
    """Indices of the ``k`` texts whose TF-IDF score for the question's words is highest."""
    words = [Counter(terms(text)) for text in texts]
    df = Counter(word for counts in words for word in counts)
    query = set(terms(question))
    scores = [sum(counts[w] / sum(counts.values()) * math.log(len(texts) / df[w]) for w in query if w in counts)
              for counts in words]
    return sorted(range(len(texts)), key=lambda i: -scores[i])[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="*", type=Path, help="JSONL or text files (default: built-in paragraphs)")
    parser.add_argument("--question", default="How much does it cost to rent an electric bike?")
    parser.add_argument("--limit", type=int, default=40, help="at most this many documents")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=128, help="tokens per chunk")
    parser.add_argument("--mode", default="block-attention", choices=["block-attention", "reuse-blend", "reuse"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    docs = read_corpus(args.corpus, args.limit) if args.corpus else PARAGRAPHS

    model, tokenizer = kvshelf.load_model("smollm2-135m")
    with tempfile.TemporaryDirectory() as data_dir, kvshelf.open_embedded_store(data_dir) as store:
        done = kvshelf.precompute(docs, model, tokenizer, store, prefix=SYSTEM, modes=[args.mode],
                                  chunk_size=args.chunk_size, progress=False)
        print(f"precomputed {len(done.chunks)} chunks of {done.documents} documents in {done.seconds:.1f} s")

        hits = [done.chunks[i] for i in tf_idf_top(args.question, [c.text for c in done.chunks], args.top_k)]
        for chunk in hits:
            print(f"retrieved document {chunk.document} chunk {chunk.index}: {chunk.text[:70]!r}...")
        question = f"\nAnswer in one sentence: {args.question}<|im_end|>\n<|im_start|>assistant\n"
        with kvshelf.RAGGenerator(model, tokenizer, store, prefix=SYSTEM, on_missing="error",
                                  chunk_size=args.chunk_size) as rag:
            for mode in (args.mode, "full"):
                result = rag.generate(hits, question, mode=mode, max_new_tokens=args.max_new_tokens)
                print(f"{mode}: ttft={result.ttft_s * 1000:.1f} ms reused_chunks={result.reused_chunks} "
                      f"computed_chunks={result.computed_chunks} answer: {result.text.strip()!r}")


if __name__ == "__main__":
    main()
