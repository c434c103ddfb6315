"""``kvshelf bench longctx``: RULER-style long-context accuracy of every KV method against the fraction of KV kept.

Tasks (``bench/ruler.py``, after Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024): ``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``,
``fwe``, ``qa``, generated from the corpus with fixed seeds at the lengths asked for (SmolLM2 tokens; its window is
8,192), plus ``ppl``: long-document perplexity, a window of ``tokens`` corpus tokens whose last 512 are scored
teacher-forced after the rest is prefilled (and compressed or selected).

Methods, each at every budget (fraction of the context's KV) of ``--budgets``:

* ``full`` (impl kvshelf): plain attention.
* the static methods of ``adapters.pruning`` (StreamingLLM, H2O, Keyformer, SnapKV, KeyNorm): one eager prefill of
  the whole prompt (context, question, answer prefix) is scored by all of them at once, as in ``bench pruning``
  (``adapters.pruning.scoring``), then each pruned cache decodes greedily; TokenSelect (dynamic) decodes over the
  full cache attending to its budget per step.
* kvpress's ``SnapKVPress`` and ``StreamingLLMPress`` (impl kvpress) in their own virtualenv, one worker process,
  same prompts, one prefill per prompt compressed by each press (``bench pruning``'s worker).
* ``fastkv`` (``adapters.pruning.fastkv``; prefill-time token-selective propagation, Jo et al. 2025) and
  ``tier-sparse`` (``adapters.longctx``: block-sparse attention over KV held in a kvshelf store), when importable.

Per row: ``accuracy`` is RULER's string match (fraction of expected items in the greedy output), averaged over the
samples; for ``ppl`` it is the top-1 next-token accuracy over the 512 scored tokens and ``dppl_rel`` = ppl /
ppl(full) - 1. ``kv_fraction``: the context's KV each decode step attends to, over the full context's (static
methods: kept tokens / prompt tokens, measured on the kept indices; TokenSelect: its budget; fastkv: measured on its
cache). ``resident_fraction``: the context's KV held in process memory at the peak over the full context's. The
static methods, TokenSelect and ``full`` prefill the whole prompt in memory, so it is 1.0 for them; fastkv's is
measured at every layer of its prefill; tier-sparse's is the session's peak resident bytes over the full KV's.
``ttft_s``: time to the first answer token (for ``full`` and the static methods, the one shared eager prefill that
scores every method, an upper bound of each one's own); ``tpot_s``: seconds per further greedy token (``ppl``: per
scored token of the teacher-forced chunk). The JSON is rewritten after every sample (``status``).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from kvshelf.bench import ruler
from kvshelf.bench.common import corpus_texts, machine_description, save_results

BUDGETS: tuple[float, ...] = (0.25, 0.125)
PPL_TAIL = 512  # tokens scored at the end of a perplexity window
TASKS: tuple[str, ...] = (*ruler.TASKS, "ppl")
#: the default plan: every task at 4K, the needle tasks and perplexity at 8K
DEFAULT_PLAN: tuple[tuple[str, int], ...] = (
    tuple((t, 4096) for t in ruler.TASKS) + tuple((t, 8192) for t in ruler.NEEDLE_TASKS) + (("ppl", 8192),))
DEFAULT_SAMPLES = 1
PASS = 0.5  # full attention's accuracy from which a task counts in the averages


def methods_known() -> tuple[str, ...]:
    """Every kvshelf method name ``--methods`` takes (``full`` always runs)."""
    from kvshelf.bench.pruning import STATIC

    return (*STATIC, "tokenselect", "fastkv", "tier-sparse")


@dataclass
class Row:
    """What one (impl, method, budget, task, tokens) gathered over the samples."""

    scores: list[float] = field(default_factory=list)
    kv_fraction: list[float] = field(default_factory=list)
    resident: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)


RowKey = tuple[str, str, float, str, int]  # impl, method, budget, task, tokens


class Tally:
    def __init__(self) -> None:
        self.rows: dict[RowKey, Row] = {}

    def add(self, key: RowKey, *, score: float | None, kv_fraction: float, resident: float, ttft: float,
            tpot: float, nll: float | None = None) -> None:
        row = self.rows.setdefault(key, Row())
        if score is not None:
            row.scores.append(score)
        row.kv_fraction.append(kv_fraction)
        row.resident.append(resident)
        row.ttft.append(ttft)
        row.tpot.append(tpot)
        if nll is not None:
            row.nll.append(nll)

    def results(self) -> list[dict[str, Any]]:
        out = []
        for (impl, method, budget, task, tokens), row in self.rows.items():
            full = self.rows.get(("kvshelf", "full", 1.0, task, tokens))
            dppl = None
            if row.nll and full is not None and full.nll:
                dppl = round(math.exp(statistics.fmean(row.nll) - statistics.fmean(full.nll)) - 1.0, 4)
            out.append({
                "method": method, "impl": impl, "task": task, "tokens": tokens, "budget": budget,
                "kv_fraction": round(statistics.fmean(row.kv_fraction), 4),
                "resident_fraction": round(statistics.fmean(row.resident), 4),
                "accuracy": round(statistics.fmean(row.scores), 4) if row.scores else None,
                "dppl_rel": dppl,
                "ppl": round(math.exp(statistics.fmean(row.nll)), 4) if row.nll else None,
                "ttft_s": round(statistics.median(row.ttft), 4),
                "tpot_s": round(statistics.median(row.tpot), 5),
                "samples": len(row.ttft),
            })
        return out


# -- kvshelf: full, static methods, TokenSelect (one shared eager prefill per prompt) --------------------------


def _static_methods(only: Sequence[str] | None) -> tuple[str, ...]:
    from kvshelf.bench.pruning import STATIC

    return tuple(m for m in STATIC if only is None or m in only)


def _kept_fraction(pre: Any, name: str, budget: float) -> float:
    from kvshelf.bench.pruning import key

    kept = pre.kept[key(name, budget)]  # layer -> [b, h_kv, kept] token indices
    return statistics.fmean(int(k.shape[-1]) for k in kept.values()) / pre.length


@torch.inference_mode()
def _scored_chunk(model: Any, cache: Any, ids: list[int], start: int, first_logits: torch.Tensor
                  ) -> tuple[float, float, float]:
    """Mean NLL and top-1 accuracy of ``ids[start:]`` given ``cache`` (of ``ids[:start]``), and seconds per token."""
    t0 = time.perf_counter()
    logits = model(input_ids=torch.tensor([ids[start:-1]]), past_key_values=cache, use_cache=True,
                   position_ids=torch.arange(start, len(ids) - 1).unsqueeze(0)).logits[0]
    secs = time.perf_counter() - t0
    logits = torch.cat([first_logits.unsqueeze(0), logits]).float()
    target = torch.tensor(ids[start:])
    nll = float(torch.nn.functional.cross_entropy(logits, target))
    top1 = float((logits.argmax(-1) == target).float().mean())
    return nll, top1, secs / max(1, len(ids) - start - 1)


@torch.inference_mode()
def _full_prefill_s(model: Any, ids: list[int]) -> float:
    """Seconds of full attention's own prefill of ``ids`` (the model's attention, no scoring): ``full``'s TTFT. The
    shared prefill below runs eager attention for the scores H2O and Keyformer read, which full attention skips."""
    t0 = time.perf_counter()
    model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def run_kvshelf(model: Any, tokenizer: Any, sample: ruler.Sample, budgets: tuple[float, ...], tally: Tally,
                only: Sequence[str] | None) -> None:
    """``full``, the static methods and TokenSelect on one RULER sample."""
    from kvshelf.bench.pruning import Prefilled, _decode, _methods, attending

    statics = _static_methods(only)
    t0 = time.perf_counter()
    pre = Prefilled(model, sample.ids, _methods(budgets, statics) if statics else {})
    ttft = time.perf_counter() - t0
    full_ttft = _full_prefill_s(model, sample.ids)
    configs = _configs(statics, budgets, only)
    for name, budget in configs:
        with attending(model, name, budget):
            out, secs = _decode(model, pre.cache_for(name, budget), pre.first, pre.length, sample.new_tokens - 1)
        fraction = _fraction(pre, name, budget)
        tally.add(("kvshelf", name, budget, sample.task, sample.tokens),
                  score=ruler.score(tokenizer.decode(out), sample.answers), kv_fraction=fraction, resident=1.0,
                  ttft=full_ttft if name == "full" else ttft, tpot=secs / max(1, sample.new_tokens - 1))


def _configs(statics: Sequence[str], budgets: tuple[float, ...], only: Sequence[str] | None) -> list[tuple[str, float]]:
    """``(method, budget)`` pairs one shared prefill serves: full, each static method and TokenSelect."""
    configs = [("full", 1.0)] + [(n, b) for n in statics for b in budgets]
    if only is None or "tokenselect" in only:
        configs += [("tokenselect", b) for b in budgets]
    return configs


def _fraction(pre: Any, name: str, budget: float) -> float:
    return 1.0 if name == "full" else budget if name == "tokenselect" else _kept_fraction(pre, name, budget)


def ppl_kvshelf(model: Any, ids: list[int], tokens: int, budgets: tuple[float, ...], tally: Tally,
                only: Sequence[str] | None) -> None:
    from kvshelf.bench.pruning import Prefilled, _methods, attending

    statics = _static_methods(only)
    start = len(ids) - PPL_TAIL
    t0 = time.perf_counter()
    pre = Prefilled(model, ids[:start], _methods(budgets, statics) if statics else {})
    ttft = time.perf_counter() - t0
    full_ttft = _full_prefill_s(model, ids[:start])
    configs = _configs(statics, budgets, only)
    for name, budget in configs:
        with attending(model, name, budget):
            nll, top1, per_token = _scored_chunk(model, pre.cache_for(name, budget), ids, start, pre.logits)
        fraction = _fraction(pre, name, budget)
        tally.add(("kvshelf", name, budget, "ppl", tokens), score=top1, kv_fraction=fraction, resident=1.0,
                  ttft=full_ttft if name == "full" else ttft, tpot=per_token, nll=nll)


# -- kvpress (bench pruning's worker, in its own virtualenv) ----------------------------------------------------


def run_kvpress(worker: Any, tokenizer: Any, sample: ruler.Sample, tally: Tally) -> None:
    for k, r in worker.call("case", ids=sample.ids, new_tokens=sample.new_tokens).items():
        name, budget = k.split("@")
        tally.add(("kvpress", name, float(budget), sample.task, sample.tokens),
                  score=ruler.score(tokenizer.decode(r["out"]), sample.answers),
                  kv_fraction=float(r["kept"]) / len(sample.ids), resident=1.0, ttft=float(r["ttft"]),
                  tpot=float(r["secs"]) / max(1, sample.new_tokens - 1))


def ppl_kvpress(worker: Any, ids: list[int], tokens: int, tally: Tally) -> None:
    start = len(ids) - PPL_TAIL
    for k, r in worker.call("window_top1", ids=ids, prefill=start).items():
        name, budget = k.split("@")
        tally.add(("kvpress", name, float(budget), "ppl", tokens), score=float(r["top1"]),
                  kv_fraction=float(r["kept"]) / start, resident=1.0, ttft=float(r["ttft"]),
                  tpot=float(r["secs"]) / (PPL_TAIL - 1), nll=float(r["nll"]))


# -- fastkv (adapters.pruning.fastkv, when present) --------------------------------------------------------------


def fastkv_class() -> type | None:
    try:
        from kvshelf.adapters.pruning.fastkv import FastKV
    except ImportError:
        return None
    return FastKV


class _KvWatch:
    """The peak number of context KV tokens held over all layers while a prefill runs (read at every attention
    layer's exit, where the layer's keys and values have just been written), and the time of the first token."""

    def __init__(self, model: Any, context: int) -> None:
        self.model, self.context, self.peak, self.first_at = model, context, 0, 0.0
        self.layers = len(model.model.layers)

    @contextmanager
    def watching(self) -> Iterator[_KvWatch]:
        def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            cache = kwargs.get("past_key_values")
            if cache is None or self.first_at:  # the prefill only
                return
            held = sum(min(self.context, cache.get_seq_length(i)) for i in range(len(cache.layers)))
            self.peak = max(self.peak, held)

        handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in self.model.model.layers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


class _FirstToken:
    """A ``generate`` streamer that notes when the prompt went in and when each new token came out."""

    def __init__(self, watch: _KvWatch) -> None:
        self.watch, self.times = watch, []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == 2:
            self.watch.first_at = self.times[-1]

    def end(self) -> None:
        pass


def _cache_context_tokens(cache: Any, context: int, new: int) -> float:
    """Mean context tokens per layer a cache holds after ``new`` generated tokens."""
    lengths = [cache.get_seq_length(i) - new for i in range(len(cache.layers))]
    return statistics.fmean(min(context, max(0, n)) for n in lengths)


def run_fastkv(model: Any, tokenizer: Any, sample: ruler.Sample, budgets: tuple[float, ...], tally: Tally,
               cls: type) -> None:
    """FastKV at each budget: ``with FastKV(ratio=budget)(model): model.generate(...)`` (its default TSP layer,
    two thirds of the depth; every layer keeps the propagated tokens)."""
    layers = len(model.model.layers)
    for budget in budgets:
        watch = _KvWatch(model, len(sample.ids))
        streamer = _FirstToken(watch)
        with watch.watching(), cls(ratio=budget)(model), torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(torch.tensor([sample.ids]), max_new_tokens=sample.new_tokens, do_sample=False,
                                 return_dict_in_generate=True, streamer=streamer, eos_token_id=None)
            end = time.perf_counter()
        new = out.sequences[0, len(sample.ids):].tolist()
        held = _cache_context_tokens(out.past_key_values, len(sample.ids), len(new) - 1)
        first = streamer.times[1] if len(streamer.times) > 1 else end
        tally.add(("kvshelf", "fastkv", budget, sample.task, sample.tokens),
                  score=ruler.score(tokenizer.decode(new), sample.answers), kv_fraction=held / len(sample.ids),
                  resident=watch.peak / (layers * len(sample.ids)), ttft=first - t0,
                  tpot=(end - first) / max(1, len(new) - 1))


# -- tier-sparse (adapters.longctx, when present) ----------------------------------------------------------------


def tier_sparse_class() -> type | None:
    try:
        from kvshelf.adapters.longctx import TierSparse
    except ImportError:
        return None
    return TierSparse


BLOCK_TOKENS = 64
SINK_TOKENS = 16
WINDOW_TOKENS = 64


def tier_sparse_method(cls: type, budget: float, context: int) -> Any:
    """TierSparse attending to ``budget`` of a ``context``-token context: sinks, a recent window and the top blocks
    filling the rest, blocks stored in float16 (resident and hot bytes: its defaults)."""
    top = max(1, round((budget * context - SINK_TOKENS - WINDOW_TOKENS) / BLOCK_TOKENS))
    return cls(block_tokens=BLOCK_TOKENS, top_blocks=top, sinks=SINK_TOKENS, window=WINDOW_TOKENS,
               store_dtype=torch.float16)


@contextmanager
def _tmp_store() -> Iterator[Any]:
    from kvshelf.kvstore.embedded import open_embedded_store

    with tempfile.TemporaryDirectory(prefix="kvshelf-longctx-") as tmp:
        store = open_embedded_store(Path(tmp) / "store", memory_bytes=None, durable=False)
        try:
            yield store
        finally:
            store.close()


def run_tier_sparse(model: Any, tokenizer: Any, sample: ruler.Sample, budgets: tuple[float, ...], tally: Tally,
                    cls: type) -> None:
    """One prefill of the context (the largest budget's session), then the question at each budget: the session is
    marked after the prefill and rewound before each budget's question (``SparseSession.mark`` / ``rewind``), its
    ``top_blocks`` set to the budget's. TTFT counts the shared prefill in each row: what a fresh answer costs."""
    context, question = sample.ids[:sample.context_tokens], sample.ids[sample.context_tokens:]
    ordered = sorted(budgets, reverse=True)
    widest = tier_sparse_method(cls, ordered[0], len(context))
    with _tmp_store() as store, widest.session(model, store) as s:
        s.prefill(context)
        s.mark()
        for budget in ordered:
            s.rewind()
            s.top_blocks = tier_sparse_method(cls, budget, len(context)).top_blocks
            tokens = s.generate(question, max_new_tokens=sample.new_tokens)
            stats = s.stats
            tally.add(("kvshelf", "tier-sparse", budget, sample.task, sample.tokens),
                      score=ruler.score(tokenizer.decode(tokens), sample.answers),
                      kv_fraction=float(stats.kv_fraction), resident=stats.resident_peak_bytes / stats.full_kv_bytes,
                      ttft=float(stats.prefill_s + stats.ttft_s), tpot=float(stats.tpot_s))


def ppl_tier_sparse(model: Any, ids: list[int], tokens: int, budgets: tuple[float, ...], tally: Tally,
                    cls: type) -> None:
    """Per-token NLLs of the last ``PPL_TAIL`` tokens at each budget after one prefill (as ``run_tier_sparse``);
    the top-1 accuracy from the session's ``stats.top1_hits``."""
    start = len(ids) - PPL_TAIL
    ordered = sorted(budgets, reverse=True)
    with _tmp_store() as store, tier_sparse_method(cls, ordered[0], start).session(model, store) as s:
        s.prefill(ids[:start])
        s.mark()
        for budget in ordered:
            s.rewind()
            s.top_blocks = tier_sparse_method(cls, budget, start).top_blocks
            t0 = time.perf_counter()
            nlls = s.nll(ids[start:])
            per_token = (time.perf_counter() - t0) / PPL_TAIL
            stats = s.stats
            tally.add(("kvshelf", "tier-sparse", budget, "ppl", tokens), score=stats.top1_hits / PPL_TAIL,
                      kv_fraction=float(stats.kv_fraction), resident=stats.resident_peak_bytes / stats.full_kv_bytes,
                      ttft=float(stats.prefill_s), tpot=per_token, nll=statistics.fmean(nlls))


# -- the run ---------------------------------------------------------------------------------------------------


def plan_of(tasks: Sequence[str] | None, lengths: Sequence[int] | None) -> list[tuple[str, int]]:
    """(task, tokens) pairs: ``DEFAULT_PLAN`` when neither is given, else every task (default: the RULER tasks) at
    every length (default: 4,096)."""
    if tasks is None and lengths is None:
        return list(DEFAULT_PLAN)
    return [(t, n) for n in (lengths or (4096,)) for t in (tasks or ruler.TASKS)]


def check_plan(plan: Sequence[tuple[str, int]], budgets: Sequence[float], samples: int,
               only: Sequence[str] | None) -> None:
    """Raise ``ruler.TaskError`` (a ``ValueError``) on anything the run could not do, before any work."""
    unknown = sorted({t for t, _ in plan} - set(TASKS))
    if unknown:
        raise ruler.TaskError(f"unknown tasks {unknown}; known: {', '.join(TASKS)}")
    for task, tokens in plan:
        if tokens < 256 or tokens > 8192:
            raise ruler.TaskError(f"{task} at {tokens} tokens: lengths go from 256 to 8,192 (SmolLM2's window)")
        if task == "ppl" and tokens < 2 * PPL_TAIL:
            raise ruler.TaskError(f"ppl needs at least {2 * PPL_TAIL} tokens (the last {PPL_TAIL} are scored)")
    if not budgets or any(not 0 < b < 1 for b in budgets):
        raise ruler.TaskError(f"budgets must be fractions in (0, 1): {list(budgets)}")
    if samples < 1:
        raise ruler.TaskError("samples must be at least 1")
    if only is not None:
        bad = sorted(set(only) - set(methods_known()))
        if bad:
            raise ruler.TaskError(f"unknown methods {bad}; known: {', '.join(methods_known())}")


def run(
    *,
    json_path: str | None,
    corpus: str | None,
    tasks: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    methods: Sequence[str] | None = None,
    budgets: tuple[float, ...] = BUDGETS,
    samples: int = DEFAULT_SAMPLES,
    new_tokens: int | None = None,
    kvpress: bool = True,
    kvpress_venv: str | None = None,
    model_name: str = "smollm2-135m",
    command: str | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    from kvshelf.adapters.model import convert_bundled, load_model
    from kvshelf.bench.pruning import kvpress_worker, ppl_windows

    console = console or Console()
    plan = plan_of(tasks, lengths)
    check_plan(plan, budgets, samples, methods)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    model, tokenizer = load_model(model_name)
    docs = ruler.corpus_documents(corpus)
    fastkv = fastkv_class() if methods is None or "fastkv" in methods else None
    tier = tier_sparse_class() if methods is None or "tier-sparse" in methods else None
    notes = []
    if (methods is None or "fastkv" in methods) and fastkv is None:
        notes.append("fastkv not available (kvshelf.adapters.pruning.fastkv does not import): not run")
    if (methods is None or "tier-sparse" in methods) and tier is None:
        notes.append("tier-sparse not available (kvshelf.adapters.longctx does not import): not run")
    for note in notes:
        console.print(f"[yellow]{note}[/yellow]")
    windows: dict[int, list[list[int]]] = {}
    for task, tokens in plan:
        if task == "ppl" and tokens not in windows:
            windows[tokens] = ppl_windows(tokenizer, list(corpus_texts(corpus)), samples, tokens)
            if len(windows[tokens]) < samples:
                notes.append(f"ppl at {tokens}: the corpus holds {len(windows[tokens])} windows, not {samples}")
    tally = Tally()
    kvpress_note = "kvpress not run"

    def payload(status: str) -> dict[str, Any]:
        return {"model": model_name, "machine": machine_description(), "status": status, "command": command,
                "corpus": corpus or "synthetic (no corpus found)", "plan": [list(p) for p in plan],
                "budgets": list(budgets), "samples": samples, "ppl_scored_tokens": PPL_TAIL, "pass_threshold": PASS,
                "kvpress": kvpress_note, "notes": notes, "runtime_s": round(time.perf_counter() - started, 1),
                "results": tally.results()}

    venv = Path(kvpress_venv) if kvpress_venv else None
    steps = sum(len(windows[t]) if task == "ppl" else samples for task, t in plan)
    with kvpress_worker(console, kvpress, str(convert_bundled(model_name)), budgets, threads, venv) as (worker, note):
        kvpress_note = note
        if kvpress and worker is None:
            console.print(f"[yellow]{note}; the run goes on without it[/yellow]")
        bar = tqdm(total=steps, desc="longctx", unit="sample")
        for task, tokens in plan:
            if task == "ppl":
                for ids in windows[tokens]:
                    bar.set_postfix_str(f"ppl@{tokens}")
                    ppl_kvshelf(model, ids, tokens, budgets, tally, methods)
                    if worker:
                        ppl_kvpress(worker, ids, tokens, tally)
                    if tier:
                        ppl_tier_sparse(model, ids, tokens, budgets, tally, tier)
                    bar.update()
                    save_results(json_path, payload(f"partial: {bar.n}/{steps} samples"), _quiet)
                continue
            for sample in ruler.samples(task, tokenizer, docs, tokens, samples, new_tokens=new_tokens):
                bar.set_postfix_str(f"{task}@{tokens}")
                run_kvshelf(model, tokenizer, sample, budgets, tally, methods)
                if worker:
                    run_kvpress(worker, tokenizer, sample, tally)
                if fastkv:
                    run_fastkv(model, tokenizer, sample, budgets, tally, fastkv)
                if tier:
                    run_tier_sparse(model, tokenizer, sample, budgets, tally, tier)
                bar.update()
                save_results(json_path, payload(f"partial: {bar.n}/{steps} samples"), _quiet)
        bar.close()
    final = payload("complete")
    for table in results_tables(final):
        console.print(table)
    save_results(json_path, final, console)
    return final


class _Quiet:
    def print(self, *args: Any, **kwargs: Any) -> None:
        pass


_quiet = _Quiet()


# -- tables ------------------------------------------------------------------------------------------------------


def _label(row: dict[str, Any]) -> str:
    return "full" if row["method"] == "full" else f"{row['method']}@{row['budget']:g}"


def passed(payload: dict[str, Any]) -> list[tuple[str, int]]:
    """The (task, tokens) where full attention's accuracy is at least ``PASS`` (perplexity excluded)."""
    return [(r["task"], r["tokens"]) for r in payload["results"]
            if r["method"] == "full" and r["task"] != "ppl" and r["accuracy"] is not None and r["accuracy"] >= PASS]


def averages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (impl, method, budget): mean accuracy over the tasks full attention passes, mean kv and resident
    fractions over them (rows that ran on every such task only)."""
    ok = set(passed(payload))
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in payload["results"]:
        if (r["task"], r["tokens"]) in ok:
            groups.setdefault((r["impl"], r["method"], r["budget"]), []).append(r)
    out = []
    for (impl, method, budget), rows in groups.items():
        if len(rows) != len(ok):
            continue
        out.append({"impl": impl, "method": method, "budget": budget, "tasks": len(rows),
                    "accuracy": statistics.fmean(r["accuracy"] for r in rows),
                    "kv_fraction": statistics.fmean(r["kv_fraction"] for r in rows),
                    "resident_fraction": statistics.fmean(r["resident_fraction"] for r in rows)})
    return sorted(out, key=lambda a: (a["method"] != "full", -a["budget"], a["impl"], a["method"]))


def results_tables(payload: dict[str, Any]) -> list[Table]:
    """Accuracy by method x task/length (with kv and resident fractions), the averages over the tasks full
    attention passes, and kvshelf's best against each kvpress press at equal budget."""
    results = payload["results"]
    cells = sorted({(r["task"], r["tokens"]) for r in results}, key=lambda c: (c[1], TASKS.index(c[0])))
    ok = set(passed(payload))
    main = Table(title=f"Long context (RULER-style), {payload['model']}, samples per task and length: "
                       f"{payload['samples']} ({payload['machine']})",
                 caption=f"{payload['kvpress']}; status: {payload.get('status', '-')}")
    for column in ("method", "impl", "kv frac", "resident"):
        main.add_column(column, justify="right")
    for task, tokens in cells:
        mark = "" if task == "ppl" or (task, tokens) in ok else " ✗"
        main.add_column(f"{task}@{tokens // 1024}K{mark}", justify="right")
    rows: dict[tuple[str, str], dict[tuple[str, int], dict[str, Any]]] = {}
    for r in results:
        rows.setdefault((_label(r), r["impl"]), {})[(r["task"], r["tokens"])] = r
    order = sorted(rows, key=lambda k: (k[0] != "full", -next(iter(rows[k].values()))["budget"], k[1], k[0]))
    for label, impl in order:
        got = rows[(label, impl)]
        kv = statistics.fmean(r["kv_fraction"] for r in got.values())
        resident = statistics.fmean(r["resident_fraction"] for r in got.values())
        values = []
        for cell in cells:
            r = got.get(cell)
            if r is None:
                values.append("-")
            elif cell[0] == "ppl":
                acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
                values.append(f"{acc} (Δppl {r['dppl_rel']:+.3f})" if r["dppl_rel"] is not None else acc)
            else:
                values.append("-" if r["accuracy"] is None else f"{r['accuracy']:.2f}")
        main.add_row(label, impl, f"{kv:.3f}", f"{resident:.3f}", *values)
    tables = [main]
    avg = averages(payload)
    summary = Table(title=f"Average accuracy over the {len(ok)} task/length pairs full attention passes "
                          f"(>= {PASS}); ✗ above: failed by full attention")
    for column in ("method", "impl", "budget", "kv frac", "resident", "accuracy"):
        summary.add_column(column, justify="right")
    for a in avg:
        summary.add_row(a["method"], a["impl"], f"{a['budget']:g}", f"{a['kv_fraction']:.3f}",
                        f"{a['resident_fraction']:.3f}", f"{a['accuracy']:.3f}")
    tables.append(summary)
    theirs = [a for a in avg if a["impl"] == "kvpress"]
    if theirs:
        versus = Table(title="kvshelf's best method against each kvpress press at the same budget "
                             "(average over the tasks full attention passes)")
        for column in ("budget", "kvpress press", "kvpress acc", "kvshelf best", "kvshelf acc", "Δ"):
            versus.add_column(column, justify="right")
        for a in theirs:
            ours = [o for o in avg if o["impl"] == "kvshelf" and o["budget"] == a["budget"] and o["method"] != "full"]
            if not ours:
                continue
            best = max(ours, key=lambda o: o["accuracy"])
            versus.add_row(f"{a['budget']:g}", a["method"], f"{a['accuracy']:.3f}", best["method"],
                           f"{best['accuracy']:.3f}", f"{best['accuracy'] - a['accuracy']:+.3f}")
        tables.append(versus)
    return tables


if __name__ == "__main__":
    raise SystemExit("run this benchmark with `kvshelf bench longctx`")
