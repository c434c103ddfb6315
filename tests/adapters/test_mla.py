"""MLA models (DeepSeek-V2/V3, MiniCPM3) beyond the architecture suite's cells: their blocks as stored (the cache's
compressed latent as keys, the rotated key part as values: different head dims) are reused from disk, never dropped
as damaged; xquant refuses them with a clear error."""

from __future__ import annotations

import pytest
import torch
from arch_rule import Output, assert_same, plain_generate
from families import MLA, family_model

from kvshelf.adapters.generate import CachedGenerator
from kvshelf.adapters.xquant import xquant_params
from kvshelf.kvstore import open_embedded_store
from kvshelf.kvstore.encoding import read_header
from kvshelf.kvstore.errors import UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("family", sorted(MLA))
def test_mla_blocks_are_reused_from_disk_never_dropped(family, tmp_path):
    model = family_model(family)
    config = model.config
    store = open_embedded_store(tmp_path / "store", memory_bytes=None, disk_codec="zstd", durable=False)
    prompt = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(11)).tolist()
    try:
        gen = CachedGenerator(model, store=store, block_size=16)
        cold = gen.generate(prompt, max_new_tokens=3, eos_token_id=None, pad_token_id=0, wait=True)
        warm = gen.generate(prompt, max_new_tokens=3, eos_token_id=None, pad_token_id=0, output_logits=True)
        assert (cold.reused_tokens, cold.stored_blocks, warm.reused_tokens) == (0, 4, 64)
        disk = store.specs[-1].tier
        headers = [read_header(v) for v in disk.get_many(disk.keys())]
        assert len(headers) == 4
        for header in headers:  # one head: the latent (kv_lora_rank) and the rotated key part (qk_rope_head_dim)
            assert header.codec == "zstd"
            assert header.shape.keys == (config.num_hidden_layers, 1, 16, config.kv_lora_rank)
            assert header.shape.values == (config.num_hidden_layers, 1, 16, config.qk_rope_head_dim)
        assert all(t["corrupt"] == 0 and t["rejected"] == 0 for t in store.stats()["tiers"])
        gen.close()
    finally:
        store.close()
    assert_same(Output(warm.new_ids, [lg[0] for lg in warm.logits]), plain_generate(model, prompt, 3), what=family)


@pytest.mark.parametrize("family", sorted(MLA))
def test_xquant_refuses_mla_models_naming_them(family):
    model = family_model(family)
    model_type = model.config.model_type
    with pytest.raises(UnsupportedModelError, match=f"xquant does not support model type '{model_type}'.*MLA"):
        xquant_params(model, list(range(3, 100)))
