"""Prompt modules (Prompt Cache, Gim et al., MLSys 2024) for HF models through a kvshelf store.

``PromptModuleGenerator(model, tokenizer, store, schema)`` compiles a ``reuse.schema.PromptSchema`` (markup or
Python), ``precompute()``s each module's KV at its schema positions (pinned in the store), and ``generate``s from a
prompt (markup or a list of ``ModuleUse`` / free text): the modules' KV is loaded and only parameter values and
free text are prefilled, at their positions. A prompt whose modules sit at their schema positions with no gap
before the free text (a module at 0, or ``scope="prefix"`` modules after their predecessors) gives the same KV,
and so the same output, as full prefill; independently encoded later modules and text after a parameter slot do
not see what comes before them (the paper's approximation).

Decoding goes through HF ``model.generate`` (``adapters.decode``): the assembled cache holds every prompt row but
the last, and ``generate`` computes the last one at its schema position (explicit ``position_ids``, gaps
included), so sampling arguments, logits processors and streamers work as on a plain prompt; ``stream(...)``
iterates the new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvshelf.adapters.decode import EOS_DEFAULT, generate_from_layout
from kvshelf.adapters.fingerprint import model_fingerprint
from kvshelf.adapters.hf import BaseStreamer
from kvshelf.adapters.lifecycle import Closable
from kvshelf.adapters.model_label import label_blocks
from kvshelf.adapters.prompts import prompt_ids
from kvshelf.adapters.reuse_engine import Layout, check_engine, check_positions, prefill_rows
from kvshelf.adapters.streaming import TokenStream
from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError
from kvshelf.kvstore.protocol import BlockStore, namespace_of
from kvshelf.reuse.errors import SchemaError
from kvshelf.reuse.keys import module_key
from kvshelf.reuse.schema import Assembly, CompiledModule, PromptItem, PromptSchema, assemble, parse_prompt

FEATURE = "prompt modules"  # what a refusal names (``UnsupportedModelError``)


@dataclass(frozen=True)
class ModuleResult:
    new_ids: list[int]
    text: str | None
    prompt_tokens: int
    reused_tokens: int  # module tokens whose KV came from the store
    prefilled_tokens: int
    ttft_s: float
    total_s: float
    assembly: Assembly = field(repr=False)
    first_logits: torch.Tensor = field(repr=False)  # [vocab] float32, raw (before any logits processor)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # all_logits=True: [vocab] per new token


class PromptModuleGenerator(Closable):
    """Generate from prompts assembled from a schema's cached modules plus parameters and free text.

    ``close()`` (or leaving a ``with`` block) ends the generator and drops the modules it keeps in memory; any
    later call raises ``ConfigError``. The store is the caller's and stays open."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, store: BlockStore | None,
                 schema: PromptSchema | str, *, namespace: str | None = None) -> None:
        self.rotaries = check_engine(model, FEATURE)  # refuses families the engine cannot drive, before any work
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.namespace = namespace_of(store, namespace)
        self.schema = PromptSchema.from_markup(schema) if isinstance(schema, str) else schema
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.compiled = self.schema.compile(self.tokenize, self.max_positions)
        # modules are computed at their positions: a length-dependent RoPE must be static up to the last one
        check_positions(model, self.rotaries, max((m.end for m in self.compiled.modules), default=0), FEATURE)
        self._by_name = {m.name: m for m in self.compiled.modules}
        # pinned modules' KV, decoded once and kept in memory (raw tensors): no store read, checksum or decode per
        # prompt; the store keeps the durable, shareable copy
        self._resident: dict[bytes, KVBlock] = {}

    def close(self) -> None:
        """End this generator: resident modules are dropped, later calls raise ``ConfigError``."""
        super().close()
        self._resident.clear()

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint now: it follows the model's dtype and weights (``model_fingerprint``)."""
        return model_fingerprint(self.model)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a piece of the prompt (a module's text, a parameter value): no special tokens."""
        return prompt_ids(text, self.tokenizer, add_special_tokens=False)

    def key(self, module: CompiledModule, fingerprint: str | None = None) -> bytes:
        scope = [t for name in module.scope for t in self._by_name[name].tokens]
        return module_key(fingerprint or self.fingerprint, self.namespace, module.tokens, module.positions, scope)

    def _compute(self, module: CompiledModule, done: dict[str, KVBlock], fingerprint: str) -> KVBlock:
        """A module's KV at its positions, after its scope modules (their KV in ``done``)."""
        scope = [done[name] for name in module.scope]
        rows_before = sum(b.num_tokens for b in scope)
        layout = Layout.empty(self.model, rows_before + len(module.tokens))
        row = 0
        for block in scope:
            layout.fill(row, block.keys, block.values)
            row += block.num_tokens
        rows = list(range(rows_before, layout.rows))
        prefill_rows(self.model, layout, module.tokens, module.positions, rows)
        k, v = layout.take(torch.tensor(rows))
        return label_blocks([KVBlock(k, v, module.tokens, module.start, fingerprint, self.namespace)], self.model)[0]

    @torch.inference_mode()
    def module_blocks(self, names: Sequence[str], *, pin: bool = True) -> tuple[dict[str, KVBlock], int]:
        """KV of ``names`` (and their scopes), from the store or computed and stored pinned; (blocks, computed)."""
        self._check_open()
        needed: list[str] = []
        for name in names:
            for dep in (*self._by_name[name].scope, name):
                if dep not in needed:
                    needed.append(dep)
        needed.sort(key=lambda n: [m.name for m in self.compiled.modules].index(n))
        fingerprint = self.fingerprint  # this call's: a changed model gets other keys, never a resident block
        keys = [self.key(self._by_name[n], fingerprint) for n in needed]
        loaded: list[KVBlock | None] = [self._resident.get(k) for k in keys]
        wanted = [i for i, block in enumerate(loaded) if block is None]
        if wanted and self.store is not None:
            got = self.store.get_many([keys[i] for i in wanted], fingerprint=fingerprint,
                                      namespace=self.namespace, copy=True)  # owned tensors: they may stay resident
            for i, block in zip(wanted, got, strict=True):
                loaded[i] = block
        done: dict[str, KVBlock] = {}
        computed = 0
        for name, key, block in zip(needed, keys, loaded, strict=True):
            module = self._by_name[name]
            if block is not None and list(block.token_ids) != list(module.tokens):
                raise SchemaError(f"stored KV of module {name!r} does not match its tokens")
            if block is None:
                block = self._compute(module, done, fingerprint)
                computed += 1
                if self.store is not None:
                    self.store.put_many([(key, block)], pin=pin)
            if pin:
                self._resident[key] = block
            done[name] = block
        return done, computed

    def precompute(self, *, pin: bool = True) -> dict[str, Any]:
        """Compute and store (pinned) every module not yet stored; returns ``{"modules", "computed", "tokens"}``."""
        names = [m.name for m in self.compiled.modules]
        _, computed = self.module_blocks(names, pin=pin)
        return {"modules": len(names), "computed": computed,
                "tokens": sum(len(m.tokens) for m in self.compiled.modules)}

    def assemble(self, prompt: str | Sequence[PromptItem], max_new_tokens: int = 0) -> Assembly:
        if isinstance(prompt, str):
            schema_name, items = parse_prompt(prompt)
            if schema_name is not None and schema_name != self.compiled.name:
                raise SchemaError(f"the prompt names schema {schema_name!r}, this generator has {self.compiled.name!r}")
        else:
            items = list(prompt)
        return assemble(self.compiled, items, self.tokenize, max_positions=self.max_positions,
                        max_new_tokens=max_new_tokens)

    @torch.inference_mode()
    def generate(self, prompt: str | Sequence[PromptItem], *, max_new_tokens: int = 32, reuse: bool = True,
                 eos_token_id: int | Sequence[int] | None | str = EOS_DEFAULT, streamer: BaseStreamer | None = None,
                 all_logits: bool = False, **generate_kwargs: Any) -> ModuleResult:
        """Generate from ``prompt``. ``reuse=False`` prefills every row (modules included) at the same positions.

        Decoding is HF ``model.generate``'s (greedy by default): ``generate_kwargs`` (``do_sample``,
        ``temperature``, ``top_k``, ``logits_processor``...) go to it. ``streamer`` (a HF ``BaseStreamer``)
        receives the prompt, then each new token; TTFT is measured all the same. ``eos_token_id``: ``"default"``
        (the model's), ``None`` or ids. ``all_logits``: keep every step's raw logits in ``ModuleResult.logits``.
        """
        self._check_open()
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        started = time.perf_counter()
        assembly = self.assemble(prompt, max_new_tokens)
        check_positions(self.model, check_engine(self.model, FEATURE), assembly.positions[-1] + 1 + max_new_tokens,
                        FEATURE)
        n = len(assembly.tokens)
        # the cache holds every row but the last, which model.generate computes (its logits give the first token)
        layout = Layout.empty(self.model, n - 1, zero=False)  # every row is loaded or prefilled below
        cached = [c is not None for c in assembly.cached_by] if reuse else [False] * n
        cached[-1] = False
        if reuse:
            blocks, _ = self.module_blocks([m.name for m in assembly.modules])
            for module in assembly.modules:
                rows = [i for i, c in enumerate(assembly.cached_by) if c == module.name]
                keep = [k for k, row in enumerate(rows) if row < n - 1]  # a module ending the prompt: not its last
                block = blocks[module.name]
                if keep:
                    layout.fill_rows(torch.tensor([rows[k] for k in keep]), block.keys[:, :, keep],
                                     block.values[:, :, keep])
        rows = [i for i in range(n - 1) if not cached[i]]
        if rows:
            prefill_rows(self.model, layout, [assembly.tokens[i] for i in rows],
                         [assembly.positions[i] for i in rows], rows)
        generated = generate_from_layout(
            self.model, layout, list(assembly.tokens), list(assembly.positions), max_new_tokens=max_new_tokens,
            tokenizer=self.tokenizer, eos_token_id=eos_token_id, streamer=streamer, all_logits=all_logits,
            **generate_kwargs)
        text = self.tokenizer.decode(generated.new_ids, skip_special_tokens=True) if self.tokenizer else None
        prefilled = len(rows) + 1  # the last row, computed by generate
        return ModuleResult(generated.new_ids, text, n, n - prefilled, prefilled,
                            generated.first_token_at - started, generated.finished_at - started, assembly,
                            generated.first_logits, generated.logits)

    def stream(self, prompt: str | Sequence[PromptItem], **kwargs: Any) -> TokenStream[ModuleResult]:
        """``generate`` as an iterator of new token ids (``streaming.TokenStream``: ``.texts()``, ``.result``);
        keyword arguments as ``generate`` (a ``streamer`` of your own is not taken here)."""
        self._check_open()
        if "streamer" in kwargs:
            raise ConfigError("stream() makes its own streamer; use generate(streamer=...) to pass one")
        return TokenStream(lambda streamer: self.generate(prompt, streamer=streamer, **kwargs), self.tokenizer)
