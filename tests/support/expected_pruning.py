"""What the architecture suite expects of token pruning and selection on each family (the families table's source):
``{(family, method): "exact" | "refused"}``, one column per method of ``kvshelf.adapters.pruning.METHODS``,
checked cell by cell by ``tests/adapters/test_families_pruning.py``.

"exact": budget 1.0 (keep everything) gives plain HF ``generate``'s greedy tokens and logits (fp32: within 1e-4),
and a smaller budget runs (approximate by design) and prunes every full-attention layer to it. Sliding-window
layers are never pruned (their cache is bounded by the window already): hybrid models (Qwen2 with
``max_window_layers``, Gemma 2/3) prune their full-attention layers only.

"refused": ``UnsupportedModelError`` naming the method and the family's ``model_type`` when the ``with`` block is
entered, before any work:

* Mistral with its ``sliding_window``: every layer is sliding-window, nothing a method may prune;
* TokenSelect on Falcon: its attention does not call transformers' attention interface, where TokenSelect runs;
* SnapKV on MLA decoders (DeepSeek-V2/V3, MiniCPM3): it recomputes the window's queries, which an MLA layer makes
  through its low-rank projections and a rotated slice of the head; on Llama 4, whose queries rotate as complex pairs.

FastKV (``PREFILL_METHODS``: prefill-time pruning, not in ``METHODS``: its setting is a propagation ratio and a TSP
layer, not a budget of kept tokens): "exact" means ratio 1.0 (every token propagated past the TSP layer) gives plain
``generate``'s tokens and logits, and ratio 0.5 shortens the later layers and the cache. Refused as SnapKV is (it
votes with SnapKV's recomputed queries), and wherever a layer is not full attention (sliding or chunked windows
count cache slots, which dropped tokens would shift) or the decoder cannot shorten its hidden states (GPT-2).
"""

from __future__ import annotations

from families import CONFIGS

#: the methods, as ``METHODS`` names them (the suite checks the two agree)
METHODS = ("streamingllm", "h2o", "keyformer", "snapkv", "keynorm", "tokenselect")

#: refused cells and why (the refusal's feature)
REFUSED: dict[tuple[str, str], str] = {
    **{("mistral", method): "every attention layer is sliding-window" for method in METHODS},
    ("falcon", "tokenselect"): "attention outside transformers' attention interface",
    **{(family, "snapkv"): "multi-head latent attention (MLA)"
       for family in ("deepseek-v2", "deepseek-v3", "minicpm3")},
    ("llama4", "snapkv"): "its queries rotate as complex pairs (freqs_cis), a rotary convention kvshelf does not "
                          "recompute",
}

#: prefill-time pruning methods, as the suite names them
PREFILL_METHODS = ("fastkv",)

REFUSED.update({
    **{(family, "fastkv"): "a sliding-window layer" for family in ("mistral", "qwen2-window", "gemma2", "gemma3")},
    **{(family, "fastkv"): "multi-head latent attention (MLA)"
       for family in ("deepseek-v2", "deepseek-v3", "minicpm3")},
    ("llama4", "fastkv"): "queries rotating as complex pairs, chunked attention layers",
    ("gpt2", "fastkv"): "its decoder reshapes the last hidden states to the input's length",
})

EXPECTED: dict[tuple[str, str], str] = {
    (family, method): "refused" if (family, method) in REFUSED else "exact"
    for family in CONFIGS for method in (*METHODS, *PREFILL_METHODS)
}
