"""Decoding for the reuse front doors (``RAGGenerator``, ``PromptModuleGenerator``) through HF ``model.generate``.

The reuse engine (``adapters.reuse_engine``) assembles a *layout*: the KV of the prompt rows, some reused from the
store, some computed. Two ways to decode from it, both through ``model.generate`` (so sampling arguments, logits
processors, stopping criteria and streamers are ``generate``'s own; TTFT is measured by
``streaming.FirstTokenTimer`` wrapped around the caller's streamer):

* ``generate_prefilled`` (the RAG modes): the engine computed every prompt row, the last one included, and that
  row's next-token logits; ``generate`` takes both as its prefill (``hf.prefilled``: its decoding loop's first
  step answered for this call) and runs no forward over the prompt. The first token costs no HF decode step, and
  the cache is the layout's own buffers (allocated with room for the new tokens: ``cache_for_decoding``), not a
  copy. Decoding modes that take no prefill (assisted decoding, ``custom_generate``: ``hf.NOT_PREFILLED``) fall
  back to the next way.
* ``generate_from_layout`` (prompt modules): the layout holds every prompt row but the last; ``generate`` gets the
  whole prompt with the layout as ``past_key_values`` and computes the last prompt token against it (exact: it
  attends to every earlier row), one HF decode step more before the first token. Explicit ``position_ids`` carry
  gaps (Prompt Cache parameter slots): ``generate`` slices them to the uncached token and extends them by one per
  new token.

Computing the last prompt token through ``generate`` instead of the engine cost the RAG modes about one decode
step of TTFT (SmolLM2, 8 chunks x ~150 tokens after a chat prefix, ``kvshelf bench rag``'s needle cases, median of
5 on a 2-core Intel Xeon, OMP_NUM_THREADS=1: ``reuse`` 0.269 s through ``generate`` vs 0.183 s prefilled by the
engine, ``reuse-blend`` 0.740 s vs 0.668 s, ``full`` 2.9-3.1 s; the same greedy tokens). Later steps decode in
place (``GrowingLayer``), where a ``DynamicLayer`` concatenates the whole cache per step.

Only APE's column bias (Yang et al., ICLR 2025: scaled logits on the parallel chunks' keys) cannot be expressed
through ``generate`` (it rides on an explicit additive mask at every step): ``greedy_with_bias`` keeps a manual
greedy loop for it, calls the streamer the same way, and refuses sampling arguments (``ConfigError``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters import hf
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.reuse_engine import Layout, layer_windows, refusal
from kvshelf.adapters.streaming import FirstTokenTimer, emit_prompt, emit_tokens
from kvshelf.kvstore.errors import ConfigError, UnsupportedModelError

EOS_DEFAULT = "default"  # ``eos_token_id="default"``: the model's generation config decides
# what the front door passes itself: a caller giving one of these would silently change what is computed
RESERVED = frozenset({"input_ids", "inputs", "position_ids", "attention_mask", "past_key_values", "streamer",
                      "max_new_tokens", "return_dict_in_generate", "output_logits", "use_cache", "inputs_embeds"})
SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
            "repetition_penalty", "num_beams", "logits_processor", "generation_config")


@dataclass
class Generated:
    """One sequence's decoding: new token ids, the first new token's raw logits ``[vocab]`` (float32, before any
    logits processor), optionally every step's (``[vocab]`` each), and when the first and last tokens came."""

    new_ids: list[int]
    first_logits: torch.Tensor
    logits: list[torch.Tensor] | None
    first_token_at: float
    finished_at: float


def check_generate_kwargs(kwargs: dict[str, Any], where: str) -> None:
    """Refuse arguments the front door sets itself, and more than one sequence per prompt (``ConfigError``)."""
    reserved = sorted(set(kwargs) & RESERVED)
    if reserved:
        raise ConfigError(f"{where} sets {', '.join(reserved)} itself; pass the prompt, max_new_tokens and "
                          "streamer as its own arguments")
    if int(kwargs.get("num_return_sequences", 1) or 1) != 1:
        raise ConfigError(f"{where} returns one sequence per prompt; num_return_sequences must be 1")
    if int(kwargs.get("num_beams", 1) or 1) != 1:
        raise ConfigError(f"{where}: beam search (num_beams > 1) is not supported over an assembled cache; use "
                          "greedy decoding or sampling")


def _prepared(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, kwargs: dict[str, Any],
              eos_token_id: int | Sequence[int] | None | str) -> dict[str, Any]:
    kwargs = dict(kwargs)
    kwargs.setdefault("do_sample", False)  # greedy unless asked (a model's config may default to sampling)
    if eos_token_id != EOS_DEFAULT:
        kwargs["eos_token_id"] = None if eos_token_id is None else (
            int(eos_token_id) if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id])
    if "pad_token_id" not in kwargs:
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = getattr(model.generation_config, "pad_token_id", None)
        if pad is None:
            eos = kwargs.get("eos_token_id", getattr(model.generation_config, "eos_token_id", None))
            pad = (eos[0] if eos else None) if isinstance(eos, list) else eos
        kwargs["pad_token_id"] = 0 if pad is None else pad  # never used: one row, no padding
    return kwargs


@torch.inference_mode()
def generate_from_cache(
    model: PreTrainedModel, ids: Sequence[int], positions: Sequence[int] | None, cache: DynamicCache | None, *,
    max_new_tokens: int, tokenizer: PreTrainedTokenizerBase | None = None,
    eos_token_id: int | Sequence[int] | None | str = EOS_DEFAULT, streamer: BaseStreamer | None = None,
    all_logits: bool = False, **generate_kwargs: Any,
) -> tuple[Generated, FirstTokenTimer]:
    """``model.generate`` over the whole prompt ``ids`` ``[n]`` (at ``positions`` ``[n]``, default ``0..n-1``)
    with ``cache`` holding the KV of its first ``m < n`` rows (``None``: nothing cached, a plain ``generate``).

    ``eos_token_id``: ``"default"`` (the model's), ``None`` (never stop early) or ids. ``generate_kwargs`` go to
    ``model.generate`` (``do_sample``, ``temperature``, ``top_k``, ``logits_processor``...); greedy by default.
    Returns the decoding and the ``FirstTokenTimer`` that wrapped ``streamer``."""
    check_generate_kwargs(generate_kwargs, "generation")
    kwargs = _prepared(model, tokenizer, generate_kwargs, eos_token_id)
    timer = FirstTokenTimer(streamer)
    input_ids = torch.tensor([list(ids)], device=model.device)
    if positions is not None:
        kwargs["position_ids"] = torch.tensor([list(positions)], dtype=torch.long, device=model.device)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         past_key_values=cache if cache is not None else DynamicCache(config=model.config),
                         max_new_tokens=max_new_tokens, streamer=timer, return_dict_in_generate=True,
                         output_logits=True, **kwargs)
    finished = time.perf_counter()
    logits = [step[0].float() for step in out.logits]
    new_ids = [int(t) for t in out.sequences[0, len(ids):].tolist()]
    return Generated(new_ids, logits[0], logits if all_logits else None, timer.first_token_at or finished,
                     finished), timer


def cache_for_decoding(model: PreTrainedModel, layout: Layout, max_new_tokens: int) -> DynamicCache:
    """The layout as a cache to decode from. Full-attention models get ``GrowingLayer`` s (every decode step
    appends in place, where ``DynamicLayer`` concatenates the whole cache per step: a fifth to a half of a CPU
    decode step at ~1k cached tokens): over the layout's own ``buffers`` when it was allocated with headroom (no
    copy; the cache then owns them), else over one copy of the layout. A model with sliding-window layers gets
    its own layer types (``Layout.to_cache``), whose window HF keeps."""
    if any(w is not None for w in layer_windows(model)):
        return layout.to_cache(model)
    headroom = max_new_tokens + 1
    if layout.buffers is not None:
        return hf.cache_of_layers([hf.GrowingLayer.over(k, v, layout.rows, headroom)
                                   for k, v in zip(*layout.buffers, strict=True)])
    return hf.cache_of_layers([hf.GrowingLayer.of(k, v, headroom)
                               for k, v in zip(layout.keys, layout.values, strict=True)])


def generate_from_layout(
    model: PreTrainedModel, layout: Layout, ids: Sequence[int], positions: Sequence[int] | None = None,
    **kwargs: Any,
) -> Generated:
    """Decode from an assembled ``layout`` holding every prompt row but the last (``layout.rows == len(ids) - 1``):
    the last token is computed by ``model.generate`` against it. Keyword arguments as ``generate_from_cache``."""
    if layout.rows != len(ids) - 1:
        raise ValueError(f"the layout must hold all but the last of the {len(ids)} prompt rows, has {layout.rows}")
    cache = cache_for_decoding(model, layout, int(kwargs.get("max_new_tokens", 1))) if layout.rows else None
    generated, _ = generate_from_cache(model, ids, positions, cache, **kwargs)
    return generated


def generate_prefilled(
    model: PreTrainedModel, layout: Layout, ids: Sequence[int], first_logits: torch.Tensor,
    positions: Sequence[int] | None = None, **kwargs: Any,
) -> Generated:
    """Decode from an assembled ``layout`` holding every prompt row (``layout.rows == len(ids)``) and the last
    row's next-token logits ``first_logits`` ``[vocab]``, both computed by the reuse engine: ``model.generate``
    takes them as its prefill (``hf.prefilled``) and runs no forward over the prompt, so TTFT pays no decode step
    for the last prompt token; sampling, logits processors, stopping criteria and streamers are ``generate``'s as
    in ``generate_from_layout``. With an argument whose decoding does not start from a prefill
    (``hf.NOT_PREFILLED``: assisted decoding, ``custom_generate``), the last row is left to ``generate`` instead.
    Keyword arguments as ``generate_from_cache``."""
    if layout.rows != len(ids):
        raise ValueError(f"the layout must hold all {len(ids)} prompt rows, has {layout.rows}")
    if any(kwargs.get(name) is not None for name in hf.NOT_PREFILLED):
        rest = Layout([k[:, :, :-1] for k in layout.keys], [v[:, :, :-1] for v in layout.values])
        return generate_from_layout(model, rest, ids, positions, **kwargs)
    cache = cache_for_decoding(model, layout, int(kwargs.get("max_new_tokens", 1)))
    with hf.prefilled(model, first_logits, cache) as prefill:
        generated, _ = generate_from_cache(model, ids, positions, cache, **kwargs)
    if not prefill.used:  # its output did not start from the engine's logits and cache: never returned
        raise UnsupportedModelError(
            f"model type {hf.model_type(model)!r}: model.generate decoded without asking for the prefill kvshelf "
            "handed it (this transformers release's or model's decoding loop does not call _prefill); kvshelf is "
            f"tested with transformers {hf.TESTED_VERSION}")
    return generated


@torch.inference_mode()
def greedy_with_bias(
    model: PreTrainedModel, cache: DynamicCache, prompt: Sequence[int], first_logits: torch.Tensor,
    next_position: int, max_new_tokens: int, *, eos: set[int], column_bias: torch.Tensor,
    streamer: BaseStreamer | None = None, all_logits: bool = False, **generate_kwargs: Any,
) -> Generated:
    """Greedy decoding from a filled ``cache`` with an additive ``column_bias`` ``[cache rows]`` on every step's
    attention logits (APE). The first token is ``argmax(first_logits)``; each later step runs the model on one
    token at ``next_position + i`` under an all-visible mask plus the bias. The streamer sees the prompt, then
    each new token. Sampling arguments are refused (``ConfigError``): this loop is greedy only."""
    asked = {k: v for k, v in generate_kwargs.items() if not (k == "do_sample" and not v)}
    if asked:
        raise ConfigError(f"APE (a column bias on the chunks) decodes greedily outside model.generate; "
                          f"{', '.join(sorted(asked))} cannot be used with it")
    if any(w is not None for w in layer_windows(model)):
        raise refusal(model, "a column bias (APE)", "sliding-window layers take HF's own masks when decoding")
    timer = FirstTokenTimer(streamer)
    emit_prompt(timer, list(prompt))
    token = int(torch.argmax(first_logits))
    emit_tokens(timer, [token])
    new_ids, logits, position = [token], [first_logits], next_position
    while len(new_ids) < max_new_tokens and token not in eos:
        kv_len = cache.get_seq_length() + 1
        mask = torch.zeros((1, 1, 1, kv_len), dtype=model.dtype, device=model.device)
        mask[0, 0, 0, : column_bias.shape[0]] += column_bias.to(mask)
        result = model(input_ids=torch.tensor([[token]], device=model.device),
                       position_ids=torch.tensor([[position]], device=model.device),
                       attention_mask=mask, past_key_values=cache, use_cache=True)
        step = result.logits[0, -1].float()
        token = int(torch.argmax(step))
        logits.append(step)
        new_ids.append(token)
        emit_tokens(timer, [token])
        position += 1
    timer.end()
    finished = time.perf_counter()
    return Generated(new_ids, first_logits, logits if all_logits else None, timer.first_token_at or finished,
                     finished)


def eos_set(model: PreTrainedModel, eos_token_id: int | Sequence[int] | None | str = EOS_DEFAULT) -> set[int]:
    """The ids that end a greedy loop (``"default"``: the model's generation config)."""
    if eos_token_id == EOS_DEFAULT:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}
