"""What prefix reuse (``CachedGenerator``) does on each family the catalog builds (``catalog.built()``), checked by
``tests/adapters/test_families_catalog.py`` and rendered into docs/families.md's catalog table (``support_table``).

``EXACT``: identical greedy tokens and fp32 logits within 1e-4 of plain ``generate``, reusing what was stored.
``REFUSED``: model type -> why (a phrase of kvshelf's ``UnsupportedModelError``, which also names the model type
and the feature, raised before any block is stored or any forward is run).
``HYBRID``: families with recurrent-state layers (Mamba / linear attention / short convolutions, RG-LRU...):
exact with state snapshots beside the KV blocks (``adapters.states.STATE_FAMILIES``), or refused naming the family
and why (``adapters.states.NOT_EXACT``, or its state layer types).
"""

from __future__ import annotations

EXACT = frozenset({
    "afmoe", "apertus", "arcee", "aria_text", "axk1", "beam", "bert", "bert-generation", "big_bird", "biogpt",
    "bitnet", "bloom", "camembert", "codegen", "cohere2", "cohere2_moe", "cohere_compass_text", "ctrl", "cwm",
    "data2vec-text", "dbrx", "deepseek_v2", "deepseek_v3", "diffllama", "doge", "dots1", "electra", "ernie",
    "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "flex_olmo", "flint", "glm", "glm4",
    "glm4_moe", "glm4_moe_lite", "gpt-sw3", "gpt_bigcode", "gpt_neo", "gpt_neox_japanese", "gpt_oss", "gptj",
    "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe", "kolibri1", "laguna",
    "llama4_text",
    "longcat_flash", "megatron-bert", "mellum", "minicpm3", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "modernbert-decoder", "moshi", "mpt", "nanochat", "nemotron", "olmo", "olmo3", "olmoe", "opt",
    "persimmon", "phi", "phimoe", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "seed_oss",
    "smollm3", "solar_open", "starcoder2", "trocr", "vaultgemma", "xglm", "xlm-roberta", "xlm-roberta-xl", "xmod",
    "youtu",
})

_NO_CACHE = "takes no past_key_values"
_INDEXED = "['indexed_attention']"
_PER_LAYER = "set per layer"

REFUSED: dict[str, str] = {
    **{t: _NO_CACHE for t in ("openai-gpt", "reformer", "xlm", "xlnet")},
    **{t: _INDEXED for t in ("axk2", "deepseek_v32", "glm_moe_dsa", "hy_v4")},
    "deepseek_v4": "['compressed_sparse_attention', 'heavily_compressed_attention']",
    **{t: _PER_LAYER for t in ("dots3_note_text", "gemma4_text", "gemma4_unified_text")},
    "mimo_v2_flash": "key projections differ in width",
    "cpmant": "learned prompt tokens",
    "gemma3n_text": "['dummy']",  # its last layers read an earlier layer's KV (num_kv_shared_layers)
}

#: hybrid family -> its outcome (exact: KV blocks plus state snapshots; refused: why in adapters.states)
HYBRID: dict[str, str] = {
    **dict.fromkeys(("bailing_hybrid", "falcon_h1", "granitemoehybrid", "jamba", "kimi_linear", "lfm2", "lfm2_moe",
                     "nemotron_h", "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "zamba", "zamba2",
                     "zaya", "lfm3"), "exact"),
    **dict.fromkeys(("bamba", "falcon_mamba", "inkling_text", "inkling2_text", "mamba", "mamba2", "minimax",
                     "qwen4_exp_text", "recurrent_gemma", "rwkv", "xlstm"), "refused"),
}

#: model type -> "exact" | "refused" (docs/families.md's catalog table)
EXPECTED: dict[str, str] = {
    **dict.fromkeys(EXACT, "exact"), **dict.fromkeys(REFUSED, "refused"), **HYBRID,
}


# -- token pruning and selection (budget 1.0, eager) ------------------------------------------------------------

#: families every pruning / selection method refuses at budget 1.0 (no KV cache, encoders run as decoders with
#: absolute or relative position embeddings, fused or unknown query paths, sparse or chunked attention...)
PRUNING_REFUSED_ALL = frozenset({
    "axk2", "bert", "bert-generation", "big_bird", "biogpt", "camembert", "codegen", "cpmant", "ctrl",
    "data2vec-text", "dbrx", "deepseek_v32", "deepseek_v4", "dots3_note_text", "electra", "ernie", "glm_moe_dsa",
    "gpt_neo", "gpt_neox_japanese", "gptj", "hrm_text", "hy_v4", "longcat_flash", "megatron-bert", "ministral",
    "moshi", "mpt", "openai-gpt", "opt", "reformer", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
    "roformer", "trocr", "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod"
})
#: method -> the families it refuses at budget 1.0 (the others are exact); hybrid families are ``HYBRID``'s rule
PRUNING_REFUSED: dict[str, frozenset[str]] = {
    "snapkv": PRUNING_REFUSED_ALL | {
        "afmoe", "axk1", "beam", "bitnet", "bloom", "diffllama", "doge", "gemma3n_text", "gemma4_text",
        "gemma4_unified_text", "glm4_moe_lite", "gpt_oss", "hunyuan_v1_dense", "hunyuan_v1_moe", "jetmoe", "laguna",
        "llama4_text", "modernbert-decoder", "nanochat", "xglm", "youtu"
    },
    "streamingllm": PRUNING_REFUSED_ALL,
    "h2o": PRUNING_REFUSED_ALL,
    "keyformer": PRUNING_REFUSED_ALL,
    "keynorm": PRUNING_REFUSED_ALL,
    "tokenselect": PRUNING_REFUSED_ALL | {
        "bloom", "xglm"
    },
}


# -- RAG chunks and prompt modules ---------------------------------------------------------------------------------

#: path -> the built families it runs on (rag-*: approximate by design, exact in the limiting case;
#: prompt-modules: exact); every other built family is refused before any work
_REUSE_RUNS = frozenset({
    "apertus", "arcee", "aria_text", "bitnet", "cohere_compass_text", "cwm", "diffllama", "dots1", "ernie4_5",
    "ernie4_5_moe", "flex_olmo", "glm", "glm4", "glm4_moe", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3",
    "iquestcoder", "jais2", "laguna", "mellum", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3",
    "nemotron", "olmo", "olmo3", "olmoe", "phimoe", "seed_oss", "smollm3", "solar_open", "starcoder2", "vaultgemma"
})
REUSE_RUNS: dict[str, frozenset[str]] = dict.fromkeys(
    ("rag-reuse", "rag-blend", "rag-block-attention", "prompt-modules"), _REUSE_RUNS)
#: families whose RAG chunk keys, computed at 0 and moved to position p, would differ from the chunk computed at p
#: (the catalog test marks their rag-reuse cell xfail, strict). None now: the engine's self-check refuses a model
#: whose keys do not re-rotate (``reuse_engine._rerotation_problem``: AFMoE, Cohere 2, EXAONE 4, Flint and Kolibri
#: have layers without RoPE beside rotated ones), and ``hf.rotary`` reads the interleaving GLM, GLM-4, ERNIE 4.5 and
#: Helium apply to Llama's table
RAG_REROTATION_INEXACT: frozenset[str] = frozenset()
