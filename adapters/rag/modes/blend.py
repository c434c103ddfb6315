"""``reuse-blend`` (CacheBlend, Yao et al., EuroSys 2025): independently encoded chunks (by default the
Block-Attention blocks, each encoded after the shared prefix, as CacheBlend's reference code encodes every chunk
after the prompt's opening tokens; ``blend_base="chunk"``: TurboRAG's position-0 chunks), then the tokens whose KV
deviates most are recomputed, restoring cross-chunk attention at a fraction of the cost."""

from __future__ import annotations

import torch

from kvshelf.adapters.decode import Generated
from kvshelf.adapters.rag.chunks import BLOCK, CHUNK
from kvshelf.adapters.rag.modes.assembled import AssembledMode, decode_prefilled
from kvshelf.adapters.rag.modes.base import Exactness, RAGQuery
from kvshelf.adapters.reuse_engine import Layout, embed, folded_attention, last_logits, layer_kv, run_layers, write_kv
from kvshelf.reuse.blend import kv_deviation, select_recompute

BLEND_GROUP_ROWS = 64  # queries per causal attention group (see ``run_layers``)


class BlendMode(AssembledMode):
    name = "reuse-blend"
    # recomputing every chunk token restores full prefill
    exactness = Exactness(settings={"recompute_ratio": 1.0})

    def kind(self, blend_base: str) -> str:
        return BLOCK if blend_base == "block" else CHUNK

    def prefill(self, query: RAGQuery, layout: Layout) -> tuple[Generated, int]:
        first, recomputed = blend(query, layout)
        return decode_prefilled(query, layout, first), recomputed


def blend(query: RAGQuery, layout: Layout) -> tuple[torch.Tensor, int]:
    """CacheBlend selective recompute over the assembled ``layout`` (the prefix, the chunks and the question).

    1. The whole prompt goes through layers ``0..select_layer-1`` (one layer by default) as a plain causal
       prefill; their fresh KV replaces the reused KV for every token.
    2. Layer ``select_layer``'s K/V projections of those outputs (no attention, no MLP) give every token's
       fresh KV there; the ``ratio`` of chunk tokens whose KV deviates most from the reused KV are chosen.
    3. Only the chosen tokens and the question run through the remaining layers, in causal groups over the
       blended cache; at the last layer all but the last prompt token need only their K/V, the last one the
       whole layer (its logits start decoding).

    Returns the last prompt token's next-token logits ``[vocab]`` and how many chunk tokens were chosen."""
    model, p = query.model, len(query.prefix)
    n_chunk, total, sel = sum(len(c) for c in query.chunk_ids), layout.rows, query.settings.select_layer
    last = model.config.num_hidden_layers - 1
    rows = torch.arange(total)
    with folded_attention(model):  # once for every pass below
        hidden = run_layers(model, layout, embed(model, query.all_ids), rows, rows, None, range(sel))
        new_k, new_v = layer_kv(model, sel, hidden, rows)
        span = slice(p, p + n_chunk)
        deviation = kv_deviation(layout.keys[sel][:, :, span], layout.values[sel][:, :, span],
                                 new_k[:, :, span], new_v[:, :, span])
        write_kv(layout, sel, rows, new_k, new_v)
        chosen = select_recompute(deviation, query.settings.ratio) + p  # layout rows
        keep = torch.cat([chosen, torch.arange(p + n_chunk, total)])  # the question's rows last
        hidden = hidden[:, keep]
        if sel < last:
            hidden = run_layers(model, layout, hidden, keep, keep, None, range(sel, last),
                                group_rows=BLEND_GROUP_ROWS)
            if keep.numel() > 1:
                k, v = layer_kv(model, last, hidden[:, :-1], keep[:-1])
                write_kv(layout, last, keep[:-1], k, v)
        hidden = run_layers(model, layout, hidden[:, -1:], keep[-1:], keep[-1:], None, range(last, last + 1))
    return last_logits(model, hidden), int(chosen.numel())
