"""Hybrid models (attention + recurrent-state layers) on prefix reuse: KV blocks plus state snapshots at block
boundaries (``adapters.hybrid``), exact against plain ``model.generate`` (same greedy tokens, fp32 logits within
1e-4) on block-aligned reuse, ``cacheable_prefix``, chat turns, batches and HF export; evicted, damaged, foreign
and mismatched snapshots are counted misses (fall back to a shallower boundary, or prefill), never wrong output;
paths that cannot be exact on state layers refuse, naming the layer type."""

from __future__ import annotations

import pytest
import torch
from hybrid_families import EXACT_HYBRIDS, hybrid_model

from kvshelf.adapters import hf
from kvshelf.adapters import states as st
from kvshelf.adapters.cache_bridge import check_supported
from kvshelf.adapters.export import cached_prefix
from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.reuse_engine import check_engine
from kvshelf.kvstore import MemoryTier, TieredStore
from kvshelf.kvstore.encoding import encode_block
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError
from kvshelf.kvstore.keys import prefix_block_spans, state_key
from kvshelf.kvstore.snapshot import StateEntry, StateSnapshot, pack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
NEW = 4
_MODELS: dict[str, torch.nn.Module] = {}


def _model(name: str) -> torch.nn.Module:
    if name not in _MODELS:
        _MODELS[name] = hybrid_model(name)
    return _MODELS[name]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


IDS = _tokens(120, seed=1)


def _plain(model, ids: list[int]) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), out.logits


def _check(model, result, ids: list[int]) -> None:
    tokens, logits = _plain(model, ids)
    assert result.new_ids == tokens
    assert max(float((a - b).abs().max()) for a, b in zip(result.logits, logits, strict=True)) <= 1e-4


def _gen(model, store=None, **kw) -> CachedGenerator:
    store = store if store is not None else TieredStore([MemoryTier(64 << 20)])
    kw.setdefault("snapshot_every", 2)
    return CachedGenerator(model, None, store, block_size=BLOCK, write_behind=False, **kw)


@pytest.mark.parametrize("family", EXACT_HYBRIDS)
def test_block_aligned_prefix_reuse_is_exact(family: str) -> None:
    model = _model(family)
    gen = _gen(model)
    reused = []
    for n in (70, 100, 120):  # boundaries every 2 blocks: 32, 64, 96
        result = gen.generate(IDS[:n], max_new_tokens=NEW, output_logits=True)
        _check(model, result, IDS[:n])
        reused.append(result.reused_tokens)
    assert reused == [0, 64, 96]
    assert gen.snapshot_stats["hits"] == 2 and gen.snapshot_stats["rejected"] == 0


@pytest.mark.parametrize("family", EXACT_HYBRIDS)
def test_cacheable_prefix_and_chat_turns_are_exact(family: str) -> None:
    model = _model(family)
    gen = _gen(model, snapshot_every=0)  # only at the end of cacheable_prefix and of a turn
    context, qa, qb = IDS[:85], _tokens(7, seed=2), _tokens(9, seed=3)
    first = gen.generate(context + qa, max_new_tokens=NEW, cacheable_prefix=85, output_logits=True)
    assert first.reused_tokens == 0
    second = gen.generate(context + qb, max_new_tokens=NEW, cacheable_prefix=85, output_logits=True)
    assert second.reused_tokens == 85
    _check(model, second, context + qb)
    # a chat: the turn's end (prompt + answer but its last token) gets a snapshot
    turn = gen.generate(IDS[:50], max_new_tokens=NEW, store_generated=True)
    seq = IDS[:50] + turn.new_ids[:-1]
    nxt = seq + turn.new_ids[-1:] + _tokens(11, seed=4)
    result = gen.generate(nxt, max_new_tokens=NEW, cacheable_prefix=len(seq), output_logits=True)
    assert result.reused_tokens == len(seq)
    _check(model, result, nxt)


def test_batch_and_export_are_exact() -> None:
    model = _model("qwen3_next")
    gen = _gen(model)
    gen.generate(IDS[:100], max_new_tokens=1)
    prompts = [IDS[:90], IDS[:110], _tokens(40, seed=9)]
    results = gen.generate(prompts, max_new_tokens=NEW, output_logits=True)
    assert [r.reused_tokens for r in results] == [64, 96, 0]
    for result, ids in zip(results, prompts, strict=True):
        _check(model, result, ids)
    prefix = cached_prefix(model, gen.store, IDS[:115], block_size=BLOCK)
    assert prefix.reused_tokens == 96
    with torch.inference_mode():
        out = model.generate(**prefix.generate_inputs(), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens, logits = _plain(model, IDS[:115])
    assert out.sequences[0, 115:].tolist() == tokens
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, logits, strict=True)) <= 1e-4
    rows = cached_prefix(model, gen.store, IDS[:115], block_size=BLOCK, batch_size=3)  # states repeated too
    with torch.inference_mode():
        out = model.generate(**rows.generate_inputs(), max_new_tokens=NEW, do_sample=False)
    assert out[:, 115:].tolist() == [tokens] * 3


def _state_keys(model, n: int) -> list[bytes]:
    spans = prefix_block_spans(model_fingerprint(model), "default", IDS[:n], BLOCK)
    return [state_key(s.key) for s in spans]


def test_evicted_snapshot_falls_back_then_prefills() -> None:
    model = _model("qwen3_next")
    store = TieredStore([MemoryTier(64 << 20)])
    gen = _gen(model, store)
    gen.generate(IDS[:100], max_new_tokens=1)  # blocks 1-6, snapshots at 32, 64 and 96
    keys = _state_keys(model, 100)
    for evicted, reused in ((5, 64), (3, 32), (1, 0)):  # the deepest boundary's snapshot goes: its blocks stay
        store.delete([keys[evicted]])
        before = gen.snapshot_stats["fallbacks"]
        result = gen.generate(IDS[:110], max_new_tokens=NEW, output_logits=True, store=False)
        assert result.reused_tokens == reused  # 0: blocks present, no snapshot: never KV without its state
        assert gen.snapshot_stats["fallbacks"] == before + 1
        _check(model, result, IDS[:110])


def _records(model) -> dict[str, bytes]:
    """Values for the 96-token boundary's state key: ``good`` (the model's real state there), the rest must each
    be a counted miss."""
    fp = model_fingerprint(model)
    key = _state_keys(model, 100)[5]
    cache = hf.new_cache(model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([IDS[:96]]), past_key_values=cache, use_cache=True)
    real = st.capture(cache, 96)
    record = lambda snap, fingerprint=fp: encode_block(  # noqa: E731
        pack(snap, last_token=IDS[95], fingerprint=fingerprint, namespace="default"), key)
    good = record(real)
    shape = StateSnapshot(96, (StateEntry(0, "conv", 0, (1, 8), "float32"),), (torch.zeros(1, 8),))
    entries = tuple(StateEntry(e.layer, e.kind, e.index, e.shape, "float64") for e in real.entries)
    wide = StateSnapshot(96, entries, tuple(t.double() for t in real.tensors))
    early = StateSnapshot(95, real.entries, real.tensors)
    return {"good": good, "wrong shape": record(shape), "wrong dtype": record(wide), "wrong boundary": record(early),
            "foreign": record(real, "another-model"), "truncated": good[:-20],
            "corrupt": good[:200] + bytes([good[200] ^ 0xFF]) + good[201:]}


@pytest.mark.parametrize("bad", ["good", "wrong shape", "wrong dtype", "wrong boundary", "foreign", "truncated",
                                 "corrupt"])
def test_bad_snapshot_is_a_counted_miss(bad: str) -> None:
    model = _model("qwen3_next")
    tier = MemoryTier(64 << 20)
    store = TieredStore([tier])
    gen = _gen(model, store)
    gen.generate(IDS[:100], max_new_tokens=1)
    key = _state_keys(model, 100)[5]
    tier.put_many([(key, _records(model)[bad])])  # bypasses the store's checks, as a damaged disk would
    result = gen.generate(IDS[:110], max_new_tokens=NEW, output_logits=True, store=False)
    if bad == "good":
        assert result.reused_tokens == 96 and gen.snapshot_stats["rejected"] == 0
    else:
        assert result.reused_tokens == 64  # the next shallower boundary
        assert gen.snapshot_stats["rejected"] == 1 and gen.snapshot_stats["fallbacks"] == 1
    _check(model, result, IDS[:110])


def test_lossy_tier_codec_is_not_served() -> None:
    from kvshelf.kvstore.store import TierSpec

    model = _model("qwen3_next")
    store = TieredStore([TierSpec(MemoryTier(64 << 20), codec="int8")])
    gen = _gen(model, store)
    gen.generate(IDS[:70], max_new_tokens=1)
    result = gen.generate(IDS[:70], max_new_tokens=NEW, output_logits=True, store=False)
    assert result.reused_tokens == 0 and gen.snapshot_stats["rejected"] >= 1
    _check(model, result, IDS[:70])


def test_settings_and_refusals() -> None:
    model = _model("qwen3_next")
    with pytest.raises(ConfigError):
        _gen(model, snapshot_every=-1)
    with pytest.raises(ConfigError):
        _gen(model, snapshot_codec="int8")
    for feature in ("RAG chunk reuse", "block attention", "prompt modules"):
        with pytest.raises(UnsupportedModelError, match="linear_attention"):
            check_supported(model.config, feature, sliding_window=True)
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        check_engine(model, "RAG chunk reuse")
    with pytest.raises(UnsupportedModelError, match="bamba"):
        CachedGenerator(hybrid_model("bamba"), None, None)


@pytest.mark.parametrize("family", EXACT_HYBRIDS)
def test_engine_paths_refuse_naming_the_layer_type(family: str) -> None:
    """RAG chunks, block attention, prompt modules (the layer-by-layer engine) refuse a hybrid model before any
    work, naming its state layer type."""
    from kvshelf.adapters.rag import RAGGenerator

    model = _model(family)
    with pytest.raises(UnsupportedModelError, match=st.state_layer_types(model.config)[0]):
        RAGGenerator(model, None, TieredStore([MemoryTier(1 << 20)]))


#: hybrids whose attention modules pruning hooks (the state layers are left alone); the others refuse
PRUNED = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "granitemoehybrid", "lfm2", "lfm2_moe", "lfm3",
          "jamba")


@pytest.mark.parametrize("family", EXACT_HYBRIDS)
def test_pruning_acts_on_attention_layers_only(family: str) -> None:
    """Pruning and selection on a hybrid: budget 1.0 equals plain ``generate`` and budget 0.5 prunes the
    full-attention layers only, their state layers untouched; or the method refuses before any work, naming the
    state layer type (attention modules kvshelf cannot hook or map: Nemotron-H, Zamba, Kimi...)."""
    from kvshelf.adapters.pruning import METHODS, PruningMethod, resolve_budget

    model = hybrid_model(family)
    model.set_attn_implementation("eager")
    ids = IDS[:80]
    tokens, logits = _plain(model, ids)
    for name, cls in METHODS.items():
        entered = []
        try:
            with torch.inference_mode(), cls(budget=1.0)(model):
                entered.append(True)
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        except UnsupportedModelError as exc:
            assert not entered and (family not in PRUNED or name == "snapkv"), f"{family}/{name}: {exc}"
            assert family in PRUNED or any(t in str(exc) for t in st.state_layer_types(model.config)), str(exc)
            continue
        assert family in PRUNED, f"{family}/{name} ran"
        assert out.sequences[0, len(ids):].tolist() == tokens
        assert max(float((a - b).abs().max()) for a, b in zip(out.logits, logits, strict=True)) <= 1e-4
        if not issubclass(cls, PruningMethod):
            continue
        with torch.inference_mode(), cls(budget=0.5)(model) as session:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                 return_dict_in_generate=True)
        layers = hf.cache_layers(out.past_key_values)
        assert set(session.kept) == {i for i, t in enumerate(hf.attention_layer_types(model.config))
                                     if t == hf.FULL_ATTENTION}
        for index in session.kept:
            assert layers[index].get_seq_length() == resolve_budget(0.5, len(ids)) + NEW - 1
        assert not set(session.kept) & {i for i, _ in hf.state_layers(out.past_key_values)}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "nemotron_h",
                                    "granitemoehybrid", "lfm2", "lfm2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_sizes_match_the_tiny_models(family: str, dtype: torch.dtype) -> None:
    """``states.state_sizes`` (from the config alone) equals the bytes a real snapshot and block hold."""
    model = hybrid_model(family, dtype=dtype)
    sizes = st.state_sizes(model.config, block_size=BLOCK, dtype=dtype)
    cache = hf.new_cache(model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([IDS[:BLOCK]]), past_key_values=cache, use_cache=True)
    assert st.capture(cache, BLOCK).nbytes == sizes.snapshot_bytes
    assert sum(k.numel() * k.element_size() * 2 for k, _ in hf.cache_tensors(cache)) == sizes.kv_bytes_per_block


def nemotron_h_8b_shaped():
    """Nemotron-H-8B's shape (52 layers: 24 Mamba2, 4 attention, 24 MLP; Mamba2 128 heads of 64, state 128, 8
    groups, conv 4; attention 32 heads, 8 KV heads of 128): the published counts, the layer order approximate
    (sizes depend only on the counts)."""
    import transformers as tf

    return tf.NemotronHConfig(vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=52,
                              hybrid_override_pattern="M-M-M-M*-" * 4 + "M-" * 8, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
                              ssm_state_size=128, n_groups=8, conv_kernel=4)


def test_sizing_of_published_shapes() -> None:
    """The snapshot sizing of docs/families.md (bf16 models, 256-token blocks), from configs alone."""
    from kvshelf.adapters.shaped import shaped_config

    sizes = {name: st.state_sizes(config, block_size=256, dtype=torch.bfloat16) for name, config in (
        ("qwen3-next-80b", shaped_config("qwen3-next-80b-shaped")),
        ("qwen3.5-0.8b", shaped_config("qwen3.5-0.8b-shaped")),
        ("nemotron-h-8b", nemotron_h_8b_shaped()))}
    got = {name: (s.state_layers, s.attention_layers, s.snapshot_bytes, s.kv_bytes_per_block)
           for name, s in sizes.items()}
    assert got == {"qwen3-next-80b": (36, 12, 77856768, 6291456), "qwen3.5-0.8b": (18, 6, 19759104, 3145728),
                   "nemotron-h-8b": (24, 4, 102629376, 4194304)}


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "lfm2", "falcon_h1"])
def test_bf16_reuse_gives_the_same_tokens(family: str) -> None:
    """bf16 models: the snapshot holds a bf16 conv state beside a float32 recurrent state, both restored in their
    own dtype; greedy tokens equal plain ``generate``'s."""
    model = hybrid_model(family, dtype=torch.bfloat16)
    gen = _gen(model)
    for n in (70, 100):
        result = gen.generate(IDS[:n], max_new_tokens=NEW)
        assert result.new_ids == _plain(model, IDS[:n])[0]
    assert result.reused_tokens == 64 and gen.snapshot_stats["rejected"] == 0


class _ChatTokenizer:
    """``w<id>`` words are token ids; the template is ``<role> content <end>`` per message (markup 500-503)."""

    pad_token_id = 0
    markup = {"<system>": 500, "<user>": 501, "<assistant>": 502, "<end>": 503}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [self.markup[w] if w in self.markup else int(w[1:]) for w in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return " ".join(f"w{i}" for i in ids)

    def apply_chat_template(self, messages, *, tokenize: bool = False, add_generation_prompt: bool = False,  # noqa: ANN001
                            **kwargs) -> str:  # noqa: ANN003
        text = " ".join(f"<{m['role']}> {m['content']} <end>" for m in messages)
        return text + " <assistant>" if add_generation_prompt else text


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "zamba2"])
def test_conversation_turns_reuse_the_turn_end_snapshot(family: str) -> None:
    """``Conversation``: every turn after the first reloads the previous turn's end (its snapshot) and prefills
    only the new message; each answer equals plain ``generate`` over the turn's template ids."""
    from kvshelf.adapters.chat import Conversation

    model = _model(family)
    gen = CachedGenerator(model, _ChatTokenizer(), TieredStore([MemoryTier(64 << 20)]), block_size=BLOCK,
                          snapshot_every=2)
    chat = Conversation(gen, system=" ".join(f"w{t}" for t in _tokens(20, seed=5)))
    stored: list[int] = []
    for n in range(3):
        turn = chat.send(" ".join(f"w{t}" for t in _tokens(9 + n, seed=6 + n)), max_new_tokens=NEW,
                         eos_token_id=None, output_logits=True)
        _check(model, turn.result, turn.result.prompt_ids)
        assert turn.reused_tokens == len(stored)
        stored = turn.result.prompt_ids + turn.new_ids[:-1]
    assert gen.snapshot_stats["rejected"] == 0 and gen.snapshot_stats["hits"] == 2


def test_a_full_store_loses_snapshots_not_answers() -> None:
    """A memory tier too small for a snapshot: the call still answers exactly; the snapshots are counted as failed
    and the next call prefills."""
    model = _model("qwen3_next")
    gen = _gen(model, TieredStore([MemoryTier(3000)]))
    for n in (70, 100):
        result = gen.generate(IDS[:n], max_new_tokens=NEW, output_logits=True)
        _check(model, result, IDS[:n])
        assert result.reused_tokens == 0
    assert gen.snapshot_stats["stored"] == 0 and gen.snapshot_stats["failed"] == gen.snapshot_stats["taken"] > 0


def test_a_failing_snapshot_write_keeps_the_answer() -> None:
    from kvshelf.kvstore.errors import StoreFullError

    class Refusing(TieredStore):
        def put_encoded_many(self, items, *, pin=False):  # noqa: ANN001, ANN202
            raise StoreFullError("no room")

    model = _model("qwen3_next")
    gen = _gen(model, Refusing([MemoryTier(64 << 20)]))
    result = gen.generate(IDS[:70], max_new_tokens=NEW, output_logits=True)
    _check(model, result, IDS[:70])
    assert gen.snapshot_stats["failed"] == 2 and "no room" in gen.snapshot_last_error


def test_threads_share_a_hybrid_generator() -> None:
    """Calls from several threads on one generator (write-behind on): each answer exact."""
    from concurrent.futures import ThreadPoolExecutor

    model = _model("qwen3_next")
    with CachedGenerator(model, None, TieredStore([MemoryTier(64 << 20)]), block_size=BLOCK,
                         snapshot_every=1) as gen:
        prompts = [IDS[:n] for n in (50, 70, 90, 110, 70, 110)]
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda ids: gen.generate(ids, max_new_tokens=NEW, output_logits=True), prompts))
    for result, ids in zip(results, prompts, strict=True):
        _check(model, result, ids)
    assert gen.snapshot_stats["rejected"] == 0
