"""Lines of ``kvshelf events``: one per KV event (text or JSON), and one per ``started`` / ``lost`` notice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kvshelf.proto import kvshelf_pb2 as pb


def event_dict(event: pb.KVEvent) -> dict[str, Any]:
    """A JSON-ready dict of one event: ``{"seq", "ts", "type", ...}`` (block hashes in hex), vLLM's field names."""
    kind = event.WhichOneof("event")
    out: dict[str, Any] = {"seq": event.seq, "ts": round(event.ts, 6)}
    if kind == "stored":
        s = event.stored
        out.update(type="BlockStored", block_hashes=[h.hex() for h in s.block_hashes],
                   parent_block_hash=s.parent_block_hash.hex() or None, token_ids=list(s.token_ids),
                   block_size=s.block_size, medium=s.medium, model=s.model, codec=s.codec, bytes=s.nbytes)
    elif kind == "removed":
        r = event.removed
        out.update(type="BlockRemoved", block_hashes=[h.hex() for h in r.block_hashes], medium=r.medium,
                   reason=r.reason)
    else:
        out.update(type="AllBlocksCleared", medium=event.cleared.medium or None)
    return out


def _text(event: dict[str, Any]) -> str:
    head = f"{event['seq']} {event['type']}"
    if event["type"] == "BlockStored":
        parent = event["parent_block_hash"] or "-"
        return (f"{head} {','.join(event['block_hashes'])} medium={event['medium']} parent={parent} "
                f"tokens={event['block_size']} codec={event['codec']} bytes={event['bytes']} model={event['model']}")
    if event["type"] == "BlockRemoved":
        return f"{head} {','.join(event['block_hashes'])} medium={event['medium']} reason={event['reason']}"
    return f"{head} medium={event['medium']}" if event["medium"] else head


def format_message(message: pb.SubscribeEventsResponse, *, as_json: bool = False) -> Iterator[str]:
    """The lines of one ``SubscribeEventsResponse`` (heartbeats print nothing)."""
    if message.HasField("started"):
        s = message.started
        notice = {"type": "started", "namespace": s.namespace, "next_seq": s.next_seq, "oldest_seq": s.oldest_seq}
        yield json.dumps(notice) if as_json else (
            f"# subscribed to namespace {s.namespace!r}: next event seq {s.next_seq}, oldest kept {s.oldest_seq}")
    if message.HasField("lost"):
        lost = message.lost
        notice = {"type": "lost", "from_seq": lost.from_seq, "to_seq": lost.to_seq, "reason": lost.reason}
        yield json.dumps(notice) if as_json else (
            f"# events lost from seq {lost.from_seq} to {lost.to_seq}: {lost.reason} (resync)")
    for event in message.events:
        data = event_dict(event)
        yield json.dumps(data) if as_json else _text(data)
