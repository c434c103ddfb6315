"""RULER-style long-context tasks, generated locally: prompts of a fixed length in tokens and their expected answers.

After Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?" (COLM 2024): the
same task families and scoring, written for this project (no download; the haystack is the corpus given with
``--corpus``, a JSONL of ``{"title", "abstract"}``):

* ``niah_single``: one needle "One of the special magic numbers for KEY is: VALUE." (KEY an adjective-noun pair,
  VALUE 7 digits) at a random depth of the corpus sentences; the question asks for KEY's numbers.
* ``niah_multikey``: four needles with four keys; the question asks for one key (three distractors).
* ``niah_multivalue``: four needles with one key and four values; all four are expected.
* ``niah_multiquery``: four needles with four keys; the question asks for all four keys, all four values expected.
* ``vt`` (variable tracking): one chain of five variables "VAR ABCDE = 12345.", "VAR FGHIJ = VAR ABCDE.", ...
  spread through the sentences in order; the five names are expected.
* ``cwe`` (common words extraction): a numbered list of corpus words, ten of them ``freq_cw`` times each (30 from
  4K tokens, fewer below, as the list is shorter), the others three times; the ten common words are expected.
* ``fwe`` (frequent words extraction): coded words (random letters) with Zipf counts (alpha 2); the three most
  frequent are expected.
* ``qa``: corpus abstracts as numbered documents (title and abstract); the question gives the first words of one
  abstract and asks for its title; the title's first five words are expected.

Each prompt ends with an answer prefix (RULER's), and its length is ``tokens`` minus the task's answer tokens
(``NEW_TOKENS``) in the model's tokenizer, give or take one haystack unit (a sentence, a list entry, a word): the
amount of haystack is found by bisection. The score (RULER's ``string_match_all``) is the fraction of expected
items present in the greedy output, case-insensitively. Every random choice comes from ``random.Random`` seeded
with a string of the task, the length and the sample's seed (a SHA-512 of it: the same on every run and machine).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvshelf.kvstore.errors import ConfigError

TASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
                          "qa")
NEEDLE_TASKS: tuple[str, ...] = TASKS[:4]

#: tokens of greedy output each task gets (and keeps free at the end of the window)
NEW_TOKENS: dict[str, int] = {"niah_single": 12, "niah_multikey": 12, "niah_multivalue": 40, "niah_multiquery": 40,
                              "vt": 30, "cwe": 40, "fwe": 15, "qa": 16}

_ADJECTIVES = ("ancient", "bitter", "brave", "calm", "clever", "cosmic", "crimson", "curious", "dusty", "eager",
               "fancy", "fragile", "gentle", "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "mellow",
               "misty", "noble", "odd", "plain", "polite", "quiet", "rapid", "rusty", "shiny", "silent", "smooth",
               "sturdy", "tasteful", "tidy", "vivid", "wary", "wild", "witty", "zealous")
_NOUNS = ("anchor", "badger", "banjo", "beacon", "bicycle", "candle", "canyon", "cherry", "compass", "cottage",
          "dolphin", "falcon", "garden", "glacier", "harbor", "helmet", "island", "kettle", "lantern", "lemon",
          "meadow", "mirror", "orchid", "otter", "pebble", "pepper", "pillow", "rabbit", "saddle", "shovel",
          "spider", "teapot", "thistle", "tiger", "trumpet", "tunnel", "violin", "walrus", "window", "zebra")

Document = tuple[str, str]  # (title, body)
Render = Callable[[int], tuple[str, str]]  # haystack units -> (context, question)


@dataclass(frozen=True)
class Sample:
    """One prompt: its token ids (context, question, answer prefix) and the items its answer must contain."""

    task: str
    tokens: int  # the length asked for: prompt + answer tokens <= tokens
    seed: int
    ids: list[int]  # context ids then question ids (each tokenized alone)
    context_tokens: int  # ids[:context_tokens] is the context, the rest the question and answer prefix
    answers: tuple[str, ...]
    new_tokens: int


#: a task, length or corpus the generator cannot make a prompt from (a ``ConfigError``: a ``ValueError``)
TaskError = ConfigError


def corpus_documents(path: str | None) -> list[Document]:
    """The corpus as ``(title, abstract)`` pairs (titles unique, first kept), or made-up abstracts
    (``bench/synthetic_abstracts.py``) when there is none."""
    if path is None:
        from kvshelf.bench.synthetic_abstracts import make_abstracts

        records = make_abstracts()
    else:
        from kvshelf.bench.common import load_corpus

        records = load_corpus(path)
    docs = [(str(r.get("title", "")).strip(), str(r["abstract"]).strip()) for r in records]
    seen: set[str] = set()
    unique = []
    for title, body in docs:
        if title and body and title not in seen:
            seen.add(title)
            unique.append((title, body))
    return unique


def _sentences(docs: Sequence[Document]) -> list[str]:
    return [s for _, body in docs for s in re.split(r"(?<=[.!?])\s+", body.strip()) if s]


def _rng(task: str, tokens: int, seed: int, part: str = "") -> random.Random:
    return random.Random(f"ruler:{task}:{tokens}:{seed}:{part}")


def _fit(render: Render, tokenizer: Any, target: int, high: int) -> tuple[list[int], int]:
    """The ids of ``render(n)`` (context then question, each tokenized alone) for the largest ``n`` in ``[1, high]``
    whose prompt has at most ``target`` tokens, and the context's length."""
    def split(n: int) -> tuple[list[int], list[int]]:
        context, question = render(n)
        return (tokenizer(context, add_special_tokens=False)["input_ids"],
                tokenizer(question, add_special_tokens=False)["input_ids"])

    def ids(n: int) -> list[int]:
        context, question = split(n)
        return context + question

    low = 1
    if len(ids(low)) > target:
        raise TaskError(f"even the smallest prompt is longer than {target} tokens")
    while low < high:
        mid = (low + high + 1) // 2
        if len(ids(mid)) <= target:
            low = mid
        else:
            high = mid - 1
    context, question = split(low)
    return context + question, len(context)


def _insert(filler: list[str], items: list[str], depths: list[float]) -> str:
    """``filler`` with ``items`` inserted at relative ``depths`` (sorted, so items keep their order)."""
    out = list(filler)
    for offset, (item, depth) in enumerate(sorted(zip(items, depths, strict=True), key=lambda p: p[1])):
        out.insert(round(depth * len(filler)) + offset, item)
    return " ".join(out)


def _niah(task: str, sentences: list[str], tokens: int, seed: int) -> tuple[Render, tuple[str, ...], int]:
    rng = _rng(task, tokens, seed)
    corpus = " ".join(sentences)
    keys = [f"{a}-{n}" for a, n in zip(rng.sample(_ADJECTIVES, 4), rng.sample(_NOUNS, 4), strict=True)]
    values: list[str] = []
    while len(values) < 4:
        value = str(rng.randrange(1_000_000, 10_000_000))
        if value not in corpus and value not in values:
            values.append(value)
    if task == "niah_single":
        pairs, queried = [(keys[0], values[0])], [keys[0]]
    elif task == "niah_multikey":
        pairs, queried = list(zip(keys, values, strict=True)), [keys[0]]
    elif task == "niah_multivalue":
        pairs, queried = [(keys[0], v) for v in values], [keys[0]]
    else:  # multiquery
        pairs, queried = list(zip(keys, values, strict=True)), keys
    rng.shuffle(pairs)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in pairs]
    depths = [rng.random() for _ in needles]
    answers = tuple(v for k, v in pairs if k in queried)
    query = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + f", and {queried[-1]}"
    head = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about the numbers afterwards.\n")
    tail = (f"\nWhat are all the special magic numbers for {query} mentioned in the provided text?\n"
            f"Answer: The special magic numbers for {query} mentioned in the provided text are")
    hay = _rng(task, tokens, seed, "haystack")
    start = hay.randrange(len(sentences))

    def render(n: int) -> str:
        filler = [sentences[(start + i) % len(sentences)] for i in range(n)]
        return head + _insert(filler, needles, depths), tail

    return render, answers, len(sentences) * 2


def _vt(sentences: list[str], tokens: int, seed: int) -> tuple[Render, tuple[str, ...], int]:
    rng = _rng("vt", tokens, seed)
    names: list[str] = []
    while len(names) < 5:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(4)]
    depths = sorted(rng.random() for _ in chain)
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    tail = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above.\n"
            f"Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
            f"assigned the value {value}, they are:")
    start = _rng("vt", tokens, seed, "haystack").randrange(len(sentences))

    def render(n: int) -> str:
        filler = [sentences[(start + i) % len(sentences)] for i in range(n)]
        return head + _insert(filler, chain, depths), tail

    return render, tuple(names), len(sentences) * 2


def _corpus_words(docs: Sequence[Document]) -> list[str]:
    words = {w for _, body in docs for w in re.findall(r"\b[a-z]{4,10}\b", body)}
    return sorted(words)


def _cwe(docs: Sequence[Document], tokens: int, seed: int) -> tuple[Render, tuple[str, ...], int]:
    rng = _rng("cwe", tokens, seed)
    vocab = _corpus_words(docs)
    if len(vocab) < 200:
        raise TaskError(f"cwe needs at least 200 distinct corpus words, the corpus has {len(vocab)}")
    chosen = rng.sample(vocab, len(vocab))
    common, rare = chosen[:10], chosen[10:]
    freq_cw = 30 if tokens >= 4096 else max(6, 30 * tokens // 4096)
    head = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
    tail = ("Question: What are the 10 most common words in the above list?\n"
            "Answer: The top 10 words that appear most often in the list are:")

    def render(n: int) -> str:
        words = [w for w in common for _ in range(freq_cw)] + [w for w in rare[:n] for _ in range(3)]
        _rng("cwe", tokens, seed, f"order{n}").shuffle(words)
        return head + "".join(f"{i}. {w}\n" for i, w in enumerate(words, 1)), tail

    return render, tuple(common), len(rare)


def _fwe(tokens: int, seed: int) -> tuple[Render, tuple[str, ...], int]:
    rng = _rng("fwe", tokens, seed)
    vocab: list[str] = []
    while len(vocab) < 400:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 5)))
        if word not in vocab:
            vocab.append(word)
    weights = [1.0 / (r + 1) ** 2 for r in range(len(vocab))]  # Zipf, alpha 2
    total = sum(weights)
    head = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. ")
    tail = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text?\nAnswer: According to the coded text above, "
            "the three most frequently appeared words are:")

    def render(n: int) -> str:
        # n words in all; counts by Zipf, the rest of n spread one each over the tail of the vocabulary
        counts = [int(n * w / total) for w in weights]
        rest = n - sum(counts)
        for r in range(len(vocab) - 1, len(vocab) - 1 - rest, -1):
            counts[r] += 1
        words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        _rng("fwe", tokens, seed, f"order{n}").shuffle(words)
        parts = [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
        return head + " .... ".join(parts), tail

    return render, tuple(vocab[:3]), 60 * tokens


def _qa(docs: Sequence[Document], tokens: int, seed: int) -> tuple[Render, tuple[str, ...], int]:
    rng = _rng("qa", tokens, seed)
    gold = rng.randrange(len(docs))
    title, body = docs[gold]
    others = [d for i, d in enumerate(docs) if i != gold]
    rng.shuffle(others)
    depth = rng.random()
    pieces = [(t, s) for t, b in others for s in _sentences([(t, b)])]  # distractor sentences, document by document
    start = " ".join(body.split()[:12])
    answer = " ".join(title.split()[:5]).rstrip(".,:;!?")
    instruction = ("Answer the question based on the given documents. Only give me the answer and do not output "
                   "any other words.")
    tail = (f"{instruction}\n\nQuestion: What is the title of the document whose abstract begins with "
            f"\"{start}\"?\nAnswer: The title is")

    def render(n: int) -> str:
        distractors: list[Document] = []
        for t, s in pieces[:n]:
            if distractors and distractors[-1][0] == t:
                distractors[-1] = (t, distractors[-1][1] + " " + s)
            else:
                distractors.append((t, s))
        docs_in = list(distractors)
        docs_in.insert(round(depth * len(distractors)), (title, body))
        listed = "".join(f"Document {i}:\nTitle: {t}\n{b}\n\n" for i, (t, b) in enumerate(docs_in, 1))
        return f"{instruction}\n\nThe following are given documents.\n\n{listed}", tail

    return render, (answer,), len(pieces)


def generate(task: str, tokenizer: Any, docs: Sequence[Document], tokens: int, seed: int,
             new_tokens: int | None = None) -> Sample:
    """One sample of ``task`` whose prompt has at most ``tokens - new_tokens`` tokens (close to it)."""
    if task not in TASKS:
        raise TaskError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if not docs:
        raise TaskError("the corpus has no documents")
    answer_tokens = NEW_TOKENS[task] if new_tokens is None else new_tokens
    target = tokens - answer_tokens
    if target < 128:
        raise TaskError(f"{tokens} tokens leave {target} for the prompt of {task}; give at least 128 more")
    sentences = _sentences(docs)
    if task in NEEDLE_TASKS:
        render, answers, high = _niah(task, sentences, tokens, seed)
    elif task == "vt":
        render, answers, high = _vt(sentences, tokens, seed)
    elif task == "cwe":
        render, answers, high = _cwe(docs, tokens, seed)
    elif task == "fwe":
        render, answers, high = _fwe(tokens, seed)
    else:
        render, answers, high = _qa(docs, tokens, seed)
    ids, context = _fit(render, tokenizer, target, min(high, 4 * target))
    return Sample(task=task, tokens=tokens, seed=seed, ids=ids, context_tokens=context, answers=answers,
                  new_tokens=answer_tokens)


def samples(task: str, tokenizer: Any, docs: Sequence[Document], tokens: int, count: int, seed: int = 0,
            new_tokens: int | None = None) -> list[Sample]:
    """``count`` samples of ``task`` at ``tokens``, seeds ``seed .. seed + count - 1``."""
    return [generate(task, tokenizer, docs, tokens, seed + i, new_tokens) for i in range(count)]


def score(output: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of ``answers`` found in ``output`` (case-insensitive)."""
    if not answers:
        raise TaskError("a sample with no expected answer cannot be scored")
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers)
