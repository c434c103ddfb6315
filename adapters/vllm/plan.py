"""The scheduler side's plan: which kvshelf blocks a request loads, which it saves, and into / out of which vLLM
pages. Pure Python (no vLLM, no torch): the connector feeds it vLLM's scheduler objects' fields.

Keys are kvshelf's own chained prefix keys over the prompt's token ids (``kvstore.keys.prefix_block_spans``:
``H(fingerprint, namespace, parent, tokens)``), not vLLM's ``request.block_hashes``: they carry the model's
fingerprint and the namespace, so a block never reaches another model or tenant, they are the keys
``CachedGenerator`` computes for the same tokens (one store for both), and they do not depend on vLLM's hash
function or seed. Cost: one BLAKE2b over 256 token ids per block, ~10 us, once per request.

* Loads: the longest run of stored full blocks from the prompt's start whose tokens end before the prompt's last
  token (vLLM computes at least that one to sample), beyond what vLLM already holds (``num_computed_tokens``: its
  own prefix cache). A kvshelf block that vLLM holds in part is loaded for its remaining pages only: pages vLLM holds
  are shared with other requests and never written.
* Saves: each full block of the prompt once all its tokens are computed (chunked prefill: as chunks complete), from
  the first one the store did not hold when the request arrived. Decoded tokens are not saved.

The metadata the worker gets is ``StepPlan``: plain dataclasses of ints, bytes and tuples (vLLM serializes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvshelf.kvstore.keys import BlockSpan, prefix_block_spans


@dataclass(frozen=True)
class BlockMove:
    """One kvshelf block and its vLLM pages: ``pages`` are the vLLM block ids of the block's pages from page
    ``first_page`` on (a load may skip pages vLLM already holds; a save always has them all)."""

    key: bytes
    parent: bytes  # the previous block's key (b"" for the first): carried in the block for KV events
    start: int  # position of the block's first token
    token_ids: tuple[int, ...]
    first_page: int
    pages: tuple[int, ...]


@dataclass
class StepPlan:
    """What the worker does in one engine step: per request id, blocks to load before the forward and blocks to
    save after it."""

    loads: dict[str, list[BlockMove]] = field(default_factory=dict)
    saves: dict[str, list[BlockMove]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class RequestPlan:
    """A request's blocks and progress on the scheduler side."""

    spans: list[BlockSpan]  # the prompt's full kvshelf blocks
    prompt_tokens: tuple[int, ...]
    stored: int  # blocks the store held from the start when the request arrived
    next_save: int  # index of the first block not saved yet
    page_ids: list[int] = field(default_factory=list)  # the request's vLLM block ids, in token order
    load_from: int = 0  # token from which the pending load writes (vLLM's own cached tokens before it)
    load_to: int = 0  # token at which it ends (0: no load pending)
    loaded_tokens: int = 0  # tokens planned to load from the store (all loads so far)
    failed_tokens: int = 0  # of those, tokens whose block failed at load time (recomputed by vLLM)
    saved_blocks: int = 0  # blocks handed to the worker to save

    def report(self) -> dict[str, int]:
        """What the request got from and gave to the store (its ``kv_transfer_params["kvshelf"]``)."""
        return {"stored_blocks": self.stored, "loaded_tokens": self.loaded_tokens,
                "failed_tokens": self.failed_tokens, "saved_blocks": self.saved_blocks}


class Planner:
    """Per-request plans over kvshelf blocks of ``block_tokens`` tokens made of vLLM pages of ``page_tokens``."""

    def __init__(self, fingerprint: str, namespace: str, block_tokens: int, page_tokens: int) -> None:
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.requests: dict[str, RequestPlan] = {}

    def spans(self, prompt: Sequence[int]) -> list[BlockSpan]:
        return prefix_block_spans(self.fingerprint, self.namespace, prompt, self.block_tokens)

    def loadable(self, spans: list[BlockSpan], prompt_len: int, stored: int) -> int:
        """Tokens a load may cover: the stored blocks that end before the prompt's last token."""
        return max((s.end for s in spans[:stored] if s.end <= prompt_len - 1), default=0)

    def admit(self, req_id: str, prompt: Sequence[int], spans: list[BlockSpan], stored: int) -> RequestPlan:
        plan = RequestPlan(spans, tuple(prompt), stored, stored)
        self.requests[req_id] = plan
        return plan

    def expect_load(self, req_id: str, local_tokens: int, external_tokens: int) -> None:
        plan = self.requests[req_id]
        plan.load_from, plan.load_to = local_tokens, local_tokens + external_tokens

    def set_pages(self, req_id: str, page_ids: Sequence[int], *, replace: bool) -> None:
        plan = self.requests.get(req_id)
        if plan is not None:
            plan.page_ids = list(page_ids) if replace else plan.page_ids + list(page_ids)

    def _move(self, plan: RequestPlan, index: int, from_token: int) -> BlockMove:
        span = plan.spans[index]
        first = (max(from_token, span.start) - span.start) // self.page_tokens
        pages = plan.page_ids[span.start // self.page_tokens + first: span.end // self.page_tokens]
        parent = plan.spans[index - 1].key if index else b""
        return BlockMove(span.key, parent, span.start, plan.prompt_tokens[span.start:span.end], first, tuple(pages))

    def step(self, req_id: str, computed_after: int, out: StepPlan) -> None:
        """Add ``req_id``'s pending load and the saves its tokens computed by the end of this step allow."""
        plan = self.requests.get(req_id)
        if plan is None:
            return
        if plan.load_to:
            loads = [self._move(plan, i, plan.load_from) for i, s in enumerate(plan.spans)
                     if s.end > plan.load_from and s.end <= plan.load_to]
            if loads:
                out.loads[req_id] = loads
                plan.loaded_tokens += sum(len(m.pages) for m in loads) * self.page_tokens
            plan.load_from = plan.load_to = 0
        saves = []
        while plan.next_save < len(plan.spans) and plan.spans[plan.next_save].end <= computed_after:
            move = self._move(plan, plan.next_save, 0)
            if len(move.pages) * self.page_tokens == self.block_tokens:  # all its pages known
                saves.append(move)
            plan.next_save += 1
        if saves:
            out.saves[req_id] = saves
            plan.saved_blocks += len(saves)

    def load_failed(self, page_ids: set[int]) -> None:
        """The worker could not load the blocks holding ``page_ids``: count them per request, and save those blocks
        again once vLLM has recomputed them (a damaged stored copy is replaced)."""
        for plan in self.requests.values():
            failed = [i for i, page in enumerate(plan.page_ids) if page in page_ids]
            if not failed:
                continue
            plan.failed_tokens += len(failed) * self.page_tokens
            first_block = failed[0] * self.page_tokens // self.block_tokens
            plan.next_save = min(plan.next_save, first_block)

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
