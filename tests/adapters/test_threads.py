"""Thread safety of kvshelf's model paths (tiny Llama, fast): several threads generating through one model and
one store (prefix reuse, every RAG mode, prompt modules, pruning methods, TokenSelect, plain ``generate``) give
the same outputs as the same calls run one after another, and a kvshelf call never changes what another thread's
call of the same model runs with (no process-global switch of the attention implementation, no foreign hooks).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from families import CONFIGS, attn_implementations, family_model
from helpers import SCHEMA_MARKUP, WordTokenizer, run_workers, token_ids

from kvshelf.adapters import hf
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.adapters.prompt_modules import PromptModuleGenerator
from kvshelf.adapters.pruning import H2O, SnapKV, StreamingLLM, TokenSelect, tokenselect
from kvshelf.adapters.rag import RAGGenerator
from kvshelf.adapters.reuse_engine import folded_attention
from kvshelf.kvstore import open_embedded_store
from kvshelf.reuse import ModuleUse, PromptSchema

THREADS = 4
NEW = 6  # new tokens per call
WAIT_S = 60  # how long a thread waits for another's signal before the test fails (a hang, not a timing check)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=4)


def _plain(model, ids: list[int], new: int = NEW) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _pruned(model, method: Any, ids: list[int], *, eager: bool = False) -> list[int]:
    """``model.generate`` under ``method``; ``eager``: the method reads attention weights, so this call (only)
    runs with eager attention."""
    with hf.attention_implementation(model, "eager") if eager else _nothing(), method(model):
        return _plain(model, ids)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _calls(model, tmp_path) -> dict[str, Callable[[], Any]]:
    """Named calls through one model and one store, warmed up (their blocks stored) so a call's output does not
    depend on which ran first."""
    store = open_embedded_store(tmp_path, memory_bytes="64MiB")
    doc, questions = token_ids(40, 21), [token_ids(6, 22), token_ids(9, 23)]
    cached = CachedGenerator(model, None, store, block_size=8, write_behind=False)
    cached.generate(doc + questions[0], max_new_tokens=1, eos_token_id=None, cacheable_prefix=len(doc))
    chunks, prefix, question = [token_ids(20, 2), token_ids(30, 3), token_ids(25, 4)], token_ids(5, 5), token_ids(7, 6)
    rag = RAGGenerator(model, None, store, prefix=prefix)
    for mode in ("reuse", "block-attention"):
        rag.generate(chunks, question, mode=mode, max_new_tokens=1, eos_token_id=None)
    modules = PromptModuleGenerator(model, WordTokenizer(), store, PromptSchema.from_markup(SCHEMA_MARKUP))
    modules.precompute()
    prompt = [ModuleUse("system"), ModuleUse("manual", {"product": "x y z"}), ModuleUse("faq"), "why is it so"]
    long_ids, other_ids = token_ids(60, 31), token_ids(48, 32)

    def prefix_reuse(question: list[int]) -> Callable[[], Any]:
        def call() -> Any:
            result = cached.generate(doc + question, max_new_tokens=NEW, eos_token_id=None, store=False)
            assert result.reused_tokens == len(doc)  # the cached document was reused
            return result.new_ids
        return call

    def rag_call(mode: str) -> Callable[[], Any]:
        def call() -> Any:
            result = rag.generate(chunks, question, mode=mode, max_new_tokens=NEW, eos_token_id=None)
            return result.new_ids, result.first_logits
        return call

    def module_call() -> Any:
        result = modules.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
        return result.new_ids, result.first_logits

    return {
        "prefix-a": prefix_reuse(questions[0]),
        "prefix-b": prefix_reuse(questions[1]),
        "rag-reuse": rag_call("reuse"),
        "rag-blend": rag_call("reuse-blend"),
        "rag-block": rag_call("block-attention"),
        "modules": module_call,
        "snapkv": lambda: _pruned(model, SnapKV(0.5, window=8), long_ids),
        "streaming": lambda: _pruned(model, StreamingLLM(0.4), other_ids),
        "h2o-eager": lambda: _pruned(model, H2O(0.5), long_ids, eager=True),
        "tokenselect": lambda: _pruned(model, TokenSelect(0.25, similarity=-1.0), long_ids),
        "plain": lambda: _plain(model, long_ids),
    }


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return torch.allclose(got, want, atol=1e-5, rtol=0)
    if isinstance(want, tuple):
        return all(_same(g, w) for g, w in zip(got, want, strict=True))
    return got == want


def test_threads_mixing_every_path_match_the_calls_run_one_after_another(model, tmp_path):
    calls = _calls(model, tmp_path)
    names = list(calls)
    want = {name: calls[name]() for name in names}  # the sequential reference
    # the calls differ from each other (each path does something of its own): the comparison below can fail
    assert want["snapkv"] != want["plain"] and want["h2o-eager"] != want["plain"]
    assert want["tokenselect"] != want["plain"]
    start = threading.Barrier(THREADS)
    got: dict[tuple[int, str], Any] = {}

    def worker(seed: int) -> None:
        order = names[seed * 3 % len(names):] + names[: seed * 3 % len(names)]  # each thread its own order
        start.wait(timeout=WAIT_S)
        for name in order:
            got[seed, name] = calls[name]()

    run_workers(worker, THREADS)
    assert len(got) == THREADS * len(names)
    wrong = sorted({name for (_, name), value in got.items() if not _same(value, want[name])})
    assert wrong == []
    assert hf.attn_implementation(model) == "sdpa" and model.config._attn_implementation == "sdpa"


@contextmanager
def _held_open(enter: Callable[[], Any]) -> Iterator[threading.Event]:
    """Run ``enter`` (a context manager factory) in a thread that stays inside the block until the yielded event
    is set; yields once the thread is inside."""
    inside, leave, errors = threading.Event(), threading.Event(), []

    def hold() -> None:
        try:
            with enter():
                inside.set()
                assert leave.wait(WAIT_S), "the test never let the block exit"
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            inside.set()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert inside.wait(WAIT_S)
        if errors:
            raise errors[0]
        yield leave
    finally:
        leave.set()
        thread.join(WAIT_S)
    if errors:
        raise errors[0]


@contextmanager
def _eager_h2o(model) -> Iterator[None]:
    with hf.attention_implementation(model, "eager"), H2O(0.25)(model):
        yield


BLOCKS: dict[str, Callable[[Any], Any]] = {
    "snapkv": lambda model: SnapKV(0.25, window=4)(model),
    "h2o-eager": lambda model: _eager_h2o(model),
    "tokenselect": lambda model: TokenSelect(0.125, similarity=-1.0)(model),
    "folded": lambda model: folded_attention(model),
}


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_plain_generate_beside_a_kvshelf_block_in_another_thread_is_plain(model, block):
    """Regression: another thread inside a pruning block, TokenSelect or a folded run neither prunes nor switches
    this thread's plain ``generate`` (it used to: hooks and ``config._attn_implementation`` were the model's)."""
    ids = token_ids(60, 41)
    want = _plain(model, ids, new=8)
    with _held_open(lambda: BLOCKS[block](model)):
        assert hf.attn_implementation(model) == "sdpa"  # what this thread's calls run with
        got = _plain(model, ids, new=8)
    assert got == want
    if block != "folded":  # the block really changes its own thread's output: this test could fail
        assert _pruned_in_block(model, block, ids) != want


def _pruned_in_block(model, block: str, ids: list[int]) -> list[int]:
    with BLOCKS[block](model):
        return _plain(model, ids, new=8)


def test_attention_implementation_seen_from_another_thread_never_changes(model, tmp_path):
    """Polled from another thread while kvshelf calls (each path that switches attention) run, the model's
    attention implementation stays sdpa; inside each call, its own thread sees its own."""
    calls = _calls(model, tmp_path)
    seen: set[str] = set()
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.0002):  # ~thousands of looks a second, without starving the calls of the GIL
            seen.add(hf.attn_implementation(model))

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for name in ("rag-reuse", "rag-blend", "rag-block", "modules", "h2o-eager", "tokenselect", "snapkv"):
            calls[name]()
        # at points where the switch is certainly on in the calling thread
        for block, own in (("h2o-eager", "eager"), ("tokenselect", "kvshelf_tokenselect"),
                           ("folded", "kvshelf_gqa_fold")):
            with BLOCKS[block](model):
                assert hf.attn_implementation(model) == own
                seen.add(_in_new_thread(lambda: hf.attn_implementation(model)))
    finally:
        stop.set()
        poller.join(WAIT_S)
    assert seen == {"sdpa"}


def _in_new_thread(function: Callable[[], Any], *, context: contextvars.Context | None = None) -> Any:
    out: list[Any] = []
    target = (lambda: out.append(context.run(function))) if context is not None else (lambda: out.append(function()))
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(WAIT_S)
    return out[0]


def test_a_worker_thread_in_a_copy_of_the_context_is_pruned_a_plain_one_is_not(model):
    ids = token_ids(60, 42)
    with SnapKV(0.25, window=4)(model):
        pruned = _plain(model, ids, new=8)
        in_copy = _in_new_thread(lambda: _plain(model, ids, new=8), context=contextvars.copy_context())
        bare = _in_new_thread(lambda: _plain(model, ids, new=8))
    assert in_copy == pruned != bare == _plain(model, ids, new=8)


def test_overlapping_blocks_of_two_threads_exit_in_any_order(model):
    """Two threads each in its own pruning block on one model: each prunes only its own calls, the first to enter
    exits first while the other's block still works, and nothing is left on the model afterwards."""
    ids = token_ids(60, 43)
    want = {"snapkv": _pruned_in_block(model, "snapkv", ids), "h2o-eager": _pruned_in_block(model, "h2o-eager", ids)}
    plain = _plain(model, ids, new=8)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    got: dict[str, list[list[int]]] = {"snapkv": [], "h2o-eager": []}

    def first(seed: int) -> None:
        with BLOCKS["snapkv"](model):
            first_in.set()
            assert second_in.wait(WAIT_S)
            got["snapkv"].append(_plain(model, ids, new=8))
        first_out.set()

    def second(seed: int) -> None:
        assert first_in.wait(WAIT_S)
        with BLOCKS["h2o-eager"](model):
            second_in.set()
            got["h2o-eager"].append(_plain(model, ids, new=8))
            assert first_out.wait(WAIT_S)
            got["h2o-eager"].append(_plain(model, ids, new=8))  # after the other block exited

    run_workers(lambda seed: (first if seed == 0 else second)(seed), 2)
    assert got == {"snapkv": [want["snapkv"]], "h2o-eager": [want["h2o-eager"]] * 2}
    assert want["snapkv"] != plain and want["h2o-eager"] != plain
    attention = model.model.layers[0].self_attn
    assert not attention._forward_hooks and not model._forward_pre_hooks  # every block removed its own hooks
    assert model.config._attn_implementation == "sdpa" and _plain(model, ids, new=8) == plain


FAMILY_CELLS = [(family, attn) for family in CONFIGS for attn in attn_implementations(family)]


@pytest.mark.parametrize(("family", "attn"), FAMILY_CELLS)
def test_every_family_runs_its_own_attention_while_another_thread_switches_it(family, attn):
    """While another thread holds the model under another attention implementation (the model's configs then name
    kvshelf's dispatch), a plain forward and ``generate`` of this thread give bitwise the logits of the model's own
    implementation: the dispatch runs the same attention and mask functions, in every family."""
    model = family_model(family, attn=attn)
    ids = torch.tensor([token_ids(30, 44)])  # longer than the windowed families' window (24)
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        want_new = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None)
    other = "eager" if attn == "sdpa" else "sdpa" if hf.supports_sdpa(model) else tokenselect.IMPLEMENTATION
    tokenselect.register()
    switched = lambda: hf.attention_implementation(model, other)  # noqa: E731
    with _held_open(switched), torch.inference_mode():
        dispatched = hf.can_switch_attention(model)
        assert model.config._attn_implementation == (hf.DISPATCH if dispatched else attn)
        assert hf.attn_implementation(model) == attn
        got = model(input_ids=ids).logits
        got_new = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert torch.equal(got, want) and torch.equal(got_new, want_new)
    assert model.config._attn_implementation == attn
