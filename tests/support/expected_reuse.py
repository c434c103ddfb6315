"""What the architecture suite expects of the RAG and prompt-module paths on each family (the docs' families table's
source): ``{(family, path): "exact" | "approximate" | "refused"}``, checked cell by cell by
``tests/adapters/test_families_reuse.py``.

* ``rag-reuse`` (TurboRAG): approximate (chunks miss each other); exact limiting case: one chunk, no prefix, and
  keys re-rotated to position ``p`` equal to the chunk computed at ``p``.
* ``rag-blend`` (CacheBlend): approximate; exact limiting case: ``recompute_ratio=1.0`` equals full prefill.
* ``rag-block-attention``: approximate; exact limiting case: one block after the prefix equals full prefill.
* ``prompt-modules`` (Prompt Cache): exact at schema positions with contiguous text.

Sliding-window and hybrid models (Mistral, Qwen2 with a window, Gemma 2 and 3) run with each sliding layer's window on
top of the path's mask, the suite's prompts longer than the window. Refused: decoders without a Llama-layout RoPE
(GPT-2, Falcon). MLA decoders (DeepSeek-V2/V3, MiniCPM3) cache a compressed latent (keys, position-free) and the
rotated key part their heads share (values): a chunk's values move (DeepSeek-V2: complex pairs, its freqs_cis).
Gemma 3's local and global RoPE: each layer's keys move with
its own table. Length-dependent RoPE (dynamic, longrope) is static up to a length
(``reuse_engine.check_positions``): exact within it, refused beyond.
"""

from __future__ import annotations

from families import CONFIGS

PATHS = ("rag-reuse", "rag-blend", "rag-block-attention", "prompt-modules")
EXACT_PATHS = frozenset({"prompt-modules"})  # the others are approximate by design (their limiting case is exact)

REFUSED_FAMILIES = {
    "gpt2": "no rotary position embedding",
    "falcon": "no decoder layers in the Llama layout",
    "llama4": "chunked attention (a chunk's tokens attend within it: chunks moved to other positions fall in others)",
}


def _outcome(family: str, path: str) -> str:
    if family in REFUSED_FAMILIES:
        return "refused"
    return "exact" if path in EXACT_PATHS else "approximate"


EXPECTED: dict[tuple[str, str], str] = {(family, path): _outcome(family, path) for family in CONFIGS for path in PATHS}
