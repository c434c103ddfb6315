"""What the architecture suite expects of tier-backed sparse attention on each family:
``{family: "exact" | "refused"}``, checked by ``tests/adapters/test_longctx_families.py``.

"exact": with every block selected, a context prefilled in segments into the store and the question's greedy
tokens equal plain HF ``generate``'s (fp32 logits within 1e-4). "refused": ``UnsupportedModelError`` naming the
feature and the family's ``model_type`` when the session opens, before any work.
"""

from __future__ import annotations

from families import CONFIGS

REFUSED: dict[str, str] = {
    "mistral": "every attention layer is sliding-window",
    "gemma2": "soft-capped attention logits",
    "falcon": "attention outside transformers' attention interface",
    "llama4": "chunked-attention layers",
    "deepseek-v2": "multi-head latent attention (MLA)",
    "deepseek-v3": "multi-head latent attention (MLA)",
    "minicpm3": "multi-head latent attention (MLA)",
}

EXPECTED: dict[str, str] = {family: "refused" if family in REFUSED else "exact" for family in CONFIGS}
