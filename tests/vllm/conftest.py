"""Fixtures of the tests on a real vLLM engine (helpers: ``tests/support/vllm_engine.py``). An engine takes 20-50 s to
start here: modules share theirs, and engines run one at a time."""

from __future__ import annotations

import pytest
from vllm_engine import engine, generate, tokens_of


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvshelf.adapters.model import convert_bundled

    return str(convert_bundled("smollm2-135m"))


@pytest.fixture(scope="session")
def fingerprint(model_dir: str) -> str:
    import torch

    from kvshelf.adapters.vllm.fingerprint import checkpoint_fingerprint

    return checkpoint_fingerprint(model_dir, torch.float32)


@pytest.fixture(scope="session")
def documents(model_dir: str) -> dict[str, list[int]]:
    """Token-id prompts: ``doc0``..``doc4`` (1,000 tokens each: 3 full 256-token blocks), ``partial`` (doc0's first
    600 tokens, then another text: 2 blocks shared), ``short`` (100 tokens: no full block), ``straddle`` (doc0's
    first 400 tokens, then another text), ``long0``/``long1`` (1,020 tokens: their fifth decoded token needs a
    ninth vLLM page)."""
    from transformers import AutoTokenizer

    from kvshelf.bench.synthetic_abstracts import make_abstracts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = make_abstracts()
    text = " ".join(f"{r['title']}. {r['abstract']}" for r in records)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 7000, len(ids)
    docs = {f"doc{i}": ids[i * 1000:(i + 1) * 1000] for i in range(5)}
    docs["partial"] = docs["doc0"][:600] + ids[6000:6400]
    docs["short"] = ids[6500:6600]
    docs["straddle"] = docs["doc0"][:400] + ids[6400:6500]  # 3 of vLLM's pages shared with doc0, 1.5 blocks
    docs["long0"], docs["long1"] = ids[7000:8020], ids[8100:9120]  # 8 vLLM pages each; the 5th new token a 9th
    return docs


@pytest.fixture(scope="session")
def reference(model_dir: str, documents: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy tokens of every document from vLLM without the connector."""
    names = sorted(documents)
    with engine(model_dir, None) as llm:
        outputs = generate(llm, [documents[n] for n in names])
    return dict(zip(names, tokens_of(outputs), strict=True))
