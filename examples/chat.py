"""A multi-turn chat whose history is never prefilled twice.

Shows: ``kvshelf.Conversation`` over a ``CachedGenerator``. After each turn the conversation stores the KV of
everything so far (the chat template's tokens and the answer), so the next turn loads it and prefills only the
new user message and its markup. Each turn prints how many prompt tokens were reused and how many prefilled.

Run (from a checkout after ``make install``)::

    .venv/bin/python examples/chat.py
    .venv/bin/python examples/chat.py --max-new-tokens 64 "What is a KV cache?" "Why reuse it?" "Summarise."

Each argument is one user message (default: three built-in ones). The store is a temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile

import kvshelf

MESSAGES = [
    "I am planning a three-day trip to Lisbon in spring. What should I see on the first day?",
    "And on the second day, something outside the city?",
    "Give me one tip for the last evening.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("messages", nargs="*", default=MESSAGES, help="the user's messages, one per turn")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    model, tokenizer = kvshelf.load_model("smollm2-135m")
    with tempfile.TemporaryDirectory() as data_dir, \
            kvshelf.open_embedded_store(data_dir) as store, \
            kvshelf.CachedGenerator(model, tokenizer, store) as gen:
        chat = kvshelf.Conversation(gen, system="You are a concise travel assistant.")
        for n, message in enumerate(args.messages, 1):
            turn = chat.send(message, max_new_tokens=args.max_new_tokens)
            print(f"user: {message}")
            print(f"assistant: {turn.text.strip()}")
            print(f"turn {n}: reused={turn.reused_tokens} prefilled={turn.prefilled_tokens} tokens "
                  f"ttft={turn.ttft_s * 1000:.1f} ms")
        print(f"the conversation holds {len(chat.messages)} messages")


if __name__ == "__main__":
    main()
