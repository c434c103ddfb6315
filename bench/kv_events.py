"""``kvshelf bench kv-events``: what publishing vLLM-format KV events (kvstore/vllm_events.py) costs a store's puts
and how soon a ZeroMQ subscriber has them.

Method: ``puts`` distinct blocks (``tokens`` token ids each) are put one by one into a memory-tier ``TieredStore``
(so a put is cheap and the events' share shows), once without a publisher (the anchor) and once with one and a
subscriber in another process (as a router is) reading and decoding every batch; each mode ``rounds`` times,
alternating, the fastest round of each kept. Reported: the put loop's seconds with and without events, their
difference per event (the put path's share: the listener, the batch of records, sending it to the publisher
process), the publisher process's CPU time per event (reading the records, encoding and sending the batches), their
sum (server time per event), the store process's CPU time per event (from the first put until every event is sent,
with events less without), and the delay from the last put's return to the last event's arrival.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

from rich.table import Table

from kvshelf.bench.common import machine_description, save_results
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.keys import chunk_key
from kvshelf.kvstore.memory_tier import MemoryTier
from kvshelf.kvstore.store import TieredStore, TierSpec
from kvshelf.kvstore.vllm_events import KVEventsSettings, VLLMEventPublisher

FINGERPRINT = "bench-kv-events"


def _blocks(puts: int, tokens: int) -> list[tuple[bytes, KVBlock]]:
    import torch

    keys = torch.zeros(1, 1, tokens, 8)
    out = []
    for i in range(puts):
        ids = [(i * tokens + j) % 50_000 for j in range(tokens)]
        block = KVBlock(keys=keys, values=keys, token_ids=ids, start_pos=0, fingerprint=FINGERPRINT)
        out.append((chunk_key(FINGERPRINT, "default", ids), block))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _put_all(entries: list[tuple[bytes, KVBlock]],
             publisher: VLLMEventPublisher | None) -> tuple[TieredStore, float, float, float]:
    """The store, the put loop's seconds, the process CPU seconds until every event is sent, and the wall-clock
    time the last put returned."""
    store = TieredStore([TierSpec(MemoryTier(1 << 34), "raw")])
    if publisher is not None:
        publisher.attach(store)
    cpu, started = time.process_time(), time.perf_counter()
    for entry in entries:
        store.put_many([entry])
    seconds, last_put = time.perf_counter() - started, time.time()
    if publisher is not None:
        publisher.flush()
    return store, seconds, time.process_time() - cpu, last_put


#: the subscriber: another process (as a router is), reading until it has every event; prints the wall-clock time
#: the last one arrived
_SUBSCRIBER = """
import sys, time, msgspec, zmq
from kvshelf.kvstore.vllm_events import KVEventBatch
port, expected = int(sys.argv[1]), int(sys.argv[2])
ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(f"tcp://127.0.0.1:{port}")
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
print("ready", flush=True)
events, last = 0, 0.0
while events < expected and sub.poll(20_000):
    _, _, payload = sub.recv_multipart()
    events += len(decoder.decode(payload).events)
    last = time.time()
print(events, last, flush=True)
"""


def _with_events(entries: list[tuple[bytes, KVBlock]]) -> dict[str, float]:
    port = _free_port()
    publisher = VLLMEventPublisher(KVEventsSettings(endpoint=f"tcp://*:{port}"))
    reader = subprocess.Popen([sys.executable, "-c", _SUBSCRIBER, str(port), str(len(entries))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None
        reader.stdout.readline()  # connected
        time.sleep(0.5)  # the subscription reaches the publisher
        store, seconds, cpu_s, last_put = _put_all(entries, publisher)
        received, last = reader.stdout.readline().split()
        reader.wait(30)
        stats = publisher.stats()
        cpu = publisher.thread_cpu_s
        store.close()
    finally:
        publisher.close()
        if reader.poll() is None:
            reader.kill()
    return {"seconds": seconds, "cpu_s": cpu_s, "events": int(received), "published": stats["published_events"],
            "batches": stats["published_batches"], "drops": stats["queue_drops"] + stats["hwm_drops"],
            "thread_cpu_s": cpu, "delay_s": max(0.0, float(last) - last_put)}


def run(*, json_path: str | None, puts: int = 10_000, tokens: int = 16, rounds: int = 3, console: Any) -> dict:
    entries = _blocks(puts, tokens)
    plain, plain_cpu, evented = [], [], []
    for _ in range(rounds):
        store, seconds, cpu_s, _ = _put_all(entries, None)
        store.close()
        plain.append(seconds)
        plain_cpu.append(cpu_s)
        evented.append(_with_events(entries))
    best = min(evented, key=lambda r: r["seconds"])
    anchor = min(plain)
    events = max(best["published"], 1)
    put_path_us = max(0.0, (best["seconds"] - anchor) / events * 1e6)
    thread_us = best["thread_cpu_s"] / events * 1e6
    cpu_us = max(0.0, (min(r["cpu_s"] for r in evented) - min(plain_cpu)) / events * 1e6)
    payload = {"bench": "kv_events", "machine": machine_description(), "puts": puts, "tokens_per_block": tokens,
               "rounds": rounds, "anchor_put_loop_s": round(anchor, 4), "events_put_loop_s": round(best["seconds"], 4),
               "events_published": best["published"], "events_received": best["events"],
               "batches": best["batches"], "dropped": best["drops"],
               "put_path_us_per_event": round(put_path_us, 2), "publisher_cpu_us_per_event": round(thread_us, 2),
               "server_us_per_event": round(put_path_us + thread_us, 2),
               "server_cpu_us_per_event": round(cpu_us, 2),
               "last_event_after_last_put_s": round(best["delay_s"], 4),
               "all_rounds": [{"anchor_s": round(a, 4), "events_s": round(r["seconds"], 4),
                               "delay_s": round(r["delay_s"], 4)} for a, r in zip(plain, evented, strict=True)]}
    console.print(results_table(payload))
    save_results(json_path, payload, console)
    return payload


def results_table(payload: dict[str, Any]) -> Table:
    """The results table of a saved payload (``run``'s printout; docs/benchmarks.md renders it)."""
    table = Table(title=f"vLLM-format KV events: {payload['puts']} puts of {payload['tokens_per_block']}-token "
                        f"blocks, memory tier, best of {payload['rounds']}")
    for column in ("put loop, no events (s)", "put loop, events (s)", "events received", "dropped",
                   "put path µs/event", "publisher µs/event", "server µs/event", "store process CPU µs/event",
                   "last event after last put (s)"):
        table.add_column(column, justify="right")
    table.add_row(f"{payload['anchor_put_loop_s']:.3f}", f"{payload['events_put_loop_s']:.3f}",
                  f"{payload['events_received']}/{payload['events_published']}", str(payload["dropped"]),
                  f"{payload['put_path_us_per_event']:.2f}", f"{payload['publisher_cpu_us_per_event']:.2f}",
                  f"{payload['server_us_per_event']:.2f}", f"{payload['server_cpu_us_per_event']:.2f}",
                  f"{payload['last_event_after_last_put_s']:.3f}")
    return table
