"""Made-up paper abstracts: the corpus of the test suite, and of the benchmarks when no real corpus is given.

``make_abstracts(count, seed)`` returns ``count`` records ``{"title", "abstract"}`` shaped like
``../shared/data/abstracts.jsonl``'s: a unique title naming a method, and 6 to 10 sentences (about 150 to 250
words) drawn from a bank of some 400 technical words, so that word-frequency tasks (RULER's ``cwe``/``fwe``) and
retrieval (BM25) have a vocabulary to work with. Deterministic for a ``(count, seed)``; no file, no network.
"""

from __future__ import annotations

import random

_NAME_HEADS = (
    "Magic", "Deep", "Sparse", "Fast", "Meta", "Hyper", "Omni", "Neural", "Quantum", "Graph", "Flow", "Vision",
    "Token", "Prism", "Echo", "Atlas", "Nova", "Vector", "Stream", "Cascade", "Lumen", "Helix", "Orbit", "Pulse",
)
_NAME_TAILS = (
    "Infinite", "Former", "Net", "Mixer", "Diffusion", "Align", "Bench", "Search", "Tune", "Fusion", "Guard",
    "Lens", "Scope", "Path", "Forge", "Bridge", "Sense", "Weave", "Shift", "Merge", "Cast", "Span", "Loop", "Mind",
)
_ADJECTIVES = (
    "robust", "scalable", "efficient", "adaptive", "hierarchical", "unified", "lightweight", "generative",
    "contrastive", "multimodal", "sparse", "dense", "causal", "temporal", "spatial", "recurrent", "modular",
    "probabilistic", "differentiable", "iterative", "compact", "flexible", "accurate", "stable", "principled",
    "practical", "scarce", "noisy", "abundant", "latent", "explicit", "implicit", "global", "local", "dynamic",
    "static", "semantic", "syntactic", "lexical", "visual", "acoustic", "textual", "tabular", "relational",
)
_NOUNS = (
    "framework", "method", "model", "network", "encoder", "decoder", "attention", "transformer", "benchmark",
    "dataset", "corpus", "pipeline", "module", "objective", "estimator", "classifier", "detector", "tracker",
    "retriever", "generator", "planner", "controller", "policy", "reward", "gradient", "optimizer", "scheduler",
    "embedding", "representation", "feature", "kernel", "manifold", "graph", "vertex", "cluster", "partition",
    "sequence", "trajectory", "signal", "spectrum", "image", "video", "speech", "audio", "sentence", "document",
    "query", "answer", "label", "annotation", "prior", "posterior", "sample", "distribution", "variance", "bias",
    "latency", "throughput", "memory", "storage", "bandwidth", "compute", "budget", "accuracy", "precision",
    "recall", "robustness", "fairness", "privacy", "security", "alignment", "reasoning", "planning", "perception",
    "inference", "training", "pretraining", "finetuning", "adapter", "prompt", "context", "window", "cache",
    "token", "vocabulary", "syntax", "grammar", "lexicon", "molecule", "protein", "genome", "climate", "weather",
    "traffic", "robot", "gripper", "sensor", "camera", "lidar", "satellite", "terrain", "portrait", "avatar",
    "character", "scene", "texture", "shape", "surface", "volume", "lighting", "shadow", "motion", "gesture",
)
_VERBS = (
    "improves", "reduces", "captures", "models", "learns", "predicts", "generates", "retrieves", "aligns",
    "compresses", "accelerates", "stabilizes", "regularizes", "decomposes", "combines", "extends", "generalizes",
    "outperforms", "matches", "surpasses", "preserves", "exploits", "leverages", "estimates", "refines",
    "calibrates", "distills", "transfers", "adapts", "balances", "handles", "supports", "enables", "unifies",
)
_TASKS = (
    "image synthesis", "video generation", "speech recognition", "machine translation", "question answering",
    "document retrieval", "code completion", "protein folding", "weather forecasting", "traffic prediction",
    "robotic grasping", "object detection", "scene reconstruction", "motion planning", "text summarization",
    "dialogue modeling", "anomaly detection", "graph classification", "molecule design", "portrait animation",
    "semantic parsing", "entity linking", "depth estimation", "pose tracking", "audio captioning",
)
_CLOSERS = (
    "Code and models are publicly available.",
    "We release our dataset and evaluation scripts to foster further research.",
    "Extensive ablations confirm the contribution of each component.",
    "Our findings suggest practical guidelines for practitioners.",
    "We discuss limitations and directions for future work.",
)


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "sh", "ch")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _phrase(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"


def _sentence(rng: random.Random, name: str, task: str) -> str:
    templates = (
        lambda: f"The approach {rng.choice(_VERBS)} the {_phrase(rng)} of existing {rng.choice(_NOUNS)} methods.",
        lambda: f"Unlike prior work on {task}, our {rng.choice(_NOUNS)} {rng.choice(_VERBS)} {_phrase(rng)} "
                f"without any {_phrase(rng)}.",
        lambda: f"We introduce a {_phrase(rng)} that {rng.choice(_VERBS)} the {rng.choice(_NOUNS)} and "
                f"{rng.choice(_VERBS)} the {_phrase(rng)}.",
        lambda: f"Experiments on several benchmarks show that {name} {rng.choice(_VERBS)} strong baselines in "
                f"{rng.choice(_NOUNS)} and {rng.choice(_NOUNS)}.",
        lambda: f"A {_phrase(rng)} {rng.choice(_VERBS)} the {rng.choice(_NOUNS)} while the {_phrase(rng)} "
                f"{rng.choice(_VERBS)} its {rng.choice(_NOUNS)}.",
        lambda: f"Our analysis shows that the {_phrase(rng)} is the main source of {rng.choice(_NOUNS)} in "
                f"{task}.",
        lambda: f"The {rng.choice(_NOUNS)} is trained with a {_phrase(rng)} and a {_phrase(rng)} on "
                f"a large collection of {rng.choice(_NOUNS)} samples.",
    )
    return rng.choice(templates)()


def make_abstracts(count: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``count`` made-up abstracts ``{"title", "abstract"}``, titles unique (module doc)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    rng = random.Random(f"kvshelf-synthetic-abstracts:{seed}")
    names = [h + t for h in _NAME_HEADS for t in _NAME_TAILS]
    rng.shuffle(names)
    if count > len(names):
        raise ValueError(f"count must be <= {len(names)}, got {count}")
    records = []
    for name in names[:count]:
        task = rng.choice(_TASKS)
        title = f"{name}: {_phrase(rng).capitalize()} {_plural(rng.choice(_NOUNS))} for {task.title()}"
        body = [f"We present {name}, a {_phrase(rng)} for {task} that {rng.choice(_VERBS)} the "
                f"{_phrase(rng)} of current {_plural(rng.choice(_NOUNS))}."]
        body += [_sentence(rng, name, task) for _ in range(rng.randrange(6, 10))]
        body.append(rng.choice(_CLOSERS))
        records.append({"title": title, "abstract": " ".join(body)})
    return records
