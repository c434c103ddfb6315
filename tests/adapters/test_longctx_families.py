"""Architecture suite, tier-backed sparse attention (``kvshelf.adapters.longctx.TierSparse``): on every family
(``families.CONFIGS``), a context prefilled in segments into a real LMDB store and attended with every block
selected gives plain HF ``generate``'s greedy tokens and logits (fp32, 1e-4), or is refused before any work
(``expected_longctx.EXPECTED``); with fewer blocks selected it runs and reads blocks back from the store."""

from __future__ import annotations

import pytest
import torch
from arch_rule import EXACT, REFUSED, Output, plain_generate, run_cell
from expected_longctx import EXPECTED
from families import CONFIGS, attn_implementations, family_model

from kvshelf.adapters.longctx import TierSparse
from kvshelf.adapters.longctx.method import FEATURE
from kvshelf.kvstore.embedded import open_embedded_store

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT, QUESTION, NEW = 60, 4, 4
IDS = torch.randint(3, 500, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
#: small blocks, window and segments, so that the 60-token context spans ten stored blocks per layer
EVERY_BLOCK = TierSparse(block_tokens=4, top_blocks=1000, sinks=2, window=8, segment=8, resident_bytes="8MiB")


def test_expected_table_covers_every_family():
    assert set(EXPECTED) == set(CONFIGS)


def _sparse(model: torch.nn.Module, method: TierSparse, path, entered: list[bool]):  # noqa: ANN001, ANN202
    with open_embedded_store(path, memory_bytes=None, durable=False) as store, method.session(model, store) as s:
        entered.append(True)
        s.prefill(IDS[:-QUESTION])
        scores: list[torch.Tensor] = []
        tokens = s.generate(IDS[-QUESTION:], NEW, scores=scores)
        return Output(tokens, scores), s.stats


@pytest.mark.parametrize("family", list(CONFIGS))
def test_cell(family: str, tmp_path) -> None:  # noqa: ANN001
    model = family_model(family, attn=attn_implementations(family)[0])
    entered: list[bool] = []
    outcome = run_cell(model, FEATURE, lambda: _sparse(model, EVERY_BLOCK, tmp_path / "a", entered)[0],
                       lambda: plain_generate(model, IDS, NEW), nothing_stored=lambda: not entered)
    assert outcome == EXPECTED[family], f"{family}: {outcome}"
    if outcome == REFUSED:
        return
    few = TierSparse(block_tokens=4, top_blocks=2, sinks=2, window=8, segment=8, resident_bytes="8MiB")
    out, stats = _sparse(model, few, tmp_path / "b", entered)
    assert len(out.tokens) == NEW and stats.stored_blocks > 0 and stats.kv_fraction < 1.0
    assert stats.resident_peak_bytes <= stats.resident_limit_bytes


def test_exact_outcome_names():
    assert {EXACT, REFUSED} >= set(EXPECTED.values())
