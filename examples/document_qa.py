"""Question answering over one document, in process, with the document's KV cache reused.

Shows: ``kvshelf.CachedGenerator`` over the embedded store (memory over LMDB on local disk) with the SmolLM2
test model. The first question prefills the document and stores its KV; the second question over the same
document loads that KV and prefills only the question, so its time to first token (TTFT) is shorter.

Run (from a checkout after ``make install``, which prepares the model)::

    .venv/bin/python examples/document_qa.py
    .venv/bin/python examples/document_qa.py --document my_notes.txt --max-new-tokens 64 --data-dir ./kv-data

Without ``--data-dir`` the store lives in a temporary directory removed at exit; with it, a second run of the
script reuses the document from disk even for its first question.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import kvshelf

DOCUMENT = """\
The Meridian Line is a light-rail line that opened in 2019 and links the harbour district to the northern \
university campus. It is 14 kilometres long and has 11 stations, three of them underground. Trains run every \
six minutes at peak hours and every twelve minutes in the evening. The line was built by a consortium of two \
engineering firms and cost 820 million euros, about 9 percent over its first budget. Its depot sits next to \
Ferris Junction, where drivers change shifts. In its first full year the line carried 21 million passengers; \
the busiest station was Central Market, followed by University North. A planned extension of four kilometres \
would reach the airport by 2028, and the city council approved its funding in March 2024. Each train has four \
cars, carries up to 260 people and draws power from an overhead line at 750 volts. The fare is the same as on \
the city's buses, and a single ticket is valid for 90 minutes of travel with transfers.
"""
QUESTIONS = ["How long is the Meridian Line and how many stations does it have?",
             "When will the extension reach the airport?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--document", type=Path, help="a text file to ask about (default: a built-in text)")
    parser.add_argument("--data-dir", type=Path, help="where the store keeps its blocks (default: a temp dir)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    document = args.document.read_text() if args.document else DOCUMENT

    model, tokenizer = kvshelf.load_model("smollm2-135m")
    # The document sits at the head of every prompt, so its token ids are a prefix the store can reuse.
    head = ("<|im_start|>system\nAnswer the question from the document in one sentence.<|im_end|>\n"
            f"<|im_start|>user\nDocument:\n{document}\n")
    document_ids = tokenizer(head)["input_ids"]

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or Path(tmp)
        with kvshelf.open_embedded_store(data_dir) as store, \
                kvshelf.CachedGenerator(model, tokenizer, store) as gen:
            gen.generate("Hello", max_new_tokens=1, store=False)  # warm-up: the first forward pass is slower
            print(f"document: {len(document_ids)} tokens")
            for n, question in enumerate(QUESTIONS, 1):
                tail = f"Question: {question}<|im_end|>\n<|im_start|>assistant\n"
                question_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
                result = gen.generate(document_ids + question_ids, max_new_tokens=args.max_new_tokens,
                                      cacheable_prefix=len(document_ids),  # store the document, all of it
                                      wait=True)  # store before returning (else: a writer thread does it)
                print(f"Q{n}: {question}")
                print(f"A{n}: {result.text.strip()}")
                print(f"question {n}: ttft={result.ttft_s * 1000:.1f} ms reused={result.reused_tokens} "
                      f"prefilled={result.prefilled_tokens} tokens")


if __name__ == "__main__":
    main()
