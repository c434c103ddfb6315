"""Two inference workers sharing one ``kvshelf serve``: the second finds the document the first prefilled.

Shows: each worker is its own process with its own copy of the model and a ``kvshelf.RemoteStore`` pointed at
the server. Worker 1 answers a question over a document and stores the document's KV on the server; worker 2
answers another question over the same document and loads that KV from the server instead of prefilling it.
At the end the script prints how many blocks each of the server's tiers holds (memory, disk and, with a Redis
behind the server, redis: other servers on the same Redis would find the blocks too).

Run (from a checkout after ``make install``), with a Redis and a server::

    redis-server --port 6379 --save '' &
    .venv/bin/kvshelf serve --config examples/serve.toml &      # listens on 127.0.0.1:50051
    .venv/bin/python examples/shared_server.py 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import multiprocessing

import kvshelf

DOCUMENT = """\
Incident report 2291. On Tuesday at 14:05 the payment gateway began refusing one request in five. The cause \
was a certificate on the second load balancer that had expired at 14:00; the first balancer had been renewed \
the week before, the second had been missed because it was added to the pool after the renewal job was set up. \
The on-call engineer, Priya, removed the second balancer from the pool at 14:31 and errors stopped at once. A \
new certificate was installed at 15:10 and the balancer returned to the pool at 15:20. About 41,000 payments \
failed and were retried by clients; none was lost. Follow-ups: the renewal job now discovers balancers from \
the pool itself, and an alert fires thirty days before any certificate expires.
"""
QUESTIONS = ["Why did the payment gateway refuse requests?", "Who fixed the problem, and when?"]


def worker(number: int, server: str, question: str, max_new_tokens: int) -> None:
    """One inference worker: its own model and a RemoteStore on the shared server."""
    model, tokenizer = kvshelf.load_model("smollm2-135m")
    head = ("<|im_start|>system\nAnswer from the report in one sentence.<|im_end|>\n"
            f"<|im_start|>user\nReport:\n{DOCUMENT}\n")
    document_ids = tokenizer(head)["input_ids"]
    tail = tokenizer(f"Question: {question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    with kvshelf.RemoteStore(server) as store, kvshelf.CachedGenerator(model, tokenizer, store) as gen:
        result = gen.generate(document_ids + tail["input_ids"], max_new_tokens=max_new_tokens,
                              cacheable_prefix=len(document_ids), wait=True)
    print(f"worker {number}: {question}\nworker {number}: {result.text.strip()}")
    print(f"worker {number}: reused={result.reused_tokens} prefilled={result.prefilled_tokens} tokens "
          f"ttft={result.ttft_s * 1000:.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", nargs="?", default="127.0.0.1:50051", help="HOST:PORT of kvshelf serve")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    spawn = multiprocessing.get_context("spawn")  # fresh processes, as separate workers would be
    for number, question in enumerate(QUESTIONS, 1):  # one after the other: the second comes after the first
        process = spawn.Process(target=worker, args=(number, args.server, question, args.max_new_tokens))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"worker {number} failed (exit code {process.exitcode})")

    with kvshelf.RemoteStore(args.server) as store:
        stats = store.stats()
    for tier in stats["tiers"]:
        print(f"server tier {tier['name']}: {tier['blocks']} blocks, {tier['bytes']} bytes")


if __name__ == "__main__":
    main()
