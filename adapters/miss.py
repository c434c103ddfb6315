"""Why a prompt missed: ``MissReason`` (a ``MissKind`` and a readable detail) and ``explain_miss``, the diagnosis
``CachedGenerator`` runs when a lookup finds fewer blocks than the prompt has (``GenerationResult.miss_reason``),
``CachedGenerator.explain`` runs on demand and ``kvshelf explain`` prints.

A block key is ``H(fingerprint, namespace, parent, tokens)`` (``kvstore.keys``): which settings a stored block was
made under cannot be read off its key, only tried. The diagnosis keys the prompt under each candidate kvshelf can
name and reports every candidate that holds more of the prompt than the lookup found, in this order:

1. ``EVICTED``: the first missing block is in the generator's ``EvictionLog`` (evicted while it watched the store).
2. ``OTHER_DTYPE``: the chain of the model's weights cast to another common dtype
   (``fingerprint.other_dtype_fingerprints``: float32, bfloat16, float16); or the chain under another fingerprint
   (step 5) whose scanned header shows this model's KV shape in another dtype: blocks of a float32 checkpoint,
   looked up from its bfloat16 copy (whose cast weights cannot name them).
3. ``OTHER_BLOCK_SIZE``: the chain cut in blocks of another of ``BLOCK_SIZES``.
4. ``OTHER_NAMESPACE``: the chain in another namespace: those the caller names, then those the store's counters
   show blocks written in, then those of the scanned headers (at most ``MAX_NAMESPACES``).
5. ``OTHER_MODEL``: the chain under another model fingerprint of this namespace: those the store's counters show
   blocks written for, then those of the scanned headers (at most ``MAX_MODELS``). A fingerprint is a digest, so
   "other weights of this architecture" (a fine-tune, another checkpoint, weights edited in place) and "another
   model" are told apart only when a scanned header of that fingerprint shows its KV shape. With no other
   fingerprint known, the ``NEVER_STORED`` detail says it cannot tell.
6. ``CHUNKED``: the looked-up tokens stored as one position-independent chunk (``chunk_key``), or a scanned chunk
   of this model and namespace whose tokens are a run of the prompt's (a RAG chunk or prompt module).
7. ``TOKENS_DIFFER``: a scanned block of this model and namespace at the first missing block's position (with the
   same parent key; for the first block, sharing at least its first token) whose tokens differ from the prompt's:
   the first differing index and both tokens. A token inserted or dropped at position 0 (a BOS token in one call
   only) shares no first token and is not found this way.
8. ``NEVER_STORED``: none of the above.

Cost, paid only when a lookup found fewer blocks than it asked for: one uncounted ``held`` call per namespace
probed (the store's hit rates stay the users'), over at most ``MAX_PROBE_BLOCKS`` keys per candidate (2 dtypes,
5 block sizes, ``MAX_NAMESPACES`` namespaces, ``MAX_MODELS`` fingerprints, 1 chunk key), one ``stats()`` call, and
the headers of at most ``scan`` stored values of other fingerprints from the first ``scan_tiers`` tiers that list
their keys and hold any (a tier holding only this model's blocks, such as a fresh process's memory tier, is not
counted: the disk tier behind it is read), at most ``scan`` from each (an embedded ``TieredStore`` only: a
``RemoteStore`` gets the probes alone), read with ``Tier.peek_many`` (the tiers' eviction
policies hear nothing of them). The fingerprints of the other dtypes cost one weight digest each, once (memoized).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from kvshelf.adapters.fingerprint import kv_geometry, other_dtype_fingerprints
from kvshelf.kvstore.encoding import BlockHeader, read_header
from kvshelf.kvstore.errors import KVShelfError
from kvshelf.kvstore.eviction_log import EvictionLog
from kvshelf.kvstore.keys import PARENT_EXTRA, BlockSpan, chunk_key, prefix_block_spans
from kvshelf.kvstore.protocol import BlockStore
from kvshelf.kvstore.stats import UNKNOWN

#: the block sizes tried besides the generator's own
BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
#: the most other namespaces, and other model fingerprints, tried
MAX_NAMESPACES = 4
MAX_MODELS = 4
#: the most keys of one candidate's chain probed (a run reported at this length may be longer)
MAX_PROBE_BLOCKS = 256
#: stored values whose headers a generate call's diagnosis reads (first tier), and ``explain``'s (every tier)
GENERATE_SCAN = 32
EXPLAIN_SCAN = 256
_SCAN_BATCH = 8


class MissKind(StrEnum):
    """What kept a prompt's blocks from being reused (see the module docstring for how each is found)."""

    NEVER_STORED = "never_stored"
    EVICTED = "evicted"
    OTHER_DTYPE = "other_dtype"
    OTHER_BLOCK_SIZE = "other_block_size"
    OTHER_NAMESPACE = "other_namespace"
    OTHER_MODEL = "other_model"
    CHUNKED = "chunked"
    TOKENS_DIFFER = "tokens_differ"


@dataclass(frozen=True)
class MissReason:
    """One finding: its ``kind``, a readable ``detail``, and what it rests on."""

    kind: MissKind
    detail: str
    #: blocks of the prompt the finding accounts for (held under the candidate, or evicted), and their tokens
    blocks: int = 0
    tokens: int = 0
    #: the dtype, block size, namespace or fingerprint they are held under; the tier (EVICTED)
    candidate: str | None = None
    #: TOKENS_DIFFER: the index of the first prompt token that differs, and the prompt's and the stored token
    #: (decoded when a tokenizer is known, else the id); CHUNKED: the index of the chunk's first token
    token_index: int | None = None
    prompt_token: str | None = None
    stored_token: str | None = None

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


@dataclass(frozen=True)
class MissQuery:
    """One lookup to explain: the whole prompt, the tokens its keys were made of, and what it found."""

    ids: Sequence[int]
    fingerprint: str
    namespace: str
    block_size: int
    found: int  # leading blocks the lookup found
    cacheable_prefix: int | None = None  # keys over ids[:cacheable_prefix], its partial block included

    @property
    def lookup_ids(self) -> Sequence[int]:
        return self.ids[: self.cacheable_prefix or len(self.ids)]

    def spans(self, fingerprint: str | None = None, namespace: str | None = None,
              block_size: int | None = None) -> list[BlockSpan]:
        """The chain of the looked-up tokens, under this lookup's settings or the given ones."""
        return prefix_block_spans(fingerprint or self.fingerprint, namespace or self.namespace, self.lookup_ids,
                                  block_size or self.block_size, partial=self.cacheable_prefix is not None)


@dataclass(frozen=True)
class MissReport:
    """What ``CachedGenerator.explain`` found for one prompt: its blocks, how many lead the store, and why the
    rest missed (empty on a full hit)."""

    prompt_tokens: int
    block_size: int
    blocks: int  # blocks a lookup asks for
    held_blocks: int  # leading ones held
    held_tokens: int
    reasons: tuple[MissReason, ...] = ()

    def lines(self) -> list[str]:
        """One readable line for the lookup, then one per finding."""
        head = (f"{self.prompt_tokens} prompt tokens, {self.blocks} block{'s' if self.blocks != 1 else ''} of "
                f"{self.block_size}: {self.held_blocks} held ({self.held_tokens} tokens)")
        if not self.blocks:
            head = f"{self.prompt_tokens} prompt tokens: shorter than one block of {self.block_size}"
        elif self.held_blocks == self.blocks:
            head += ": a full hit"
        return [head, *(str(reason) for reason in self.reasons)]


@dataclass(frozen=True)
class _Probe:
    kind: MissKind
    candidate: str
    namespace: str
    spans: list[BlockSpan]


def explain_miss(model: Any, tokenizer: Any, store: BlockStore, query: MissQuery, *,
                 eviction_log: EvictionLog | None = None, namespaces: Iterable[str] = (),
                 scan: int = GENERATE_SCAN, scan_tiers: int | None = 1) -> tuple[MissReason, ...]:
    """Why ``query``'s lookup found ``query.found`` blocks and not more (module docstring: the candidates, the
    order, the cost). Empty when it found every block, or when the prompt has no full block and no candidate
    holds any of it; otherwise at least one reason (``NEVER_STORED`` when nothing explains it).

    ``namespaces``: other namespaces to try first. ``scan``: stored values whose headers are read, from the first
    ``scan_tiers`` tiers (``None``: all)."""
    spans = query.spans()
    found = min(query.found, len(spans))
    if spans and found == len(spans):
        return ()
    reused = spans[found - 1].end if found else 0
    reasons: list[MissReason] = []
    if spans and eviction_log is not None:
        reasons += _evicted(spans, found, eviction_log)
    headers = stored_headers(store, scan, scan_tiers, own=query.fingerprint) if spans else []
    rows = _rows(store)
    dtype_fingerprints = other_dtype_fingerprints(model)
    probes = _probes(query, dtype_fingerprints, _namespaces(query.namespace, namespaces, rows, headers),
                     _models(query, rows, headers, set(dtype_fingerprints.values())))
    reasons += _probe_reasons(store, query, probes, reused, headers, model)
    if spans:
        reasons += _chunk_reasons(query, headers, reused, reasons)
        reasons += _token_reasons(query, spans, found, headers, tokenizer)
    if spans and not reasons:
        reasons.append(_never_stored(query, reused, probes, headers))
    return tuple(reasons)


# -- what the store can tell ----------------------------------------------------------------------------------------


def stored_headers(store: BlockStore, limit: int, tiers: int | None = 1, *,
                   own: str | None = None) -> list[BlockHeader]:
    """The headers of at most ``limit`` stored values of the first ``tiers`` tiers (``None``: all) that list their
    keys, newest first where a tier keeps an order (the memory tier); ``[]`` for a store without tiers here.

    With ``own`` (the looking model's fingerprint), headers that carry it do not count toward ``limit``, nor a tier
    that holds only such toward ``tiers``: a memory tier that holds only what this model wrote (in a fresh
    process, the blocks of its first miss) tells nothing of other dtypes or models, and the next tier (the disk)
    is read too. At most ``limit`` values are read from each tier."""
    specs = getattr(store, "specs", None)
    if not isinstance(specs, list) or limit <= 0:
        return []
    seen: set[bytes] = set()
    out: list[BlockHeader] = []
    counted = 0

    def useful() -> int:
        return len(out) if own is None else sum(h.fingerprint != own for h in out)

    for spec in specs:
        if (tiers is not None and counted >= tiers) or useful() >= limit:
            break
        before = useful()
        tier = spec.tier
        try:
            keys = tier.keys()
        except (NotImplementedError, KVShelfError):
            continue
        picked = [key for key in reversed(keys) if key not in seen][: limit - before]
        seen.update(picked)
        for i in range(0, len(picked), _SCAN_BATCH):
            try:
                values = tier.peek_many(picked[i:i + _SCAN_BATCH])
            except KVShelfError:
                break
            for value in values:
                if value is None:
                    continue
                try:
                    out.append(read_header(value))
                except KVShelfError:
                    continue
        if useful() > before:
            counted += 1
    return out


def _rows(store: BlockStore) -> list[dict[str, Any]]:
    """The store's counter rows (namespace, model, counts); ``[]`` when it cannot give them."""
    try:
        rows = store.stats().get("rows", [])
    except KVShelfError:
        return []
    return [row for row in rows if isinstance(row, dict)]


def _unique(values: Iterable[str], exclude: set[str], limit: int) -> list[str]:
    out: list[str] = []
    for value in values:
        if value and value != UNKNOWN and value not in exclude and value not in out:
            out.append(value)
    return out[:limit]


def _namespaces(own: str, named: Iterable[str], rows: list[dict[str, Any]],
                headers: list[BlockHeader]) -> list[str]:
    written = sorted({str(r.get("namespace")) for r in rows if r.get("blocks_written")})
    return _unique([*named, *written, *(h.namespace for h in headers)], {own}, MAX_NAMESPACES)


def _models(query: MissQuery, rows: list[dict[str, Any]], headers: list[BlockHeader],
            dtype_fingerprints: set[str]) -> list[str]:
    written = sorted({str(r.get("model")) for r in rows
                      if r.get("namespace") == query.namespace and r.get("blocks_written")})
    scanned = [h.fingerprint for h in headers if h.namespace == query.namespace]
    return _unique([*written, *scanned], {query.fingerprint, *dtype_fingerprints}, MAX_MODELS)


# -- the candidates -------------------------------------------------------------------------------------------------


def _probes(query: MissQuery, dtype_fingerprints: dict[str, str], namespaces: list[str],
            models: list[str]) -> list[_Probe]:
    ns = query.namespace
    probes = [_Probe(MissKind.OTHER_DTYPE, name.removeprefix("torch."), ns, query.spans(fingerprint=fp))
              for name, fp in dtype_fingerprints.items()]
    probes += [_Probe(MissKind.OTHER_BLOCK_SIZE, str(size), ns, query.spans(block_size=size))
               for size in BLOCK_SIZES if size != query.block_size]
    probes += [_Probe(MissKind.OTHER_NAMESPACE, other, other, query.spans(namespace=other)) for other in namespaces]
    probes += [_Probe(MissKind.OTHER_MODEL, fp, ns, query.spans(fingerprint=fp)) for fp in models]
    tokens = query.lookup_ids
    if len(tokens) >= 1:
        chunk = BlockSpan(0, len(tokens), chunk_key(query.fingerprint, ns, tokens))
        probes.append(_Probe(MissKind.CHUNKED, "chunk", ns, [chunk]))
    return [p for p in probes if p.spans]


def _held_runs(store: BlockStore, probes: list[_Probe]) -> list[int]:
    """The leading held blocks of each probe's chain (at most ``MAX_PROBE_BLOCKS``): one uncounted ``held`` call
    per namespace."""
    runs = [0] * len(probes)
    for namespace in dict.fromkeys(p.namespace for p in probes):
        members = [i for i, p in enumerate(probes) if p.namespace == namespace]
        keys = [span.key for i in members for span in probes[i].spans[:MAX_PROBE_BLOCKS]]
        try:
            held = store.held(keys, namespace=namespace)
        except KVShelfError:
            continue
        at = 0
        for i in members:
            n = len(probes[i].spans[:MAX_PROBE_BLOCKS])
            mine = held[at:at + n]
            runs[i] = next((j for j, present in enumerate(mine) if not present), n)
            at += n
    return runs


def _probe_reasons(store: BlockStore, query: MissQuery, probes: list[_Probe], reused: int,
                   headers: list[BlockHeader], model: Any) -> list[MissReason]:
    reasons = []
    for probe, run in zip(probes, _held_runs(store, probes), strict=True):
        tokens = probe.spans[run - 1].end if run else 0
        if tokens <= reused:
            continue
        dtype = _other_dtype_of(probe, headers, model) if probe.kind is MissKind.OTHER_MODEL else None
        if dtype is not None:
            reasons.append(MissReason(MissKind.OTHER_DTYPE, _dtype_model_detail(probe, run, tokens, dtype, model),
                                      blocks=run, tokens=tokens, candidate=dtype))
            continue
        reasons.append(MissReason(probe.kind, _detail(probe, run, tokens, query, headers, model), blocks=run,
                                  tokens=tokens, candidate=probe.candidate,
                                  token_index=0 if probe.kind is MissKind.CHUNKED else None))
    return reasons


def _other_dtype_of(probe: _Probe, headers: list[BlockHeader], model: Any) -> str | None:
    """The dtype (``"float32"``) of another fingerprint's blocks when a scanned header of it shows this model's KV
    shape in a wider dtype: the same model loaded in that dtype, most likely (a float32 checkpoint's blocks
    cannot be named from its bfloat16 copy: ``fingerprint.other_dtype_fingerprints``); None otherwise. A
    narrower dtype is never guessed: the model's own weights cast to it name its blocks exactly, so blocks of
    that dtype under another fingerprint are another model's."""
    header = next((h for h in headers if h.fingerprint == probe.candidate), None)
    own = getattr(model, "dtype", None)
    if header is None or own is None or header.dtype.itemsize <= own.itemsize:
        return None
    layers, kv_heads, head_dim = kv_geometry(model)
    if (header.shape[0], header.shape[1], header.shape[3]) != (layers, kv_heads, head_dim):
        return None
    return str(header.dtype).removeprefix("torch.")


def _dtype_model_detail(probe: _Probe, run: int, tokens: int, dtype: str, model: Any) -> str:
    layers, kv_heads, head_dim = kv_geometry(model)
    return (f"{run} block{'s' if run != 1 else ''} ({tokens} tokens) of this prompt are stored in {dtype} for model "
            f"fingerprint {probe.candidate}, whose KV has this model's shape ({layers} layers, {kv_heads} KV heads, "
            f"head dim {head_dim}); this model runs in {str(model.dtype).removeprefix('torch.')} and blocks are "
            f"keyed by dtype: load the model in {dtype} to reuse them (unless they are another checkpoint's)")


def _detail(probe: _Probe, run: int, tokens: int, query: MissQuery, headers: list[BlockHeader],
            model: Any) -> str:
    held = f"{run} block{'s' if run != 1 else ''} ({tokens} tokens) of this prompt"
    if probe.kind is MissKind.OTHER_DTYPE:
        return (f"{held} are stored for these weights in {probe.candidate}; blocks are keyed by dtype: load the "
                f"model in {probe.candidate} to reuse them")
    if probe.kind is MissKind.OTHER_BLOCK_SIZE:
        return (f"{held} are stored in blocks of {probe.candidate} tokens; this generator cuts blocks of "
                f"{query.block_size}: use block_size={probe.candidate}")
    if probe.kind is MissKind.OTHER_NAMESPACE:
        return (f"{held} are stored in namespace {probe.candidate!r}; this generator reads namespace "
                f"{query.namespace!r}")
    if probe.kind is MissKind.OTHER_MODEL:
        return (f"{held} are stored for model fingerprint {probe.candidate}, not for this model's "
                f"({query.fingerprint}): {_which_model(probe.candidate, headers, model)}")
    return (f"tokens 0-{tokens} of this prompt are stored as one position-independent chunk (a RAG chunk or "
            "prompt module); prefix lookup reads chained blocks: reuse chunks through RAGGenerator or "
            "PromptModuleGenerator")


def _which_model(fingerprint: str, headers: list[BlockHeader], model: Any) -> str:
    """What a scanned header of ``fingerprint`` says about its model, against this one's KV geometry."""
    header = next((h for h in headers if h.fingerprint == fingerprint), None)
    if header is None:
        return "other weights (a fine-tune, another checkpoint, weights edited since) or another model"
    layers, kv_heads, head_dim = kv_geometry(model)
    if (header.shape[0], header.shape[1], header.shape[3]) == (layers, kv_heads, head_dim):
        return (f"its KV has this model's shape ({layers} layers, {kv_heads} KV heads, head dim {head_dim}): "
                "other weights of this architecture (a fine-tune, another checkpoint, weights edited since)")
    return f"its KV is shaped {tuple(header.shape)}: another model"


def _evicted(spans: list[BlockSpan], found: int, log: EvictionLog) -> list[MissReason]:
    tier = log.tier_of(spans[found].key)
    if tier is None:
        return []
    run = 1
    while found + run < len(spans) and log.tier_of(spans[found + run].key) is not None:
        run += 1
    start, end = spans[found].start, spans[found + run - 1].end
    return [MissReason(MissKind.EVICTED,
                       f"{run} block{'s' if run != 1 else ''} of this prompt (tokens {start}-{end}) were stored and "
                       f"evicted (last from tier {tier!r}); a larger capacity, or pinning, keeps them",
                       blocks=run, tokens=end - start, candidate=tier)]


# -- what the scanned headers show ---------------------------------------------------------------------------------


def _is_chunk(header: BlockHeader) -> bool:
    return chunk_key(header.fingerprint, header.namespace, header.token_ids) == header.key


def _find_run(haystack: Sequence[int], needle: Sequence[int]) -> int | None:
    """The first index where ``needle`` occurs in ``haystack`` as a contiguous run."""
    if not needle or len(needle) > len(haystack):
        return None
    big = np.asarray(haystack, dtype="<i8").tobytes()
    small = np.asarray(needle, dtype="<i8").tobytes()
    at = big.find(small)
    while at != -1 and at % 8:
        at = big.find(small, at + 1)
    return None if at == -1 else at // 8


def _chunk_reasons(query: MissQuery, headers: list[BlockHeader], reused: int,
                   already: list[MissReason]) -> list[MissReason]:
    if any(r.kind is MissKind.CHUNKED for r in already):
        return []
    for header in headers:
        if (header.namespace != query.namespace or header.fingerprint != query.fingerprint
                or PARENT_EXTRA in header.extra or not _is_chunk(header)):
            continue
        at = _find_run(query.ids, header.token_ids)
        if at is None or at + len(header.token_ids) <= reused:
            continue
        end = at + len(header.token_ids)
        return [MissReason(MissKind.CHUNKED,
                           f"tokens {at}-{end} of this prompt are stored as a position-independent chunk (a RAG "
                           "chunk or prompt module); prefix lookup reads chained blocks: reuse chunks through "
                           "RAGGenerator or PromptModuleGenerator",
                           blocks=1, tokens=end - at, candidate="chunk", token_index=at)]
    return []


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _token_text(tokenizer: Any, token: int) -> str:
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        return str(token)
    return str(tokenizer.decode([token]))


def _token_reasons(query: MissQuery, spans: list[BlockSpan], found: int, headers: list[BlockHeader],
                   tokenizer: Any) -> list[MissReason]:
    start = spans[found].start
    parent = spans[found - 1].key.hex() if found else None
    best: tuple[int, BlockHeader] | None = None
    rest = query.ids[start:]
    for header in headers:
        if (header.namespace != query.namespace or header.fingerprint != query.fingerprint
                or header.start_pos != start or header.extra.get(PARENT_EXTRA) != parent):
            continue
        if parent is None and _is_chunk(header):
            continue
        n = _common_prefix(header.token_ids, rest)
        if n >= len(header.token_ids) or n >= len(rest) or (parent is None and n == 0):
            continue
        if best is None or n > best[0]:
            best = (n, header)
    if best is None:
        return []
    n, header = best
    index = start + n
    mine, theirs = int(query.ids[index]), int(header.token_ids[n])
    mine_text, theirs_text = _token_text(tokenizer, mine), _token_text(tokenizer, theirs)
    return [MissReason(MissKind.TOKENS_DIFFER,
                       f"token {index} differs: the prompt has {mine_text!r} (id {mine}), a stored block of this "
                       f"model and namespace has {theirs_text!r} (id {theirs}) after the same {index} tokens "
                       "(for the same text: another tokenizer, chat template or special tokens gave other ids)",
                       blocks=1, tokens=n, token_index=index, prompt_token=mine_text,
                       stored_token=theirs_text)]


def _never_stored(query: MissQuery, reused: int, probes: list[_Probe], headers: list[BlockHeader]) -> MissReason:
    tried = {kind: sum(p.kind is kind for p in probes) for kind in MissKind}
    models = (f"{tried[MissKind.OTHER_MODEL]} other model fingerprints" if tried[MissKind.OTHER_MODEL]
              else "no other model fingerprint (none known to this store: it cannot tell whether the weights "
                   "changed)")
    return MissReason(MissKind.NEVER_STORED,
                      f"no block of this prompt from token {reused} on is held for this model, namespace and block "
                      f"size, nor in {tried[MissKind.OTHER_DTYPE]} other dtypes, "
                      f"{tried[MissKind.OTHER_BLOCK_SIZE]} other block sizes, "
                      f"{tried[MissKind.OTHER_NAMESPACE]} other namespaces, {models}, or as a chunk; "
                      f"{len(headers)} stored blocks' headers were compared",
                      tokens=reused)
