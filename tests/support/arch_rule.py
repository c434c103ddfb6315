"""The rule every cell of the architecture suite (family x path) must meet (issue: exact or refused).

* A path that promises equality with plain HF (prefix reuse, a single chunk, prompt modules at schema positions,
  blend with ``recompute_ratio=1.0``, pruning budget 1.0) gives the reference's greedy tokens, and logits within
  ``LOGIT_ATOL`` in fp32 (bf16: the same tokens, logits within ``BF16_LOGIT_ATOL``).
* Anything else raises ``UnsupportedModelError`` naming the family (its ``model_type``) and the feature, before
  any work is done or stored: never a raw ``RuntimeError``, never silently different output.

``run_cell`` applies it: give it the reference and a callable running the path; it returns ``"exact"`` or
``"refused"`` and fails the test on anything else. ``EXACT`` / ``REFUSED`` are the outcomes the suites compare
against their tables of expected outcomes (which docs/families.md's support table is rendered from).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from kvshelf.kvstore.errors import UnsupportedModelError

EXACT, APPROXIMATE, REFUSED = "exact", "approximate", "refused"
LOGIT_ATOL = 1e-4
BF16_LOGIT_ATOL = 5e-2


@dataclass(frozen=True)
class Output:
    """What a path (or the reference) produced: greedy new tokens and, per new token, logits ``[vocab]``."""

    tokens: list[int]
    logits: Sequence[torch.Tensor] | None = None


def plain_generate(model, ids: Sequence[int], max_new_tokens: int) -> Output:  # noqa: ANN001
    """The reference: HF ``model.generate`` greedy over the whole prompt, with its logits."""
    input_ids = torch.tensor([list(ids)])
    with torch.inference_mode():  # the mask given: a prompt holding the pad id (a generated 0) is not padding
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return Output(out.sequences[0, len(ids):].tolist(), [lg[0].float() for lg in out.logits])


def assert_same(got: Output, want: Output, *, dtype: torch.dtype = torch.float32, what: str = "") -> None:
    """Identical greedy tokens and logits within the dtype's tolerance (logits compared where both have them)."""
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens} != reference {want.tokens}"
    if got.logits is None or want.logits is None:
        return
    atol = LOGIT_ATOL if dtype == torch.float32 else BF16_LOGIT_ATOL
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=False)):
        diff = (a.float().reshape(-1) - b.float().reshape(-1)).abs().max().item()
        assert diff <= atol, f"{what}: logits of new token {step} differ by {diff:.3g} (> {atol:g})"


def run_cell(model, feature: str, run: Callable[[], Output], reference: Output | Callable[[], Output], *,  # noqa: ANN001
             dtype: torch.dtype = torch.float32, nothing_stored: Callable[[], bool] | None = None) -> str:
    """Run one cell: ``"exact"`` when ``run()`` equals the reference, ``"refused"`` when it raises
    ``UnsupportedModelError`` naming the family and ``feature`` (and ``nothing_stored()`` holds, if given).
    Any other exception, or a different output, fails the test."""
    family = model.config.get_text_config(decoder=True).model_type
    try:
        got = run()
    except UnsupportedModelError as exc:
        message = str(exc)
        assert family in message, f"refusal does not name the family {family!r}: {message}"
        assert feature.lower() in message.lower(), f"refusal does not name the feature {feature!r}: {message}"
        if nothing_stored is not None:
            assert nothing_stored(), f"{family}/{feature}: refused after storing something"
        return REFUSED
    except Exception as exc:  # noqa: BLE001 - the rule: never a raw error
        pytest.fail(f"{family}/{feature}: raw {type(exc).__name__}: {exc}")
    want = reference() if callable(reference) else reference
    assert_same(got, want, dtype=dtype, what=f"{family}/{feature}")
    return EXACT
