"""``kvshelf bench rag``: needle QA over reused RAG chunks, TTFT at 8 x 512 tokens, and prompt-module TTFT.

Needle QA: each case is 8 chunks of ~150-160 tokens (one corpus abstract each, cut to 150 tokens); one carries a
planted short sentence with a random 4-digit code ("The secret code is 1234.", its own paragraph); the question
asks for it and the assistant turn opens with "The secret code is" (the same prompt in every mode), so the code is
the answer's first tokens. Modes: ``full`` (no reuse), ``reuse`` (TurboRAG: chunks encoded alone at position 0,
keys re-rotated), ``reuse-blend`` (CacheBlend, r = 15%, over chunks encoded after the shared prefix),
``block-attention`` (Block-Attention: chunks encoded after the system prompt), plus ``reuse-blend-chunk``
(CacheBlend over the position-0 chunks) and ``block-attention-ape`` (APE temperature/scale on the parallel blocks).
Chunk KV is precomputed once for the pool (not timed), as a RAG pipeline would (``precompute(..., prefix=...)``,
every mode's blocks; the table counts the chunks a mode still computed after it: 0 expected). Reported per mode:
accuracy (exact match: the greedy answer starts with the code), mean KL(full || mode) of the first answer token's
distribution, median TTFT over cases (mean beside it) and speedup vs ``full``, and accuracy with the chunk order
shuffled. One generation per case, mode and order.

Second table: TTFT with 8 chunks x 512 tokens (median of ``runs``). Third: a 2,048-token prompt module plus 64
free tokens vs full prefill (median of ``runs``), with the greedy outputs compared. Timings on a shared CPU are
noisy.
"""

from __future__ import annotations

import random
import re
import statistics
import tempfile
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench.common import corpus_texts, machine_description, median, results_path, save_results

SYSTEM = "You find the secret code in the documents the user gives. Answer with the code only."
INTRO = "Find the secret code in these documents.\n\nDocuments:\n\n"
QUESTION = "\nQuestion: What is the secret code mentioned in the documents above?"
ANSWER = "The secret code is"  # the assistant turn starts the answer: a 135M model then gives the code itself
NEEDLE = "The secret code is {code}."
CHUNK_TOKENS = 150
NEW_TOKENS = 6  # " " and 4 digits are single tokens; room for one more
MODES = ("full", "reuse", "reuse-blend", "block-attention", "reuse-blend-chunk", "block-attention-ape")
APE = (0.9, 0.9)
# extra rows: (RAGGenerator mode, constructor options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "reuse-blend-chunk": ("reuse-blend", {"blend_base": "chunk"}),  # CacheBlend over TurboRAG's position-0 chunks
    "block-attention-ape": ("block-attention", {"ape": APE}),  # APE: parallel blocks after the shared prefix
}


def _template(tokenizer: Any) -> tuple[str, str]:
    """The chat template split around the documents: ``(shared prefix, text after the documents)``. The same
    prompt serves every mode; the question ends the user turn and the assistant turn opens with ``ANSWER``."""
    marker = "\x00CTX\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": marker}],
        tokenize=False, add_generation_prompt=True,
    )
    before, after = text.split(marker)
    return before + INTRO, QUESTION + after + ANSWER


def answer_code(text: str | None) -> str | None:
    """The number the answer starts with (exact match is ``answer_code(answer) == code``)."""
    match = re.match(r"\s*(\d+)", text or "")
    return match.group(1) if match else None


def plant(text: str, code: str, rng: random.Random) -> str:
    """``text`` with the needle sentence as its own short paragraph at a random sentence boundary (not first)."""
    sentences = text.split(". ")
    at = rng.randrange(1, max(2, len(sentences)))
    head, tail = ". ".join(sentences[:at]), ". ".join(sentences[at:])
    return f"{head}{'' if head.endswith('.') else '.'}\n\n{NEEDLE.format(code=code)}\n\n{tail}".rstrip()


def _enc(tokenizer: Any, text: str) -> list[int]:
    from kvshelf.adapters.prompts import prompt_ids

    return prompt_ids(text, tokenizer, add_special_tokens=False)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def make_cases(tokenizer: Any, texts: list[str], cases: int, seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """A pool of plain chunks and ``cases`` needle cases: ``{"chunks": [ids x 8], "code": str, "needle": i}``.

    Each chunk is one abstract cut to ``CHUNK_TOKENS`` tokens; the needle chunk adds the planted sentence."""
    rng = random.Random(seed)
    texts = texts[: max(16, min(len(texts), 4 * cases))]  # a retrieval pool a few times the chunks asked for
    trimmed = [tokenizer.decode(_enc(tokenizer, t)[:CHUNK_TOKENS]).strip() for t in texts]
    pool = [_enc(tokenizer, t + "\n\n") for t in trimmed]
    out = []
    used: set[int] = set()
    for _ in range(cases):
        picks = rng.sample(range(len(pool)), 8)
        used.update(picks)
        needle = rng.randrange(8)
        code = f"{rng.randrange(1000, 10000)}"
        chunks = [pool[i] for i in picks]
        chunks[needle] = _enc(tokenizer, plant(trimmed[picks[needle]], code, rng) + "\n\n")
        out.append({"chunks": chunks, "code": code, "needle": needle})
    return [pool[i] for i in sorted(used)], out


def _generator(model: Any, tokenizer: Any, store: Any, prefix: list[int], mode: str) -> Any:
    from kvshelf.adapters.rag import RAGGenerator

    # chunk_size=None: every chunk is taken whole (the 8 x 512 table's chunks are longer than the default split)
    return RAGGenerator(model, tokenizer, store, prefix=prefix, chunk_size=None, **VARIANTS.get(mode, (mode, {}))[1])


def _mode_arg(mode: str) -> str:
    return VARIANTS.get(mode, (mode, {}))[0]


def needle_qa(model: Any, tokenizer: Any, texts: list[str], cases: int, store: Any, console: Console,
              modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    from kvshelf.adapters.rag import precompute

    before, after = _template(tokenizer)
    prefix, question = _enc(tokenizer, before), _enc(tokenizer, after)
    pool, needle_cases = make_cases(tokenizer, texts, cases)
    rng = random.Random(1)
    gens = {m: _generator(model, tokenizer, store, prefix, m) for m in modes}
    # offline precompute (not timed), one call: the prefix, every chunk alone at 0 (reuse, reuse-blend-chunk) and
    # every chunk as a block after the prefix (block-attention, reuse-blend); each chunk is one "document" of ids
    needle_chunks = [c["chunks"][c["needle"]] for c in needle_cases]
    precompute(pool + needle_chunks, model, tokenizer, store, prefix=prefix, chunk_size=4096)
    rows: dict[str, dict[str, list]] = {m: {"hit": [], "hit_shuffled": [], "kl": [], "ttft": [], "computed": []}
                                        for m in modes}
    for case in tqdm(needle_cases, desc="needle QA", unit="case"):
        order = list(range(8))
        rng.shuffle(order)
        shuffled = [case["chunks"][i] for i in order]
        reference = None
        for mode in modes:
            result = gens[mode].generate(case["chunks"], question, mode=_mode_arg(mode), max_new_tokens=NEW_TOKENS)
            again = gens[mode].generate(shuffled, question, mode=_mode_arg(mode), max_new_tokens=NEW_TOKENS)
            if mode == "full":
                reference = result.first_logits
            r = rows[mode]
            r["hit"].append(answer_code(result.text) == case["code"])
            r["hit_shuffled"].append(answer_code(again.text) == case["code"])
            r["kl"].append(_kl(reference, result.first_logits) if reference is not None else 0.0)
            r["ttft"].append(result.ttft_s)
            r["computed"].append(result.computed_chunks + again.computed_chunks)  # 0: precompute served the mode
    # TTFT: the median over cases (robust to bursts of load on a shared CPU), the mean beside it
    full_ttft = median(rows["full"]["ttft"]) if "full" in rows else float("nan")
    results = []
    for mode in modes:
        r = rows[mode]
        ttft = median(r["ttft"])
        results.append({"mode": mode, "accuracy": round(statistics.fmean(r["hit"]), 4),
                        "accuracy_shuffled": round(statistics.fmean(r["hit_shuffled"]), 4),
                        "kl": round(statistics.fmean(r["kl"]), 5), "ttft_s": round(ttft, 4),
                        "ttft_mean_s": round(statistics.fmean(r["ttft"]), 4),
                        "speedup": round(full_ttft / ttft, 2), "cases": len(r["hit"]),
                        "chunks_computed_after_precompute": sum(r["computed"]),
                        "prompt_tokens": len(prefix) + sum(len(c) for c in needle_cases[0]["chunks"]) + len(question)})
    return results


def ttft_8x512(model: Any, tokenizer: Any, texts: list[str], store: Any, runs: int) -> list[dict[str, Any]]:
    from kvshelf.bench.ttft import build_context

    before, after = _template(tokenizer)
    prefix, question = _enc(tokenizer, before), _enc(tokenizer, after)
    context = build_context(tokenizer, texts[100:], 8 * 512)
    chunks = [context[i * 512 : (i + 1) * 512] for i in range(8)]
    out = []
    reference = None
    for mode in ("full", "reuse", "reuse-blend", "block-attention"):
        gen = _generator(model, tokenizer, store, prefix, mode)
        if mode != "full":  # warm: stores the chunks / blocks (the model is warm from the needle QA)
            gen.generate(chunks, question, mode=mode, max_new_tokens=1)
        results = [gen.generate(chunks, question, mode=mode, max_new_tokens=1) for _ in range(runs)]
        ttft = median([r.ttft_s for r in results])
        reference = reference or ttft
        out.append({"mode": mode, "chunks": 8, "chunk_tokens": 512, "prompt_tokens": results[0].prompt_tokens,
                    "ttft_s": round(ttft, 4), "speedup": round(reference / ttft, 2),
                    "recomputed_tokens": results[0].recomputed_tokens})
    return out


def prompt_module_ttft(model: Any, tokenizer: Any, texts: list[str], store: Any, runs: int,
                       module_tokens: int = 2048, free_tokens: int = 64, new_tokens: int = 16) -> dict[str, Any]:
    from kvshelf.adapters.generate import CachedGenerator
    from kvshelf.adapters.prompt_modules import PromptModuleGenerator
    from kvshelf.bench.ttft import build_context
    from kvshelf.reuse.schema import Module, ModuleUse, PromptSchema

    module_text = tokenizer.decode(build_context(tokenizer, texts, module_tokens + 40))
    module_ids = _enc(tokenizer, module_text)[:module_tokens]
    module_text = tokenizer.decode(module_ids)
    question_ids = _enc(tokenizer, "\n\nQuestion: " + " ".join(texts[7].split()[:120]))
    for keep in range(free_tokens, 0, -1):  # exactly ``free_tokens`` free tokens once tokenized on their own
        free_text = tokenizer.decode(question_ids[:keep]) + "\nSummary:"
        if len(_enc(tokenizer, free_text)) <= free_tokens:
            break
    gen = PromptModuleGenerator(model, tokenizer, store, PromptSchema("bench", (Module("doc", (module_text,)),)))
    gen.precompute()
    assembly = gen.assemble([ModuleUse("doc"), free_text])
    plain = CachedGenerator(model, tokenizer)
    full = [plain.generate(list(assembly.tokens), max_new_tokens=new_tokens, reuse=False, store=False)
            for _ in range(runs)]
    cached = [gen.generate([ModuleUse("doc"), free_text],
                           max_new_tokens=new_tokens) for _ in range(runs)]
    full_ttft, cached_ttft = median([r.ttft_s for r in full]), median([r.ttft_s for r in cached])
    return {"module_tokens": len(gen.compiled.modules[0].tokens), "free_tokens": assembly.uncached,
            "full_ttft_s": round(full_ttft, 4), "module_ttft_s": round(cached_ttft, 4),
            "speedup": round(full_ttft / cached_ttft, 2),
            "same_output": all(r.new_ids == full[0].new_ids for r in cached)}


def run(*, json_path: str | None, corpus: str | None, cases: int = 40, runs: int = 3,
        model_name: str = "smollm2-135m", console: Console | None = None,
        modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    from kvshelf.adapters.model import load_model
    from kvshelf.kvstore.embedded import open_embedded_store

    console = console or Console()
    model, tokenizer = load_model(model_name)
    texts = list(corpus_texts(corpus))
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-rag-") as tmp:
        # the chunk KV of the whole pool (~3 GB raw) stays in memory: the timed reads never wait on the disk, and
        # the untimed precompute does not wait on fsync of every chunk (write-back, nothing is evicted)
        store = open_embedded_store(tmp, memory_bytes="6GiB", write_policy="back", durable=False)
        results = needle_qa(model, tokenizer, texts, cases, store, console, modes)
        long_ctx = ttft_8x512(model, tokenizer, texts, store, runs)
        modules = prompt_module_ttft(model, tokenizer, texts, store, runs)
        store.close()
    payload = {"model": model_name, "machine": machine_description(), "corpus": corpus or "synthetic",
               "ape": list(APE), "recompute_ratio": 0.15, "results": results, "ttft_8x512": long_ctx,
               "prompt_module": modules,
               "note": "TTFT on a shared 2-core CPU; other processes may add noise"}
    _print(console, payload)
    save_results(json_path, payload, console)
    return payload


def _print(console: Console, payload: dict[str, Any]) -> None:
    for table in results_tables(payload):
        console.print(table)


def results_tables(payload: dict[str, Any]) -> list[Table]:
    """The tables of a saved payload: needle QA by mode, TTFT of 8 x 512-token chunks, the prompt module
    (``run``'s printout; docs/benchmarks.md renders them)."""
    tables = []
    table = Table(title=f"RAG needle QA, {payload['model']} ({payload['machine']}), TTFT: median over cases")
    for column in ("mode", "accuracy", "accuracy (shuffled)", "KL vs full", "TTFT (s)", "speedup", "cases",
                   "chunks computed after precompute"):
        table.add_column(column, justify="right")
    for r in payload["results"]:
        table.add_row(r["mode"], f"{r['accuracy']:.1%}", f"{r['accuracy_shuffled']:.1%}", f"{r['kl']:.4f}",
                      f"{r['ttft_s']:.3f}", f"{r['speedup']:.1f}x", str(r["cases"]),
                      str(r.get("chunks_computed_after_precompute", "-")))
    tables.append(table)
    table = Table(title="TTFT, 8 chunks x 512 tokens (warm chunk cache)")
    for column in ("mode", "prompt tokens", "TTFT (s)", "speedup", "recomputed tokens"):
        table.add_column(column, justify="right")
    for r in payload["ttft_8x512"]:
        table.add_row(r["mode"], str(r["prompt_tokens"]), f"{r['ttft_s']:.3f}", f"{r['speedup']:.1f}x",
                      str(r["recomputed_tokens"]))
    tables.append(table)
    m = payload["prompt_module"]
    table = Table(title="Prompt module: 2,048-token module + 64 free tokens")
    for column in ("module tokens", "free tokens", "full TTFT (s)", "module TTFT (s)", "speedup", "same output"):
        table.add_column(column, justify="right")
    table.add_row(str(m["module_tokens"]), str(m["free_tokens"]), f"{m['full_ttft_s']:.3f}",
                  f"{m['module_ttft_s']:.3f}", f"{m['speedup']:.1f}x", "yes" if m["same_output"] else "NO")
    tables.append(table)
    return tables


if __name__ == "__main__":
    run(json_path=str(results_path("rag.json")), corpus=None)  # $KVSHELF_CACHE/bench-results/rag.json
