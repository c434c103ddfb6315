"""Trace replay: prefix-hit rates of eviction policies through the real tier classes, against Belady's OPT and LRU.

Each request of a trace (``kvstore.trace``), in order, drives a tier the way a serving engine drives a KV store:
``h = tier.prefix_run_length(keys)`` (the policy's ``on_lookup`` sees the chain), ``tier.get_many(keys[:h])`` (the
hits), ``tier.put_many`` of the keys after the first ``h`` (a key already held there is re-put: a hit for the
policy). The request's prefix hits are ``h``; a trace's hit rate is the sum of ``h`` over all its blocks.

Keys are 16-byte BLAKE2b digests of the block id's decimal text; every value is one shared placeholder of
``block_bytes`` bytes (memory holds references only, and the memory tier is opened with
``charge_overhead=False``: it bounds the values' bytes, not its process memory), so a tier's byte capacity is a
whole number of blocks.

OPT is Belady's furthest-next-use rule (L. A. Belady, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2), 1966) with the same counting: per request, ``h`` = its leading ids held;
then each of its ids in order gets its next-use time (its next position in the flattened id sequence) and, when
not held, is inserted; while more than ``capacity`` ids are held the one used furthest ahead is evicted (possibly
the one just inserted).

Capacities are fractions of the trace's distinct blocks (bare numbers in (0, 1]: ``floor(fraction x distinct)``
blocks) or byte sizes with a unit (``"64GiB"``, ``"4096B"``: ``floor(bytes / block_bytes)`` blocks). A fraction
above 1 is refused: at 1 nothing is ever evicted, so more cannot change a figure (and a bare ``1000000`` is more
likely a byte size missing its unit). 0, negative, or less than one block is a ``ConfigError``.

Tiers: ``memory`` (``MemoryTier``) or ``lmdb`` (a bounded ``LMDBTier`` in a fresh temporary directory, not synced,
removed after the run). The LMDB tier also bounds the pages its values take (their *charge*, see its module
docstring), so with values that fill their last page badly it holds fewer blocks than ``capacity / block_bytes``
(OPT's count); ``block_bytes = n x 4096 - 16`` (e.g. 65520) fills whole pages, and the LMDB tier then gives the
memory tier's figures (LRU on the conversation trace at 0.05 / 0.1: 0.103 / 0.196 on both).

Speed: one policy at one capacity is a pass over the trace's blocks through the tier's public calls (three per
request, each under the tier's lock; the policy's calls per key); ``workers`` > 1 runs the (policy, capacity)
pairs in forked processes, each with its own tier (the figures are the same).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from kvshelf.kvstore import eviction
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.sizes import parse_size
from kvshelf.kvstore.tier import Tier
from kvshelf.kvstore.trace import Trace

#: one 512-token block of SmolLM2-135M in fp16: 30 layers x (K, V) x 3 KV heads x 64 head dim x 512 tokens x 2 bytes
DEFAULT_BLOCK_BYTES = 30 * 2 * 3 * 64 * 512 * 2
DEFAULT_CAPACITIES = "0.01,0.05,0.1,0.2,0.4"
TIERS = ("memory", "lmdb")
MAX_BLOCK_BYTES = 1 << 30  # one placeholder value is allocated: a 512-token block of a 70B model is 160 MiB

Progress = Callable[[int], None]  # told how many more blocks were replayed


def block_key(block_id: int) -> bytes:
    """The 16-byte tier key of trace block ``block_id`` (BLAKE2b of its decimal text: stable across processes)."""
    return hashlib.blake2b(str(block_id).encode("ascii"), digest_size=16).digest()


def check_block_bytes(value: int | str) -> int:
    """``--block-bytes`` -> a positive number of bytes (an int, or a size such as ``"11MiB"``)."""
    size = parse_size(value, "--block-bytes")
    if size <= 0:
        raise ConfigError(f"--block-bytes must be a positive number of bytes, got {value!r}")
    if size > MAX_BLOCK_BYTES:
        raise ConfigError(f"--block-bytes {value!r} is too large (at most {MAX_BLOCK_BYTES} bytes, 1 GiB)")
    return size


@dataclass(frozen=True)
class CapacitySpec:
    """One ``--capacities`` entry before it meets a trace: a fraction of its distinct blocks, or bytes."""

    text: str
    fraction: float | None = None
    bytes: int | None = None


@dataclass(frozen=True)
class Capacity:
    """A capacity resolved against a trace and a block size."""

    text: str
    fraction: float  # of the trace's distinct blocks (for a byte size: bytes / (distinct x block bytes))
    blocks: int  # what OPT holds: floor(fraction x distinct), or floor(bytes / block bytes)
    bytes: int  # what the tier is given


def parse_capacities(text: str) -> list[CapacitySpec]:
    """``"0.01,0.05,64GiB"`` -> specs, in order, duplicates dropped; ``ConfigError`` naming a bad entry."""
    specs: list[CapacitySpec] = []
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ConfigError(f"--capacities: no capacity given in {text!r}; e.g. 0.01,0.05,0.1 or 64GiB")
    for part in parts:
        if not part:
            raise ConfigError(f"--capacities: empty entry in {text!r}")
        spec = _parse_capacity(part)
        if spec not in specs:
            specs.append(spec)
    return specs


def _parse_capacity(part: str) -> CapacitySpec:
    try:
        fraction = float(part)
    except ValueError:
        fraction = None
    if fraction is not None:
        if not math.isfinite(fraction):
            raise ConfigError(f"--capacities: {part!r} is not a capacity")
        if fraction <= 0:
            raise ConfigError(f"--capacities: capacity {part!r} must be positive (a fraction of the trace's "
                              "distinct blocks in (0, 1], or bytes with a unit such as 64GiB)")
        if fraction > 1:
            raise ConfigError(f"--capacities: {part!r} is above 1; a bare number is a fraction of the trace's "
                              f"distinct blocks (at most 1: the whole trace); for bytes add a unit, e.g. {part}B "
                              "or 64GiB")
        return CapacitySpec(part, fraction=fraction)
    size = parse_size(part, f"--capacities entry {part!r}")
    if size == 0:
        raise ConfigError(f"--capacities: capacity {part!r} is 0 bytes")
    return CapacitySpec(part, bytes=size)


def resolve_capacity(spec: CapacitySpec, distinct: int, block_bytes: int) -> Capacity:
    """``spec`` against a trace of ``distinct`` blocks; ``ConfigError`` when it holds less than one block."""
    if spec.fraction is not None:
        blocks = math.floor(spec.fraction * distinct)
        if blocks < 1:
            raise ConfigError(f"capacity {spec.text} of the trace's {distinct} distinct blocks is less than one "
                              f"block; the smallest fraction is {1 / distinct:.3g}")
        return Capacity(spec.text, spec.fraction, blocks, blocks * block_bytes)
    assert spec.bytes is not None
    blocks = spec.bytes // block_bytes
    if blocks < 1:
        raise ConfigError(f"capacity {spec.text} ({spec.bytes} bytes) is smaller than one block "
                          f"(--block-bytes {block_bytes})")
    return Capacity(spec.text, spec.bytes / (distinct * block_bytes), blocks, spec.bytes)


def opt_hits(chains: Sequence[Sequence[int]], capacity_blocks: int) -> int:
    """Prefix hits of Belady's OPT holding at most ``capacity_blocks`` ids (module docstring). O(n log n)."""
    if capacity_blocks < 1:
        raise ConfigError(f"OPT capacity must be at least one block, got {capacity_blocks}")
    flat = [i for chain in chains for i in chain]
    never = len(flat)
    next_use = [never] * len(flat)
    seen: dict[int, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        block = flat[pos]
        next_use[pos] = seen.get(block, never)
        seen[block] = pos
    held: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, id); stale entries are skipped when popped
    hits = pos = 0
    push, pop = heapq.heappush, heapq.heappop
    for chain in chains:
        for block in chain:
            if block not in held:
                break
            hits += 1
        for block in chain:
            nxt = next_use[pos]
            pos += 1
            held[block] = nxt
            push(heap, (-nxt, block))
            while len(held) > capacity_blocks:
                neg, victim = pop(heap)
                if held.get(victim) == -neg:
                    del held[victim]
    return hits


def replay_tier(tier: Tier, chains: Sequence[Sequence[bytes]], value: bytes,
                progress: Progress | None = None, every: int = 256) -> int:
    """Prefix hits of ``tier`` over the key chains (module docstring), the tier driven through its public calls."""
    contains, get, put = tier.prefix_run_length, tier.get_many, tier.put_many
    hits = pending = 0
    for keys in chains:
        held = contains(keys)
        if held:
            get(keys[:held])
        if held < len(keys):
            put([(k, value) for k in keys[held:]])
        hits += held
        pending += len(keys)
        if progress is not None and pending >= every * 16:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)
    return hits


def open_tier(kind: str, capacity_bytes: int, policy: str, workdir: str | None = None) -> tuple[Tier, str | None]:
    """A fresh bounded tier of ``kind`` and the directory to remove after it: ``memory`` (none), or ``lmdb`` in a
    new directory under ``workdir`` (default: the system's temporary folder), not synced (``durable=False``)."""
    if kind == "memory":
        from kvshelf.kvstore.memory_tier import MemoryTier

        # the placeholder value is one shared object: the tier bounds the values' bytes, not its memory
        return MemoryTier(capacity_bytes, policy=policy, charge_overhead=False), None
    if kind == "lmdb":
        from kvshelf.kvstore.lmdb_tier import LMDBTier, lmdb_slack_bytes

        parent = workdir or tempfile.gettempdir()
        needed, free = capacity_bytes + lmdb_slack_bytes(capacity_bytes), shutil.disk_usage(parent).free
        if needed > free:
            raise ConfigError(f"--tier lmdb: a capacity of {capacity_bytes} bytes (with LMDB's slack {needed}) does "
                              f"not fit the {free} bytes free in {parent}; use a smaller --block-bytes")
        path = tempfile.mkdtemp(prefix="kvshelf-replay-", dir=parent)
        try:
            return LMDBTier(path, capacity_bytes=capacity_bytes, policy=policy, durable=False), path
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
    raise ConfigError(f"unknown tier {kind!r}; replay drives one of: {', '.join(TIERS)}")


@dataclass(frozen=True)
class RunResult:
    """One policy at one capacity."""

    policy: str
    capacity: Capacity
    hits: int
    blocks: int
    evictions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks


def key_chains(trace: Trace) -> list[list[bytes]]:
    """Each request's tier keys in chain order (each distinct id hashed once)."""
    keys = {i: block_key(i) for r in trace.requests for i in r.hash_ids}
    return [[keys[i] for i in r.hash_ids] for r in trace.requests]


def run_policy(trace: Trace, policy: str, capacity: Capacity, *, block_bytes: int, tier: str = "memory",
               progress: Progress | None = None, workdir: str | None = None,
               chains: list[list[bytes]] | None = None) -> RunResult:
    """Replay ``trace`` (or its ``key_chains``, when given) through a fresh ``tier`` with ``policy`` at
    ``capacity``."""
    if chains is None:
        chains = key_chains(trace)
    value = bytes(block_bytes)
    evictions = 0

    def count(key: bytes, evicted: bytes) -> None:
        nonlocal evictions
        evictions += 1

    started = time.perf_counter()
    bounded, directory = open_tier(tier, capacity.bytes, policy, workdir)
    try:
        bounded.set_eviction_callback(count)
        hits = replay_tier(bounded, chains, value, progress)
    finally:
        bounded.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    return RunResult(policy, capacity, hits, trace.total_blocks, evictions, time.perf_counter() - started)


@dataclass
class ReplayRow:
    """One line of the report: a policy at a capacity, next to OPT and LRU at the same capacity."""

    run: RunResult
    opt_hits: int
    lru_hits: int
    default: bool

    def as_dict(self, *, tier: str, block_bytes: int) -> dict[str, Any]:
        run, blocks = self.run, self.run.blocks
        return {
            "policy": run.policy, "default": self.default, "capacity_fraction": run.capacity.fraction,
            "hit_rate": run.hit_rate, "opt_hit_rate": self.opt_hits / blocks, "lru_hit_rate": self.lru_hits / blocks,
            "ratio_to_opt": _ratio(run.hits, self.opt_hits), "ratio_to_lru": _ratio(run.hits, self.lru_hits),
            "capacity": run.capacity.text, "capacity_blocks": run.capacity.blocks,
            "capacity_bytes": run.capacity.bytes, "block_bytes": block_bytes, "tier": tier, "hits": run.hits,
            "blocks": blocks, "evictions": run.evictions, "seconds": round(run.seconds, 3),
        }


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


@dataclass
class ReplayReport:
    trace: str
    tier: str
    block_bytes: int
    requests: int
    distinct_blocks: int
    rows: list[ReplayRow] = field(default_factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        """``{"trace": str, "results": [...]}``: one result per policy and capacity (``ReplayRow.as_dict``)."""
        return {"trace": self.trace,
                "results": [r.as_dict(tier=self.tier, block_bytes=self.block_bytes) for r in self.rows]}


def check_policies(names: Sequence[str] | None) -> list[str]:
    """The policies to replay: ``names`` (each must be known; order kept, duplicates dropped) or every one."""
    if names is None:
        return list(eviction.POLICIES)
    chosen: list[str] = []
    for name in names:
        eviction.make_policy(name, 1)  # ConfigError naming the known ones
        if name not in chosen:
            chosen.append(name)
    if not chosen:
        raise ConfigError(f"no policy given; known policies: {', '.join(sorted(eviction.POLICIES))}")
    return chosen


# worker processes (fork) read the trace and its key chains from here instead of having them sent with every job
_WORKER_TRACE: Trace | None = None
_WORKER_CHAINS: list[list[bytes]] | None = None


def _worker_run(policy: str, capacity: Capacity, block_bytes: int, tier: str, workdir: str | None) -> RunResult:
    assert _WORKER_TRACE is not None
    return run_policy(_WORKER_TRACE, policy, capacity, block_bytes=block_bytes, tier=tier, workdir=workdir,
                      chains=_WORKER_CHAINS)


def _worker_opt(capacity: Capacity) -> tuple[Capacity, int]:
    assert _WORKER_TRACE is not None
    return capacity, opt_hits([r.hash_ids for r in _WORKER_TRACE.requests], capacity.blocks)


def replay(trace: Trace, *, policies: Sequence[str] | None = None, capacities: str | Sequence[CapacitySpec] =
           DEFAULT_CAPACITIES, block_bytes: int = DEFAULT_BLOCK_BYTES, tier: str = "memory", workers: int = 1,
           progress: Progress | None = None, total: Callable[[int], None] | None = None,
           workdir: str | None = None) -> ReplayReport:
    """Every policy at every capacity (plus LRU when not among them, and OPT), as a report.

    ``workers`` > 1 runs the (policy, capacity) replays in that many forked processes, each with its own tier;
    ``total`` is told the number of blocks all runs will replay, ``progress`` how many more are done.
    """
    started = time.perf_counter()
    if tier not in TIERS:
        raise ConfigError(f"unknown tier {tier!r}; replay drives one of: {', '.join(TIERS)}")
    block_bytes = check_block_bytes(block_bytes)
    names = check_policies(policies)
    specs = parse_capacities(capacities) if isinstance(capacities, str) else list(capacities)
    distinct = trace.distinct_blocks()
    resolved = [resolve_capacity(s, distinct, block_bytes) for s in specs]
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    baseline = eviction.LRUPolicy.name
    runs = [(p, c) for p in names for c in resolved]
    extra = [(baseline, c) for c in resolved] if baseline not in names else []
    blocks = trace.total_blocks
    if total is not None:
        total(blocks * (len(runs) + len(extra)))
    results: dict[tuple[str, Capacity], RunResult] = {}
    opt: dict[Capacity, int] = {}
    workers = min(workers, len(runs) + len(extra))
    keyed = key_chains(trace)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        global _WORKER_TRACE, _WORKER_CHAINS
        _WORKER_TRACE, _WORKER_CHAINS = trace, keyed
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                jobs = [pool.submit(_worker_run, p, c, block_bytes, tier, workdir) for p, c in runs + extra]
                opt_jobs = [pool.submit(_worker_opt, c) for c in resolved]
                for job in as_completed(jobs):
                    result = job.result()
                    results[(result.policy, result.capacity)] = result
                    if progress is not None:
                        progress(blocks)
                for job in opt_jobs:
                    capacity, hits = job.result()
                    opt[capacity] = hits
        finally:
            _WORKER_TRACE = _WORKER_CHAINS = None
    else:
        chains = [r.hash_ids for r in trace.requests]
        for capacity in resolved:
            opt[capacity] = opt_hits(chains, capacity.blocks)
        for p, c in runs + extra:
            results[(p, c)] = run_policy(trace, p, c, block_bytes=block_bytes, tier=tier, progress=progress,
                                         workdir=workdir, chains=keyed)
    default = eviction.DEFAULT_POLICY
    report = ReplayReport(trace.path, tier, block_bytes, len(trace.requests), distinct)
    for p, c in runs:
        report.rows.append(ReplayRow(results[(p, c)], opt[c], results[(baseline, c)].hits, p == default))
    report.seconds = time.perf_counter() - started
    return report


__all__ = ["DEFAULT_BLOCK_BYTES", "DEFAULT_CAPACITIES", "Capacity", "CapacitySpec", "ReplayReport", "ReplayRow",
           "RunResult", "block_key", "check_block_bytes", "check_policies", "key_chains", "opt_hits",
           "parse_capacities", "replay", "replay_tier", "resolve_capacity", "run_policy"]
