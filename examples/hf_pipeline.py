"""Plain HuggingFace code reusing a context that kvshelf stored: ``model.generate`` and ``pipeline``.

Shows: ``kvshelf.cached_prefix`` turns the longest stored prefix of a prompt into a ready ``DynamicCache``, cropped
so that ``generate`` computes the prompt's last token itself. Hand it to ``model.generate`` (its
``generate_inputs()``) or to ``transformers.pipeline("text-generation")`` as ``past_key_values``: only the
uncached tail of the prompt is prefilled, and the answer is the one the uncached call gives.

Here a ``CachedGenerator`` stores the context first (in a real deployment: any kvshelf front door, another
process or a server, ``kvshelf.RemoteStore``). Blocks are found by key, so ``block_size`` must be the one the
blocks were stored with (256 by default; 64 here so that the short context fills a few blocks).

Run (from a checkout after ``make install``)::

    .venv/bin/python examples/hf_pipeline.py --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import pipeline

import kvshelf

BLOCK_SIZE = 64
CONTEXT = (
    "Release notes, version 4.2 of the Orchard scheduler. The scheduler now places jobs on the node with the most "
    "free memory instead of the first node that fits, which cut out-of-memory restarts by a third in our tests. "
    "Job priorities range from 0 to 9; a job of priority 9 may preempt any job below 5. Logs are kept for 14 days, "
    "up from 7. The command line gains `orchard drain NODE`, which stops new jobs on a node and waits for the "
    "running ones to finish. Support for the old YAML job format ends with version 5.0; convert job files with "
    "`orchard convert`. Known issue: a node whose clock drifts by more than two seconds may be marked unhealthy."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="Which priority can preempt other jobs?")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    model, tokenizer = kvshelf.load_model("smollm2-135m")
    prompt = f"{CONTEXT}\n\nQuestion: {args.question}\nAnswer:"
    with tempfile.TemporaryDirectory() as data_dir, kvshelf.open_embedded_store(data_dir) as store:
        with kvshelf.CachedGenerator(model, tokenizer, store, block_size=BLOCK_SIZE) as gen:
            gen.generate(CONTEXT, max_new_tokens=1, wait=True)  # stores the context's full blocks

        # 1. model.generate with the exported cache
        prefix = kvshelf.cached_prefix(model, store, prompt, tokenizer=tokenizer, block_size=BLOCK_SIZE)
        print(f"prompt: {prefix.input_ids.shape[1]} tokens, cached prefix: {prefix.reused_tokens} tokens")
        with torch.inference_mode():
            out = model.generate(**prefix.generate_inputs(), max_new_tokens=args.max_new_tokens, do_sample=False)
        cached_text = tokenizer.decode(out[0, prefix.input_ids.shape[1]:], skip_special_tokens=True)
        print(f"model.generate with the cache: {cached_text.strip()!r}")

        # 2. a text-generation pipeline with the cache as past_key_values (a fresh copy: generate grows it)
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "return_full_text": False}
        cache = kvshelf.cached_prefix(model, store, prompt, tokenizer=tokenizer, block_size=BLOCK_SIZE).cache
        piped = pipe(prompt, past_key_values=cache, **settings)[0]["generated_text"]
        print(f"pipeline with the cache: {piped.strip()!r}")

        plain = pipe(prompt, **settings)[0]["generated_text"]  # the uncached reference
        print(f"same answer as without the cache: {piped == plain == cached_text}")


if __name__ == "__main__":
    main()
