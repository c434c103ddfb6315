"""What the architecture suite expects of prefix reuse (``CachedGenerator``) on each family (the docs' families table's
source): ``{(family, "prefix"): "exact" | "refused"}``, checked cell by cell by
``tests/adapters/test_families_prefix.py``.

Prefix reuse promises equality with plain ``model.generate`` (greedy tokens, logits within 1e-4 in fp32), with and
without ``cacheable_prefix``, under every attention implementation the family has. Every family of
``families.CONFIGS`` is exact, the sliding-window and hybrid ones included (blocks hold every token of every layer;
a loaded sliding layer keeps its window). Encoder-decoders (T5) are refused; they are not in ``families.CONFIGS``
and are tested on their own.
"""

from __future__ import annotations

from families import CONFIGS

PATH = "prefix"
REFUSED_FAMILIES: dict[str, str] = {}  # family -> why (none: every family of the suite is exact)

EXPECTED: dict[tuple[str, str], str] = {
    (family, PATH): "refused" if family in REFUSED_FAMILIES else "exact" for family in CONFIGS
}
