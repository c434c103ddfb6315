"""``kvshelf bench serve``: a serving run on one model, plain HF ``model.generate`` vs kvshelf, several clients
(chat and RAG workloads, the identical request sequence for both systems), then a chat-turns run. The method:
docs/benchmarks.md, "Serving".
"""

from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench.common import corpus_texts, machine_description, results_path, save_results
from kvshelf.bench.rag import ANSWER, CHUNK_TOKENS, NEW_TOKENS, answer_code, plant
from kvshelf.bench.rag import _template as rag_template

SYSTEMS = ("hf", "kvshelf")
WORKLOADS = ("chat", "rag")
CHAT_SYSTEM = ("You find the secret code in the documents the user gives and answer questions about them. "
               "Answer briefly.")
DOC_ABSTRACTS = 4
DOC_START = 100  # chat documents come from the corpus from here on; RAG chunks from its start
CHAT_DOCUMENTS = 16
CHAT_INTRO = "Find the secret code in this document.\n\nDocument:\n\n"
CODE_QUESTION = "Question: What is the secret code mentioned in the document above?"
FOLLOW_UPS = (
    "What problem does the first paper address? Answer in one short sentence.",
    "Which method does the second paper propose? Answer in one short sentence.",
    "Name one result that the third paper reports. Answer in one short sentence.",
    "What is the topic of the last paper? Answer in one short sentence.",
)
CHAT_NEW_TOKENS = 12
RAG_POOL = 64  # plain chunks; needle chunks: half as many
TURN_USER_TOKENS = 60
TURN_NEW_TOKENS = 240
TURN_SYSTEM = "You are a helpful assistant who discusses research papers at length."


# -- prompts -------------------------------------------------------------------------------------------------


class Encoder:
    """Tokenizes text inside a prompt (no special tokens added), one call at a time across client threads."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        with self._lock:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_all(self, ids: list[int]) -> str:
        """``ids`` as text, special tokens kept (encodes back to ``ids`` for ordinary text)."""
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class ChatFormat:
    """The model's chat template as the text around messages: ``head`` (the system message and the first user
    message's opening), ``to_assistant`` (a user message's end and the assistant's opening), ``to_user`` (an
    assistant message's end and the next user's opening)."""

    head: str
    to_assistant: str
    to_user: str
    eos: frozenset[int]

    @classmethod
    def of(cls, tokenizer: Any, model: Any, system: str) -> ChatFormat:
        marks = ("\x00U1\x00", "\x00A1\x00", "\x00U2\x00")
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": marks[0]},
             {"role": "assistant", "content": marks[1]}, {"role": "user", "content": marks[2]}],
            tokenize=False, add_generation_prompt=True)
        head, rest = text.split(marks[0])
        to_assistant, rest = rest.split(marks[1])
        to_user, last = rest.split(marks[2])
        if last != to_assistant:
            raise SystemExit("the chat template opens the assistant turn differently after a later user message")
        eos = model.generation_config.eos_token_id
        return cls(head, to_assistant, to_user, frozenset([eos] if isinstance(eos, int) else eos or []))

    def context(self, encode: Encoder, context: str) -> list[int]:
        """The head of a first prompt whose user message starts with ``context`` (a document): the ids both
        systems start that prompt with, and the prefix kvshelf can hold before any conversation."""
        return encode(self.head + context)

    def first(self, encode: Encoder, context: str, user: str, opening: str) -> list[int]:
        """A conversation's first prompt: the user message is ``context`` + ``user``, encoded in two pieces (the
        ids are the same for both systems; the context's are ``self.context``'s)."""
        return self.context(encode, context) + encode(user + self.to_assistant + opening)

    def next(self, encode: Encoder, prompt: list[int], answer: list[int], user: str, opening: str) -> list[int]:
        """The next turn's prompt: the previous prompt, the answer (its end-of-turn token dropped: the template's
        text adds it), and the next user message."""
        while answer and answer[-1] in self.eos:
            answer = answer[:-1]
        return prompt + answer + encode(self.to_user + user + self.to_assistant + opening)


@dataclass(frozen=True)
class Turn:
    """One planned chat turn: the user's message, the assistant turn's opening, the planted code when the turn
    asks for it, and the answer's token budget."""

    user: str
    opening: str
    code: str | None
    max_new_tokens: int
    context: str = ""  # the first turn: the document, at the head of the user message


@dataclass(frozen=True)
class RagCase:
    chunks: tuple[list[int], ...]  # 8 chunks' token ids
    code: str


@dataclass(frozen=True)
class ChatDocument:
    text: str  # the abstracts, one with the planted sentence
    code: str


def chat_documents(texts: list[str], count: int = CHAT_DOCUMENTS, seed: int = 0) -> list[ChatDocument]:
    """``count`` documents of ``DOC_ABSTRACTS`` consecutive abstracts from ``DOC_START`` on (from 0 in a short
    corpus), each with its own planted code: a fact of the document, as a RAG needle chunk's code is."""
    rng = random.Random(seed)
    start = DOC_START if len(texts) >= DOC_START + count * DOC_ABSTRACTS else 0
    out = []
    for n in range(count):
        doc = [texts[(start + n * DOC_ABSTRACTS + k) % len(texts)] for k in range(DOC_ABSTRACTS)]
        code = f"{rng.randrange(1000, 10000)}"
        at = rng.randrange(len(doc))
        doc[at] = plant(doc[at], code, rng)
        out.append(ChatDocument("\n\n".join(doc), code))
    return out


def document_context(doc: ChatDocument) -> str:
    """The head of a conversation's first user message: the intro and the document."""
    return f"{CHAT_INTRO}{doc.text}\n\n"


def conversations(documents: list[ChatDocument], seed: int) -> Iterator[list[Turn]]:
    """A chat client's conversations, endless and the same for every system (seeded)."""
    rng = random.Random(seed)
    while True:
        doc = documents[rng.randrange(len(documents))]
        turns = [Turn(CODE_QUESTION, ANSWER, doc.code, NEW_TOKENS, context=document_context(doc))]
        turns += [Turn(q, "", None, CHAT_NEW_TOKENS) for q in FOLLOW_UPS]
        turns.append(Turn(CODE_QUESTION, ANSWER, doc.code, NEW_TOKENS))
        yield turns


@dataclass(frozen=True)
class RagPool:
    prefix: list[int]  # system prompt and the documents' intro
    question: list[int]  # question, end of the user turn, the answer's opening
    plain: list[list[int]]
    needles: list[tuple[list[int], str]]

    @classmethod
    def build(cls, tokenizer: Any, encode: Encoder, texts: list[str], pool: int, seed: int = 0) -> RagPool:
        if pool < 7:
            raise SystemExit(f"the RAG pool needs at least 7 plain chunks, got {pool}")
        rng = random.Random(seed)
        needles = max(1, pool // 2)
        chosen = [texts[i % len(texts)] for i in range(pool + needles)]
        trimmed = [tokenizer.decode(encode(t)[:CHUNK_TOKENS]).strip() for t in chosen]
        plain = [encode(t + "\n\n") for t in trimmed[:pool]]
        planted = []
        for text in trimmed[pool:]:
            code = f"{rng.randrange(1000, 10000)}"
            planted.append((encode(plant(text, code, rng) + "\n\n"), code))
        before, after = rag_template(tokenizer)
        return cls(encode(before), encode(after), plain, planted)

    def cases(self, seed: int) -> Iterator[RagCase]:
        """A RAG client's requests, endless and the same for every system (seeded)."""
        rng = random.Random(seed)
        while True:
            chunks = [self.plain[i] for i in rng.sample(range(len(self.plain)), 7)]
            needle, code = self.needles[rng.randrange(len(self.needles))]
            chunks.insert(rng.randrange(8), needle)
            yield RagCase(tuple(chunks), code)


# -- systems -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    ttft_s: float
    new_ids: list[int]
    prompt_tokens: int
    reused_tokens: int = 0  # prompt tokens whose KV came from the store


class ChatSession:
    """One conversation as token ids: each ``send`` builds the next prompt from the previous one and its answer
    (``ChatFormat.next``), and ``generate(prompt, max_new_tokens, stored_ids)`` answers it."""

    def __init__(self, fmt: ChatFormat, encode: Encoder,
                 generate: Callable[..., tuple[float, list[int], int, list[int]]]) -> None:
        self.fmt, self.encode, self._generate = fmt, encode, generate
        self.prompt: list[int] | None = None
        self.answer: list[int] = []
        self.stored: list[int] = []  # the ids whose KV the system stored after the last turn (kvshelf)

    def send(self, turn: Turn, **generate_kwargs: Any) -> Reply:
        if self.prompt is None:
            prompt = self.fmt.first(self.encode, turn.context, turn.user, turn.opening)
        else:
            prompt = self.fmt.next(self.encode, self.prompt, self.answer, turn.user, turn.opening)
        ttft, new_ids, reused, self.stored = self._generate(prompt, turn.max_new_tokens, self.stored,
                                                            **generate_kwargs)
        self.prompt, self.answer = prompt, new_ids
        return Reply(ttft, new_ids, len(prompt), reused)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PlainHF:
    """``model.generate`` on the whole prompt, every time."""

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, fmt: ChatFormat, encode: Encoder, rag: RagPool) -> None:
        from kvshelf.adapters.streaming import FirstTokenTimer

        self._timer = FirstTokenTimer
        self.model, self.fmt, self.encode, self.pool = model, fmt, encode, rag
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(fmt.eos, default=None)

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, **kwargs: Any) -> tuple[float, list[int]]:
        started = time.perf_counter()
        timer = self._timer()
        ids = torch.tensor([prompt], device=self.model.device)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=self.pad, streamer=timer, **kwargs)
        finished = time.perf_counter()
        return (timer.first_token_at or finished) - started, [int(t) for t in out[0, len(prompt):].tolist()]

    def chat(self) -> ChatSession:
        def generate(prompt: list[int], max_new_tokens: int, stored: list[int],
                     **kwargs: Any) -> tuple[float, list[int], int, list[int]]:
            return (*self.generate(prompt, max_new_tokens, **kwargs), 0, [])

        return ChatSession(self.fmt, self.encode, generate)

    def rag(self, case: RagCase) -> Reply:
        prompt = self.pool.prefix + [t for c in case.chunks for t in c] + self.pool.question
        ttft, new_ids = self.generate(prompt, NEW_TOKENS)
        return Reply(ttft, new_ids, len(prompt))


class KVShelf:
    """Chat reusing each finished turn's KV (generated tokens included); RAG with block attention over
    precomputed chunk blocks.

    A chat turn is ``CachedGenerator.generate(prompt, cacheable_prefix=<common prefix with what the last turn
    stored>, store_generated=True)``: what ``Conversation.send`` does (``adapters/chat.py``), on token ids, because
    a planted-fact turn opens the assistant's answer ("The secret code is") and ``Conversation`` renders the
    generation prompt itself (it has no answer opening)."""

    name = "kvshelf"

    def __init__(self, model: Any, tokenizer: Any, store: Any, fmt: ChatFormat, encode: Encoder,
                 rag: RagPool) -> None:
        from kvshelf.adapters.generate import CachedGenerator
        from kvshelf.adapters.rag import RAGGenerator

        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.fmt, self.encode, self.pool = fmt, encode, rag
        self.cached = CachedGenerator(model, tokenizer, store)
        self.rag_generator = RAGGenerator(model, tokenizer, store, prefix=rag.prefix, on_missing="error",
                                          chunk_size=None)
        self.handles: dict[tuple[int, ...], Any] = {}
        self.documents: list[list[int]] = []  # the precomputed documents' prompt heads

    def precompute_documents(self, documents: list[ChatDocument], progress: bool = True) -> float:
        """Store each corpus document's prompt head (system prompt, intro, document; its last partial block too),
        as a service for chats over known documents does offline (not timed); returns the seconds it took."""
        started = time.perf_counter()
        for doc in tqdm(documents, desc="precompute chat documents", unit="doc", disable=not progress):
            ids = self.fmt.context(self.encode, document_context(doc))
            self.cached.generate(ids, max_new_tokens=1, cacheable_prefix=len(ids), wait=True)
            self.documents.append(ids)
        return time.perf_counter() - started

    def chat(self) -> ChatSession:
        def generate(prompt: list[int], max_new_tokens: int, stored: list[int],
                     **kwargs: Any) -> tuple[float, list[int], int, list[int]]:
            if not stored:  # a first turn: the document's precomputed head, when it is one
                stored = next((d for d in self.documents if prompt[: len(d)] == d), [])
            common = common_prefix(prompt, stored)
            result = self.cached.generate(prompt, max_new_tokens=max_new_tokens, cacheable_prefix=common or None,
                                          store_generated=True, **kwargs)
            return result.ttft_s, result.new_ids, result.reused_tokens, prompt + result.new_ids[:-1]

        return ChatSession(self.fmt, self.encode, generate)

    def precompute(self, progress: bool = True) -> dict[str, Any]:
        """Every pool chunk's block after the RAG prefix, stored (``adapters.rag.precompute``): the offline step,
        not timed. Requests then pass the chunks' ``ChunkHandle``s."""
        from kvshelf.adapters.rag import precompute

        chunks = self.pool.plain + [ids for ids, _ in self.pool.needles]
        texts = [self.encode.decode_all(ids) for ids in chunks]
        done = precompute(texts, self.model, self.tokenizer, self.store, prefix=self.pool.prefix,
                          modes=("block-attention",), chunk_size=max(map(len, chunks)), progress=progress)
        for ids, handle in zip(chunks, done.chunks, strict=True):
            if list(handle.token_ids) != ids:
                raise SystemExit("a RAG chunk's text does not tokenize back to its ids")
            self.handles[tuple(ids)] = handle
        return done.summary()

    def rag(self, case: RagCase) -> Reply:
        result = self.rag_generator.generate([self.handles[tuple(c)] for c in case.chunks], self.pool.question,
                                             mode="block-attention", max_new_tokens=NEW_TOKENS)
        # on_missing="error": every block (and the prefix) came from the store; only the question was prefilled
        reused = result.prompt_tokens - len(self.pool.question)
        return Reply(result.ttft_s, result.new_ids, result.prompt_tokens, reused)

    def close(self) -> None:
        self.cached.close()
        self.rag_generator.close()


# -- the serving run -------------------------------------------------------------------------------------------


@dataclass
class Record:
    workload: str
    client: int
    seq: int
    ttft_s: float
    correct: bool | None  # None: not a planted-fact question
    answer: tuple[int, ...] = ()
    prompt_tokens: int = 0
    reused_tokens: int = 0
    code: str | None = None  # the planted code asked for


@dataclass
class RunOutcome:
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def workload_of(client: int) -> str:
    return WORKLOADS[client % 2]


def serve(system: Any, documents: list[ChatDocument], clients: int, seconds: float, seed: int = 0) -> RunOutcome:
    """Run ``clients`` threads against ``system`` for ``seconds``; each finishes its request in flight."""
    outcome = RunOutcome()
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    start = {"t": 0.0}

    def record(rec: Record) -> None:
        with lock:
            outcome.records.append(rec)

    def chat_client(i: int) -> None:
        seq = 0
        for turns in conversations(documents, seed * 1000 + i):
            session = system.chat()
            for turn in turns:
                if time.perf_counter() >= start["t"] + seconds:
                    return
                reply = session.send(turn)
                correct = None if turn.code is None else answer_code(system.encode.decode(reply.new_ids)) == turn.code
                record(Record("chat", i, seq, reply.ttft_s, correct, tuple(reply.new_ids), reply.prompt_tokens,
                              reply.reused_tokens, turn.code))
                seq += 1

    def rag_client(i: int) -> None:
        for seq, case in enumerate(system.pool.cases(seed * 1000 + i)):
            if time.perf_counter() >= start["t"] + seconds:
                return
            reply = system.rag(case)
            record(Record("rag", i, seq, reply.ttft_s, answer_code(system.encode.decode(reply.new_ids)) == case.code,
                          tuple(reply.new_ids), reply.prompt_tokens, reply.reused_tokens, case.code))

    def client(i: int) -> None:
        barrier.wait()
        try:
            (chat_client if workload_of(i) == "chat" else rag_client)(i)
        except Exception as exc:  # noqa: BLE001 - reported, and the run fails after all clients stop
            with lock:
                outcome.errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(i,), name=f"bench-client-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    start["t"] = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    outcome.wall_s = time.perf_counter() - start["t"]
    return outcome


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks."""
    data = sorted(values)
    at = (len(data) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (at - low)


def summarize(name: str, outcome: RunOutcome) -> list[dict[str, Any]]:
    rows = []
    for workload in (*WORKLOADS, "all"):
        recs = [r for r in outcome.records if workload in ("all", r.workload)]
        if not recs:
            continue
        asked = [r.correct for r in recs if r.correct is not None]
        ttfts = [r.ttft_s for r in recs]
        rows.append({"system": name, "workload": workload, "requests_per_s": round(len(recs) / outcome.wall_s, 4),
                     "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p99_s": round(percentile(ttfts, 99), 4),
                     "accuracy": round(statistics.fmean(asked), 4) if asked else None})
    return rows


def counts(outcome: RunOutcome) -> dict[str, Any]:
    """Per workload: requests, planted-fact questions asked, prompt tokens and those whose KV was reused."""
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        recs = [r for r in outcome.records if r.workload == w]
        out[w] = {"requests": len(recs), "asked": sum(r.correct is not None for r in recs),
                  "prompt_tokens": sum(r.prompt_tokens for r in recs),
                  "reused_tokens": sum(r.reused_tokens for r in recs)}
    return out | {"wall_s": round(outcome.wall_s, 2)}


def same_request_accuracy(outcomes: dict[str, RunOutcome]) -> dict[str, Any]:
    """Accuracy of both systems over the planted-fact requests both completed (the same requests)."""
    keyed = {name: {(r.client, r.seq): r.correct for r in o.records if r.correct is not None}
             for name, o in outcomes.items()}
    common = sorted(set.intersection(*(set(k) for k in keyed.values())))
    return {"requests": len(common)} | {
        name: round(statistics.fmean(k[c] for c in common), 4) if common else None for name, k in keyed.items()}


def same_answers(outcomes: dict[str, RunOutcome]) -> dict[str, dict[str, int]]:
    """Per workload, over the requests every system completed: how many got the same answer tokens everywhere
    (chat reuse is exact, so all of them up to floating point; block attention changes RAG's attention)."""
    out = {}
    for workload in WORKLOADS:
        keyed = [{(r.client, r.seq): r.answer for r in o.records if r.workload == workload}
                 for o in outcomes.values()]
        common = set.intersection(*(set(k) for k in keyed)) if keyed else set()
        same = sum(len({k[c] for k in keyed}) == 1 for c in common)
        out[workload] = {"requests": len(common), "same": same}
    return out


def misses(outcome: RunOutcome, encode: Encoder, limit: int = 20) -> list[dict[str, Any]]:
    """The planted-fact questions answered wrong (the first ``limit``): which request, the code, the answer."""
    wrong = [r for r in outcome.records if r.correct is False]
    return [{"workload": r.workload, "client": r.client, "seq": r.seq, "code": r.code,
             "answer": encode.decode(list(r.answer))} for r in sorted(wrong, key=lambda r: (r.client, r.seq))[:limit]]


# -- chat turns --------------------------------------------------------------------------------------------------


def turn_messages(texts: list[str], encode: Encoder, turns: int) -> list[str]:
    """``turns`` user messages of ~``TURN_USER_TOKENS`` tokens: a passage of an abstract and a request."""
    ask = "\n\nDiscuss this passage in detail: what it claims, how, and why it matters."
    budget = TURN_USER_TOKENS - len(encode(ask))
    out = []
    for n in range(turns):
        passage = encode.decode(encode(texts[(n * 7) % len(texts)])[:budget]).strip()
        out.append(passage + ask)
    return out


def chat_turns(model: Any, tokenizer: Any, store: Any, hf: PlainHF, encode: Encoder, texts: list[str], turns: int,
               new_tokens: int, console: Console, progress: bool = True) -> list[dict[str, Any]]:
    """TTFT at each turn of one ``Conversation`` (reuse) vs plain HF on the same prompt ids (no reuse)."""
    from kvshelf.adapters.chat import Conversation
    from kvshelf.adapters.generate import CachedGenerator

    rows: list[dict[str, Any]] = []
    with CachedGenerator(model, tokenizer, store) as generator:
        conversation = Conversation(generator, system=TURN_SYSTEM)
        for n, user in enumerate(tqdm(turn_messages(texts, encode, turns), desc="chat turns", unit="turn",
                                      disable=not progress)):
            # the turn's prompt as the conversation renders it: plain HF prefills it first (paired in time with
            # the reuse measurement, so a burst of load on a shared machine weighs on both alike)
            prompt = conversation.template_ids(conversation.messages + [{"role": "user", "content": user}])
            no_reuse, _ = hf.generate(prompt, 1)
            turn = conversation.send(user, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            if turn.result.prompt_ids != prompt:
                raise SystemExit(f"turn {n + 1}: the conversation's prompt is not its template ids")
            rows.append({"turn": n + 1, "context_tokens": len(prompt),
                         "added_tokens": len(prompt) - (rows[-1]["context_tokens"] if rows else 0),
                         "reused_tokens": turn.reused_tokens, "prefilled_tokens": turn.prefilled_tokens,
                         "ttft_reuse_s": round(turn.ttft_s, 4), "ttft_no_reuse_s": round(no_reuse, 4),
                         "speedup": round(no_reuse / turn.ttft_s, 2)})
            console.print(f"[dim]turn {n + 1}: {len(prompt)} prompt tokens, {turn.reused_tokens} reused, TTFT "
                          f"{turn.ttft_s:.3f} s vs {no_reuse:.3f} s[/dim]")
    return rows


# -- the benchmark ------------------------------------------------------------------------------------------------


def run(*, json_path: str | None, corpus: str | None, seconds: float = 120, clients: int = 4, threads: int = 1,
        turns: int = 8, turn_new_tokens: int = TURN_NEW_TOKENS, pool: int = RAG_POOL,
        documents: int = CHAT_DOCUMENTS, precompute_documents: bool = True, model_name: str = "smollm2-135m",
        console: Console | None = None, progress: bool = True) -> dict[str, Any]:
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore.embedded import open_embedded_store

    console = console or Console()
    model, tokenizer = load_model(model_name)
    texts = list(corpus_texts(corpus))
    encode = Encoder(tokenizer)
    docs = chat_documents(texts, documents)
    fmt = ChatFormat.of(tokenizer, model, CHAT_SYSTEM)
    rag = RagPool.build(tokenizer, encode, texts, pool)
    outcomes: dict[str, RunOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-serve-") as tmp:
        # memory tier over LMDB; nothing is fsynced (the run's blocks are not kept)
        store = open_embedded_store(tmp, memory_bytes="4GiB", write_policy="back", durable=False)
        systems = {"hf": PlainHF(model, tokenizer, fmt, encode, rag),
                   "kvshelf": KVShelf(model, tokenizer, store, fmt, encode, rag)}
        # the offline steps, not timed, on every core; then the thread count both systems run with
        torch.set_num_threads(os.cpu_count() or 1)
        precomputed = systems["kvshelf"].precompute(progress)
        documents_s = systems["kvshelf"].precompute_documents(docs, progress) if precompute_documents else None
        torch.set_num_threads(threads)
        systems["hf"].generate(list(range(10, 80)), 2)  # one-time start-up costs out of the timings
        for name, system in systems.items():
            console.print(f"[bold]{name}[/bold]: {clients} clients for {seconds:g} s...")
            outcomes[name] = serve(system, docs, clients, seconds)
            if outcomes[name].errors:
                raise SystemExit(f"{name}: " + "; ".join(outcomes[name].errors))
            console.print(f"[dim]{name}: {len(outcomes[name].records)} requests in {outcomes[name].wall_s:.1f} s"
                          "[/dim]")
        systems["kvshelf"].close()
        turn_rows = chat_turns(model, tokenizer, store, systems["hf"], encode, texts, turns, turn_new_tokens,
                               console, progress) if turns else []
        store.close()
    results = [row for name in SYSTEMS for row in summarize(name, outcomes[name])]
    payload = {
        "model": model_name,
        "machine": machine_description(),
        "corpus": corpus or "synthetic",
        "settings": {"seconds": seconds, "clients": clients, "torch_threads": threads,
                     "workloads": {str(i): workload_of(i) for i in range(clients)},
                     "chat": {"documents": len(docs), "document_abstracts": DOC_ABSTRACTS,
                              "turns": 2 + len(FOLLOW_UPS), "code_new_tokens": NEW_TOKENS,
                              "follow_up_new_tokens": CHAT_NEW_TOKENS,
                              "precomputed_documents": precompute_documents,
                              "precompute_s": round(documents_s, 3) if documents_s is not None else None},
                     "rag": {"chunks": 8, "chunk_tokens": CHUNK_TOKENS, "pool_plain": len(rag.plain),
                             "pool_needles": len(rag.needles), "mode": "block-attention",
                             "new_tokens": NEW_TOKENS, "precompute_s": precomputed["seconds"]},
                     "chat_turns": {"turns": turns, "user_tokens": TURN_USER_TOKENS, "new_tokens": turn_new_tokens}},
        "requests": {name: counts(o) for name, o in outcomes.items()},
        "accuracy_same_requests": same_request_accuracy(outcomes),
        "same_answers": same_answers(outcomes),
        "misses": {name: misses(o, encode) for name, o in outcomes.items()},
        "results": results,
        "chat_turns": turn_rows,
        "note": "TTFT as the clients see it, contention included; a shared 2-core CPU adds noise",
    }
    print_tables(console, payload)
    save_results(json_path, payload, console)
    return payload


def _times(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a and b else "-"


def _share(a: float | None, b: float | None) -> str:
    return f"{a / b:.0%}" if a is not None and b else "-"


def print_tables(console: Console, payload: dict[str, Any]) -> None:
    tables = results_tables(payload)
    console.print(tables[0])
    same = ", ".join(f"{w} {v['same']}/{v['requests']}" for w, v in payload["same_answers"].items())
    acc = payload["accuracy_same_requests"]
    console.print(f"[dim]{payload['machine']}; on the requests both systems completed: same answers {same}; "
                  f"accuracy hf {acc['hf']}, kvshelf {acc['kvshelf']} ({acc['requests']} questions)[/dim]")
    for table in tables[1:]:
        console.print(table)


def results_tables(payload: dict[str, Any]) -> list[Table]:
    """The tables of a saved payload: throughput and TTFT by workload and system, then the chat turns when measured
    (``run``'s printout; docs/benchmarks.md renders them)."""
    s = payload["settings"]
    rows = {(r["system"], r["workload"]): r for r in payload["results"]}
    table = Table(title=f"Serving, {payload['model']}: {s['clients']} clients x {s['seconds']:g} s, torch threads "
                        f"{s['torch_threads']}")
    for column in ("workload", "system", "requests/s", "TTFT p50 (s)", "TTFT p99 (s)", "accuracy"):
        table.add_column(column, justify="right")
    for workload in (*WORKLOADS, "all"):
        hf, kv = rows.get(("hf", workload)), rows.get(("kvshelf", workload))
        for r in (hf, kv):
            if r is not None:
                table.add_row(workload, r["system"], f"{r['requests_per_s']:.3f}", f"{r['ttft_p50_s']:.3f}",
                              f"{r['ttft_p99_s']:.3f}", "-" if r["accuracy"] is None else f"{r['accuracy']:.1%}")
        if hf is not None and kv is not None:
            table.add_row(workload, "kvshelf/hf", _times(kv["requests_per_s"], hf["requests_per_s"]),
                          f"{_times(hf['ttft_p50_s'], kv['ttft_p50_s'])} lower",
                          f"{_times(hf['ttft_p99_s'], kv['ttft_p99_s'])} lower",
                          _share(kv["accuracy"], hf["accuracy"]), end_section=True)
    tables = [table]
    if payload["chat_turns"]:
        table = Table(title="Chat turns: one conversation, ~300 tokens added per turn; TTFT with vs without reuse")
        for column in ("turn", "context tokens", "added", "reused", "TTFT reuse (s)", "TTFT no reuse (s)",
                       "speedup"):
            table.add_column(column, justify="right")
        for r in payload["chat_turns"]:
            table.add_row(str(r["turn"]), str(r["context_tokens"]), str(r["added_tokens"]), str(r["reused_tokens"]),
                          f"{r['ttft_reuse_s']:.3f}", f"{r['ttft_no_reuse_s']:.3f}", f"{r['speedup']:.1f}x")
        tables.append(table)
    return tables

if __name__ == "__main__":
    run(json_path=str(results_path("serve.json")), corpus=None)  # $KVSHELF_CACHE/bench-results/serve.json
