"""Architecture suite, prefix reuse (``CachedGenerator``): every family (``families.CONFIGS``) x
{no ``cacheable_prefix``, ``cacheable_prefix=len(context)``} x attention implementation in fp32, plus bf16 (sdpa,
or eager where the family has none), each cell through ``arch_rule.run_cell`` against plain ``model.generate``
(``arch_rule.plain_generate``), its outcome compared with ``expected_prefix.EXPECTED`` (the README table's source).

Prompts are longer than the windowed families' sliding window (``families.WINDOW`` = 24): the reused prefix is
80-112 tokens, so a loaded sliding layer starts with its window only. Without ``cacheable_prefix`` a cell chains
three prompts: the first stores its blocks from a cold prefill, the second reuses them and stores its own new
blocks, read from a cache whose sliding layers were loaded (window only) and then kept growing, and the third
reuses those: its output is the cell's. With ``cacheable_prefix`` a context of 85 tokens (5 full blocks and a
partial one) is stored with one question and reused whole with another. Blocks are stored write-behind (the
generator's default): each next prompt finds the previous one's blocks by reading its own pending writes.
Batches (rows decoded together over a left-padded cache) are checked on every family in test_generate_batch.py.

Also here: the encoder-decoder refusal (T5, not a family of the suite), loaded sliding layers keep their window,
and the dtype features (``other_dtype_blocks``, ``kvshelf precompute --dtype``).
"""

from __future__ import annotations

import json

import pytest
import torch
from arch_rule import EXACT, Output, plain_generate, run_cell
from expected_prefix import EXPECTED, PATH
from families import CONFIGS, WINDOW, WINDOWED, attn_implementations, family_model
from helpers import word_ids

from kvshelf.adapters import hf
from kvshelf.adapters.cache_bridge import blocks_from_cache, cache_from_blocks, check_supported
from kvshelf.adapters.fingerprint import fingerprint_in_dtype, model_fingerprint, other_dtype_fingerprints
from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.model import tiny_llama
from kvshelf.kvstore import MemoryTier, TieredStore
from kvshelf.kvstore.errors import UnsupportedModelError

FEATURE = "prefix reuse"
NEW = 4  # greedy tokens per cell
BLOCK = 16


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONTEXT = _tokens(85, seed=1)  # > 3 windows; 5 full blocks of 16 and a partial one of 5
QUESTION_A, QUESTION_B = _tokens(7, seed=2), _tokens(9, seed=3)
FIRST = CONTEXT + QUESTION_A  # 92 tokens: 5 full blocks stored
SECOND = FIRST + _tokens(30, seed=4)  # 122: reuses 80, stores 2 more full blocks (7 in all)
THIRD = SECOND + _tokens(18, seed=5)  # 140: reuses 112, the last 32 of them stored by SECOND's call

_MODELS: dict[tuple[str, str, torch.dtype], torch.nn.Module] = {}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(family: str, attn: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Each family's tiny model, built once per attention implementation and dtype."""
    key = (family, attn, dtype)
    if key not in _MODELS:
        _MODELS[key] = family_model(family, attn=attn, dtype=dtype)
    return _MODELS[key]


def _store() -> TieredStore:
    return TieredStore([MemoryTier(64 << 20)])


def _stored_blocks(store: TieredStore) -> int:
    return sum(tier["blocks"] for tier in store.stats()["tiers"])


def _generate(gen: CachedGenerator, ids: list[int], **kwargs):  # noqa: ANN003, ANN202
    return gen.generate(ids, max_new_tokens=NEW, output_logits=True, eos_token_id=None, pad_token_id=0, **kwargs)


def _output(result) -> Output:  # noqa: ANN001
    return Output(result.new_ids, [logits[0] for logits in result.logits])


def _cells() -> list:
    cells = []
    for family in CONFIGS:
        for attn in attn_implementations(family):
            cells += [pytest.param(family, attn, torch.float32, cacheable, id=f"{family}-{attn}-fp32-{name}")
                      for cacheable, name in ((False, "blocks"), (True, "cacheable"))]
        attn = attn_implementations(family)[0]  # sdpa, or eager where the family has none
        cells += [pytest.param(family, attn, torch.bfloat16, cacheable, id=f"{family}-{attn}-bf16-{name}")
                  for cacheable, name in ((False, "blocks"), (True, "cacheable"))]
    return cells


@pytest.mark.parametrize(("family", "attn", "dtype", "cacheable"), _cells())
def test_prefix_reuse_cell(family, attn, dtype, cacheable):
    model = _model(family, attn, dtype)
    store = _store()
    results = []

    def run() -> Output:
        gen = CachedGenerator(model, store=store, block_size=BLOCK)
        if cacheable:
            results.append(_generate(gen, FIRST, cacheable_prefix=len(CONTEXT)))
            results.append(_generate(gen, CONTEXT + QUESTION_B, cacheable_prefix=len(CONTEXT)))
        else:
            results.extend(_generate(gen, ids) for ids in (FIRST, SECOND, THIRD))
        return _output(results[-1])

    reference = plain_generate(model, CONTEXT + QUESTION_B if cacheable else THIRD, NEW)
    outcome = run_cell(model, FEATURE, run, reference, dtype=dtype,
                       nothing_stored=lambda: _stored_blocks(store) == 0)
    assert outcome == EXPECTED[(family, PATH)]
    if outcome != EXACT:
        return
    if cacheable:  # 5 full blocks and the 5-token tail, then all 85 context tokens reused
        assert [(r.reused_tokens, r.stored_blocks) for r in results] == [(0, 6), (85, 0)]
    else:
        assert [(r.reused_tokens, r.stored_blocks) for r in results] == [(0, 5), (80, 2), (112, 1)]
    if dtype == torch.float32:  # the cold prefill (stored from) equals plain generate too
        first = CONTEXT + QUESTION_A if cacheable else FIRST
        run_cell(model, FEATURE, lambda: _output(results[0]), plain_generate(model, first, NEW))


def test_expected_table_covers_every_family_once():
    assert set(EXPECTED) == {(family, PATH) for family in CONFIGS}
    assert set(EXPECTED.values()) == {EXACT}  # every family that can be exact is


# -- sliding-window layers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_loaded_sliding_layers_keep_their_window(family):
    """A prefix loaded into a sliding-window layer leaves it as its own prefill would: the last ``WINDOW - 1``
    tokens, counting all of them; full-attention layers hold every token. Blocks hold every token of every layer."""
    model = _model(family, attn_implementations(family)[-1])
    cache = hf.new_cache(model.config)
    hf.keep_sliding_history(cache)
    with torch.inference_mode():
        model(torch.tensor([FIRST]), past_key_values=cache)
    blocks = blocks_from_cache(cache, FIRST, start=0, end=80, block_size=BLOCK, fingerprint="f" * 32,
                               namespace="ns")
    assert [b.num_tokens for b in blocks] == [BLOCK] * 5
    full = torch.cat([b.keys for b in blocks], dim=2)  # [layers, kv_heads, 80, head_dim]
    for index, layer in enumerate(hf.cache_layers(cache)):  # every token of every layer, as computed
        assert torch.equal(full[index], hf.layer_tensors(layer)[0][0, :, :80])
    loaded = cache_from_blocks(blocks, model.config, max_tokens=79)
    sliding = [hf.is_sliding_layer(layer) for layer in hf.cache_layers(loaded)]
    assert any(sliding)
    for index, layer in enumerate(hf.cache_layers(loaded)):
        keys = hf.layer_tensors(layer)[0]
        if sliding[index]:
            assert keys.shape[2] == WINDOW - 1 and layer.get_seq_length() == 79
            assert torch.equal(keys[0], full[index, :, 79 - (WINDOW - 1):79])
        else:
            assert keys.shape[2] == 79 and torch.equal(keys[0], full[index, :, :79])


def test_a_sliding_layer_that_dropped_tokens_is_never_read_as_whole():
    """Without ``keep_sliding_history`` a sliding layer past its window has dropped tokens: reading them raises
    instead of storing a block short of them."""
    model = _model("mistral", "eager")
    cache = hf.new_cache(model.config)
    with torch.inference_mode():
        model(torch.tensor([FIRST]), past_key_values=cache)
    with pytest.raises(UnsupportedModelError, match="holds tokens"):
        blocks_from_cache(cache, FIRST, start=0, end=16, block_size=BLOCK, fingerprint="f" * 32, namespace="ns")


def test_gemma3_with_full_layers_only_is_not_sliding():
    """Gemma 3 with every layer full attention has no window, although its config keeps ``sliding_window``: it was
    refused as 'non-standard ['full_attention']' layers; now every path reads the layer types as transformers
    does."""
    config = CONFIGS["gemma3-full"]()
    assert hf.attention_layer_types(config) == ["full_attention"] * 2
    check_supported(config)  # no sliding layers: not refused, even where windows are


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_paths_that_do_not_opt_in_still_refuse_sliding_windows(family):
    config = CONFIGS[family]()
    model_type = config.get_text_config(decoder=True).model_type
    with pytest.raises(UnsupportedModelError, match=rf"some path does not support model type '{model_type}'.*"
                                                     "sliding-window"):
        check_supported(config, "some path")
    check_supported(config, "prefix reuse", sliding_window=True)


# -- refused: encoder-decoders and layers without a KV cache ------------------------------------------------


def _t5():  # noqa: ANN202
    import transformers as tf

    torch.manual_seed(0)
    config = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                         decoder_start_token_id=0)
    return tf.T5ForConditionalGeneration(config).eval()


def test_t5_is_refused_before_any_work():
    """T5 was accepted by ``CachedGenerator``, then raised ``AttributeError`` after generating; now it is refused
    when the generator is built, naming the model type and the feature, and nothing is stored."""
    model, store = _t5(), _store()
    outcome = run_cell(model, FEATURE, lambda: _output(_generate(CachedGenerator(model, store=store), [5] * 40)),
                       Output([]), nothing_stored=lambda: _stored_blocks(store) == 0)
    assert outcome == "refused"
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        CachedGenerator(model)


def test_layers_without_a_kv_cache_are_refused():
    """Convolution and linear-attention layers have no KV cache kvshelf can bridge: refused by layer type, naming the
    model type and the feature, where a path does not restore recurrent state (``states=False``). Chunked attention
    (Llama 4) is a sliding window of the chunk size: prefix reuse loads it, a path that bridges full-attention caches
    only refuses it by name."""
    import transformers as tf

    lfm2 = tf.Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"])
    with pytest.raises(UnsupportedModelError, match=r"prefix reuse does not support model type 'lfm2'.*attention "
                                                    r"layers of types"):
        check_supported(lfm2, "prefix reuse", sliding_window=True)
    llama4 = tf.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 attention_chunk_size=16, num_local_experts=2)
    check_supported(llama4, "prefix reuse", sliding_window=True)
    with pytest.raises(UnsupportedModelError, match=r"RAG does not support model type 'llama4_text'.*chunked "
                                                    r"attention layers \(chunk 16"):
        check_supported(llama4, "RAG")


# -- dtype --------------------------------------------------------------------------------------------------------


def test_fingerprint_in_another_dtype_is_that_of_the_cast_model():
    """Computed without converting the model: exact for its casts (float32 -> bfloat16 / float16), and for the
    float32 copy of a model whose weights are bfloat16 values (a bfloat16 checkpoint loaded in float32)."""
    model = tiny_llama(seed=0)
    for dtype in (torch.bfloat16, torch.float16):
        assert fingerprint_in_dtype(model, dtype) == model_fingerprint(tiny_llama(seed=0, dtype=dtype))
    assert fingerprint_in_dtype(model, torch.float32) == model_fingerprint(model)
    assert set(other_dtype_fingerprints(model)) == {"torch.bfloat16", "torch.float16"}
    from_bf16_checkpoint = tiny_llama(seed=0, dtype=torch.bfloat16).to(torch.float32)
    bf16 = tiny_llama(seed=0, dtype=torch.bfloat16)
    assert fingerprint_in_dtype(bf16, torch.float32) == model_fingerprint(from_bf16_checkpoint)
    assert model_fingerprint(bf16) != model_fingerprint(from_bf16_checkpoint)  # blocks stay keyed by dtype


def test_a_reuse_that_finds_only_other_dtype_blocks_says_so():
    """Blocks stored for the same weights in another dtype are never served (KV is keyed by dtype), but the result
    counts them instead of reporting a bare zero reuse."""
    store = _store()
    prompt = _tokens(70, seed=7)
    bf16 = CachedGenerator(tiny_llama(seed=0, dtype=torch.bfloat16), store=store, block_size=BLOCK)
    assert bf16.generate(prompt, max_new_tokens=1).stored_blocks == 4
    fp32 = CachedGenerator(tiny_llama(seed=0), store=store, block_size=BLOCK)  # its bfloat16 cast stored them
    result = fp32.generate(prompt, max_new_tokens=2, store=False)
    assert (result.reused_tokens, result.other_dtype_blocks, result.other_dtypes) == (0, 4, ("bfloat16",))
    # the probes are not lookups: the store counted this call's lookup for its own model only
    looked_up = {r["model"] for r in store.stats()["rows"] if r["tier"] == "*" and "lookup_blocks" in r}
    assert looked_up == {bf16.fingerprint, fp32.fingerprint}
    # a bfloat16 model finds the float32 blocks of its upcast (a bfloat16 checkpoint loaded in float32)
    other_prompt = _tokens(40, seed=8)
    upcast = CachedGenerator(tiny_llama(seed=0, dtype=torch.bfloat16).to(torch.float32), store=store,
                             block_size=BLOCK)
    assert upcast.generate(other_prompt, max_new_tokens=1).stored_blocks == 2
    result = bf16.generate(other_prompt, max_new_tokens=1, store=False)
    assert (result.reused_tokens, result.other_dtype_blocks, result.other_dtypes) == (0, 2, ("float32",))
    assert bf16.generate(_tokens(40, seed=9), max_new_tokens=1).other_dtype_blocks == 0  # in no dtype
    # something reused in the model's own dtype: no probe, nothing reported
    again = fp32.generate(prompt, max_new_tokens=1)
    assert (again.reused_tokens, again.other_dtype_blocks, again.other_dtypes) == (0, 4, ("bfloat16",))
    again = fp32.generate(prompt, max_new_tokens=1)
    assert (again.reused_tokens, again.other_dtype_blocks, again.other_dtypes) == (64, 0, ())
    other = CachedGenerator(tiny_llama(seed=1), store=store, block_size=BLOCK)  # other weights: none
    assert other.generate(prompt, max_new_tokens=1, store=False).other_dtype_blocks == 0


def test_precompute_command_takes_a_dtype(tmp_path, monkeypatch):
    """``kvshelf precompute --dtype bfloat16`` loads the model in that dtype and stores its chunks keyed by it; an
    unknown dtype is a clear error before the model loads."""
    from typer.testing import CliRunner

    from kvshelf.adapters import model as model_module
    from kvshelf.cli import app

    class WordTokenizer:
        pad_token_id = 0

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": word_ids(text)}

    loads = []

    def fake_load(name, dtype="float32", device="cpu"):  # noqa: ANN001, ANN202
        loads.append(dtype)
        return tiny_llama(seed=0, dtype=model_module.resolve_dtype(dtype)), WordTokenizer()

    monkeypatch.setattr(model_module, "load_model", fake_load)
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"word{i}" for i in range(40)))
    runner = CliRunner()
    result = runner.invoke(app, ["precompute", str(doc), "--data-dir", str(tmp_path / "store"), "--dtype",
                                 "bfloat16", "--chunk-size", "16"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])  # after the progress bar
    assert (summary["dtype"], summary["computed"], loads) == ("bfloat16", 3, ["bfloat16"])
    result = runner.invoke(app, ["precompute", str(doc), "--data-dir", str(tmp_path / "store"), "--dtype", "fp8"])
    assert result.exit_code != 0 and loads == ["bfloat16"]
    assert "unknown dtype 'fp8'" in str(result.exception or result.output)
