"""The worker side: loads stored blocks into vLLM's pages before a forward, saves completed blocks after it.

* Loads are synchronous in ``start_load_kv`` (one batched ``get_many`` per step, whole pages copied): a block that is
  missing (evicted since the scheduler looked), damaged (checksum) or foreign (another key's, model's or
  namespace's: the store refuses it; token ids that differ: checked here) is not written, and its vLLM pages are
  reported by ``load_errors`` so vLLM recomputes them (``kv_load_failure_policy`` recompute).
* Saves copy the pages of completed blocks out in ``wait_for_save`` (a memcpy of ``block_tokens`` tokens per layer)
  and hand ``(key, KVBlock)`` to ``kvstore.write_behind.WriteBehind``: encoding and storing run on its thread, at
  idle priority (``SCHED_IDLE``: only on CPU time the engine leaves), so a decode step never waits on the store nor
  shares the cores with it (it waits only when ``max_pending_blocks`` blocks are queued).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvshelf.adapters.vllm.pages import PageLayout, read_pages, write_pages
from kvshelf.adapters.vllm.plan import BlockMove, StepPlan
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.keys import MODEL_NAME_EXTRA, PARENT_EXTRA
from kvshelf.kvstore.protocol import BlockStore
from kvshelf.kvstore.write_behind import WriteBehind

log = logging.getLogger("vllm.kvshelf")  # under vLLM's logger: shown in its log, in its format


@dataclass
class WorkerCounts:
    """What the worker did since the engine started (``loaded_*``: written into vLLM's pages)."""

    loaded_blocks: int = 0
    loaded_tokens: int = 0
    failed_blocks: int = 0  # missing, damaged or foreign at load time: recomputed by vLLM
    saved_blocks: int = 0  # handed to the write-behind writer


class PageMover:
    """Loads and saves whole pages between ``caches`` (one per layer, in layer order) and ``store``."""

    def __init__(self, store: BlockStore, caches: Sequence[torch.Tensor], layout: PageLayout, *, fingerprint: str,
                 namespace: str, model_name: str, max_pending_blocks: int) -> None:
        self.store = store
        self.caches = list(caches)
        self.layout = layout
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.model_name = model_name
        # saves run on CPU time the engine leaves idle: decoding never waits on them (a full queue still does)
        self.writer = WriteBehind(store, max_pending_blocks=max_pending_blocks, idle_priority=True)
        self.counts = WorkerCounts()
        self._errors: set[int] = set()

    def load(self, plan: StepPlan) -> None:
        moves = [move for request in plan.loads.values() for move in request]
        if not moves:
            return
        try:
            blocks = self.store.get_many([m.key for m in moves], fingerprint=self.fingerprint,
                                         namespace=self.namespace, copy=False,
                                         tokens=[len(m.token_ids) for m in moves])
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss of every block: vLLM recomputes
            log.warning("kvshelf connector: loading %d blocks failed (%s: %s); vLLM recomputes them",
                        len(moves), type(exc).__name__, exc)
            blocks = [None] * len(moves)
        for move, block in zip(moves, blocks, strict=True):
            if not self._fits(move, block):
                self._errors.update(move.pages)
                self.counts.failed_blocks += 1
                continue
            assert block is not None
            n = self.layout.block_size
            first = move.first_page * n
            write_pages(self.caches, move.pages, block.keys[:, :, first:], block.values[:, :, first:], self.layout)
            self.counts.loaded_blocks += 1
            self.counts.loaded_tokens += len(move.pages) * n

    def _fits(self, move: BlockMove, block: KVBlock | None) -> bool:
        """A block this move can write: present, of these tokens at this position, in this geometry."""
        if block is None:
            return False
        n, layers = self.layout.block_size, len(self.caches)
        shape = (layers, self.layout.kv_heads, len(move.token_ids), self.layout.head_dim)
        ok = (block.token_ids == move.token_ids and block.start_pos == move.start
              and tuple(block.keys.shape) == shape and tuple(block.values.shape) == shape
              and (move.first_page + len(move.pages)) * n == len(move.token_ids))
        if not ok:
            log.warning("kvshelf connector: block %s does not fit this request (tokens, position or shape); "
                        "vLLM recomputes it", move.key.hex())
        return ok

    def save(self, plan: StepPlan) -> None:
        entries = []
        for request in plan.saves.values():
            for move in request:
                keys, values = read_pages(self.caches, move.pages, self.layout)
                extra = {MODEL_NAME_EXTRA: self.model_name}
                if move.parent:
                    extra[PARENT_EXTRA] = move.parent.hex()
                entries.append((move.key, KVBlock(keys, values, move.token_ids, move.start, self.fingerprint,
                                                  self.namespace, extra)))
        if entries:
            self.writer.submit(entries)
            self.counts.saved_blocks += len(entries)

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self.writer.close()
