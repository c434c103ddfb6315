"""Follow a kvshelf server's KV events, as a router would: which blocks each server holds, in which tier.

Shows: ``kvshelf.RemoteStore.subscribe_events`` opens the ``SubscribeEvents`` stream of a namespace. The script
then puts a chain of three small blocks (random KV, no model needed), deletes the last one, and prints the
``BlockStored`` / ``BlockRemoved`` events they cause: one per block and tier (``memory``, ``disk``, ``redis``).
It keeps, per block, the set of tiers holding it, as a router does, and stops once the deleted block is held
nowhere. With ``--watch`` it only prints events, until Ctrl-C (like ``kvshelf events``).

Run against a server (start one with ``kvshelf serve --config examples/serve.toml``)::

    .venv/bin/python examples/events_subscriber.py 127.0.0.1:50051
    .venv/bin/python examples/events_subscriber.py 127.0.0.1:50051 --watch --token T   # live events only
"""

from __future__ import annotations

import argparse
import time

import torch

import kvshelf


def describe(event) -> str:
    kind = event.WhichOneof("event")  # "stored", "removed" or "cleared"
    if kind == "stored":
        s = event.stored
        return (f"seq {event.seq} BlockStored  {s.block_hashes[0].hex()} medium={s.medium} tokens={s.block_size} "
                f"parent={s.parent_block_hash.hex() or '-'} bytes={s.nbytes}")
    if kind == "removed":
        r = event.removed
        return f"seq {event.seq} BlockRemoved {r.block_hashes[0].hex()} medium={r.medium} reason={r.reason}"
    return f"seq {event.seq} AllBlocksCleared medium={event.cleared.medium or 'all'}"


def demo_blocks(namespace: str, count: int = 3, tokens: int = 16) -> list[tuple[bytes, kvshelf.KVBlock]]:
    """A chain of blocks of a made-up 2-layer model, keyed as kvshelf chains prefix blocks (``prefix_block_keys``);
    the model's fingerprint is new on every run, so its blocks are too."""
    fingerprint = f"example-model-{time.time_ns()}"
    ids = list(range(count * tokens))
    keys = kvshelf.prefix_block_keys(fingerprint, namespace, ids, tokens)
    entries = []
    for i, key in enumerate(keys):
        span = tuple(ids[i * tokens:(i + 1) * tokens])
        block = kvshelf.KVBlock(keys=torch.randn(2, 2, tokens, 8), values=torch.randn(2, 2, tokens, 8),
                                token_ids=span, start_pos=i * tokens, fingerprint=fingerprint, namespace=namespace,
                                extra={"parent": keys[i - 1].hex()} if i else {})
        entries.append((key, block))
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", help="HOST:PORT of a kvshelf server")
    parser.add_argument("--token", help="bearer token (servers with a tokens file)")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--watch", action="store_true", help="only print events, until Ctrl-C")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the demo's events")
    args = parser.parse_args()

    with kvshelf.RemoteStore(args.server, token=args.token, namespace=args.namespace) as store, \
            store.subscribe_events(from_seq=0) as subscription:  # 0: live events from now on
        messages = iter(subscription)
        started = next(messages).started  # the first message says where the stream starts
        print(f"subscribed to namespace {started.namespace!r}, next event seq {started.next_seq}")
        if args.watch:
            try:
                for message in messages:
                    for event in message.events:
                        print(describe(event), flush=True)
            except KeyboardInterrupt:  # Ctrl-C: leaving the with block cancels the stream
                pass
            return

        entries = demo_blocks(store.namespace)
        print(f"put {store.put_many(entries)} blocks")
        deleted = entries[-1][0]
        print(f"deleted {store.delete([deleted])} block {deleted.hex()}")
        held: dict[bytes, set[str]] = {}  # block -> tiers holding it: what a router keeps
        deadline = time.monotonic() + args.timeout
        for message in messages:  # an empty heartbeat comes every 5 s, so the deadline is checked
            for event in message.events:
                print(describe(event))
                if event.HasField("stored"):
                    held.setdefault(event.stored.block_hashes[0], set()).add(event.stored.medium)
                elif event.HasField("removed"):
                    held.get(event.removed.block_hashes[0], set()).discard(event.removed.medium)
            if deleted in held and not held[deleted] or time.monotonic() > deadline:
                break
        print(f"the deleted block is held in: {sorted(held.get(deleted, ())) or 'no tier'}")
        print(f"blocks still held: {sum(1 for media in held.values() if media)}")


if __name__ == "__main__":
    main()
