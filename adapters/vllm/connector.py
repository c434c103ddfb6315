"""``KVShelfConnector``: a vLLM v1 KV connector over any kvshelf ``BlockStore``.

Started by vLLM from ``kv_transfer_config`` (``kv_connector="KVShelfConnector"``,
``kv_connector_module_path="kvshelf.adapters.vllm"``, ``kv_role="kv_both"``, settings in
``kv_connector_extra_config``: ``adapters.vllm.config``). vLLM makes one instance per role: the scheduler's (in the
EngineCore process: looks blocks up, plans loads and saves, ``adapters.vllm.plan``) and the worker's (moves pages,
``adapters.vllm.worker``). Both open the store the settings name; in one process they share it (one LMDB
environment per process).

What it cannot do exactly it refuses at engine start, in the constructor, with one line (``UnsupportedModelError``
naming the model and why, ``ConfigError`` for settings): another platform than vLLM's CPU backend (its page layout
is the one read here), MLA, more than one KV cache group (hybrid models: recurrent or sliding-window layers beside
full attention), a sliding window or chunked local attention, a quantized KV cache, tensor or pipeline parallelism,
a head layout that differs from the HF model's (kvshelf keys blocks by the HF model's fingerprint), and, once the
caches are registered, a page layout the kernel writes that does not read back exactly (``probe_layout``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvshelf.adapters.vllm.config import ConnectorSettings
from kvshelf.adapters.vllm.events import KVShelfKVEvents, StoreEventCollector
from kvshelf.adapters.vllm.pages import PageLayout, read_pages
from kvshelf.adapters.vllm.plan import Planner, StepPlan
from kvshelf.adapters.vllm.worker import PageMover
from kvshelf.kvstore.errors import ConfigError, KVShelfError, UnsupportedModelError
from kvshelf.kvstore.protocol import BlockStore

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: how every refusal at engine start begins (vLLM repeats it in the error that ends the engine's start)
REFUSED = "kvshelf connector refused to start"
log = logging.getLogger("vllm.kvshelf")  # under vLLM's logger: shown in its log, in its format


@dataclass
class KVShelfMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, sent to the worker."""

    plan: StepPlan = field(default_factory=StepPlan)


#: the counters of ``KVShelfConnectorStats`` (``worker.WorkerCounts``' fields)
STAT_NAMES = ("loaded_blocks", "loaded_tokens", "failed_blocks", "saved_blocks")


@dataclass
class KVShelfConnectorStats(KVConnectorStats):
    """The worker's counts over one of vLLM's stats intervals (``STAT_NAMES``), summed across workers and steps;
    vLLM's stats logger shows them with its KV transfer metrics."""

    def __post_init__(self) -> None:
        for name in STAT_NAMES:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_NAMES, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in STAT_NAMES:
            self.data[name] = self.data.get(name, 0) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in STAT_NAMES}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in STAT_NAMES)


@dataclass(frozen=True)
class ModelInfo:
    """What both roles agree on about the served model."""

    fingerprint: str
    name: str  # the label blocks carry (``adapters.model_label``'s rule: the folder's name)
    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: int  # vLLM's block size
    dtype: torch.dtype


# -- one store and one fingerprint per process, shared by the two roles ----------------------------------------

_LOCK = threading.Lock()
_STORES: dict[tuple[str, str], list[Any]] = {}  # (url, namespace) -> [store, users]
_FINGERPRINTS: dict[tuple[str, str], tuple[str, tuple[int, int, int]]] = {}


def _acquire_store(url: str, namespace: str) -> BlockStore:
    from kvshelf.kvstore.store_url import open_store

    with _LOCK:
        entry = _STORES.get((url, namespace))
        if entry is None:
            entry = _STORES[(url, namespace)] = [open_store(url, namespace=namespace), 0]
        entry[1] += 1
        return entry[0]


def _release_store(url: str, namespace: str) -> None:
    with _LOCK:
        entry = _STORES.get((url, namespace))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _STORES[(url, namespace)]
            entry[0].close()


def _identify(folder: str, dtype: torch.dtype) -> tuple[str, tuple[int, int, int]]:
    """The HF fingerprint of ``folder`` in ``dtype`` and the HF model's ``(layers, kv_heads, head_dim)``."""
    from kvshelf.adapters.fingerprint import kv_geometry, mla_dims
    from kvshelf.adapters.vllm.fingerprint import fingerprint_of, meta_model

    with _LOCK:
        known = _FINGERPRINTS.get((folder, str(dtype)))
    if known is not None:
        return known
    model = meta_model(folder, dtype)
    if mla_dims(model.config):  # type: ignore[arg-type]
        raise UnsupportedModelError(f"{type(model).__name__}: multi-head latent attention (MLA): kvshelf's vLLM "
                                    "connector moves full-attention K/V pages only")
    geometry = kv_geometry(model)  # type: ignore[arg-type]
    result = fingerprint_of(model, folder, dtype), geometry
    with _LOCK:
        _FINGERPRINTS[(folder, str(dtype))] = result
    return result


def model_info(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> ModelInfo:
    """Check that the engine serves a model the connector moves exactly (see the module docstring); its facts."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mc = vllm_config.model_config
    arch = (getattr(mc.hf_config, "architectures", None) or [mc.hf_config.model_type])[0]
    if not current_platform.is_cpu():
        raise UnsupportedModelError(f"{arch}: kvshelf's vLLM connector reads the page layout of vLLM's CPU attention "
                                    f"backend only (this platform: {current_platform.device_name})")
    if mc.use_mla:
        raise UnsupportedModelError(f"{arch}: multi-head latent attention (MLA) is not supported by kvshelf's vLLM "
                                    "connector")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        raise UnsupportedModelError(f"{arch}: tensor or pipeline parallelism is not supported by kvshelf's vLLM "
                                    "connector (one worker holds every layer's pages)")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise UnsupportedModelError(f"{arch}: a quantized KV cache ({vllm_config.cache_config.cache_dtype}) is not "
                                    "supported: kvshelf stores the model's own K/V")
    if kv_cache_config is None:
        raise UnsupportedModelError(f"{arch}: vLLM gave the connector no KV cache config")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups}))
        raise UnsupportedModelError(f"{arch}: {len(groups)} KV cache groups ({kinds}): hybrid models (recurrent or "
                                    "sliding-window layers beside full attention) are not supported by kvshelf's "
                                    "vLLM connector")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        raise UnsupportedModelError(f"{arch}: KV cache spec {type(spec).__name__} (sliding-window, chunked local or "
                                    "another non-full attention): kvshelf's vLLM connector supports full attention "
                                    "only (a prefix's pages must hold the whole prefix's K/V)")
    if spec.sliding_window or spec.attention_chunk_size:
        raise UnsupportedModelError(f"{arch}: sliding-window or chunked local attention is not supported by "
                                    "kvshelf's vLLM connector (a prefix's pages are not the whole prefix's K/V)")
    if spec.head_size_v != spec.head_size:
        raise UnsupportedModelError(f"{arch}: keys and values of different head dims are not supported")
    folder = str(mc.model)
    if not Path(folder).is_dir():
        raise ConfigError(f"kvshelf's vLLM connector needs the model as a local folder (it fingerprints the "
                          f"checkpoint's weights); got {folder!r}")
    fingerprint, (layers, kv_heads, head_dim) = _identify(folder, mc.dtype)
    if (kv_heads, head_dim, layers) != (spec.num_kv_heads, spec.head_size, len(groups[0].layer_names)):
        raise UnsupportedModelError(
            f"{arch}: vLLM's KV layout (layers {len(groups[0].layer_names)}, kv heads {spec.num_kv_heads}, head dim "
            f"{spec.head_size}) differs from the HF model's ({layers}, {kv_heads}, {head_dim}): kvshelf cannot name "
            "these blocks as the HF model's")
    return ModelInfo(fingerprint, PurePath(folder).name, layers, kv_heads, head_dim,
                     vllm_config.cache_config.block_size, mc.dtype)


def probe_layout(kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PageLayout:
    """The page layout vLLM's CPU kernel writes for this geometry and dtype, measured: random K/V of one page are
    written by ``cpu_attn_reshape_and_cache`` (the kernel the engine uses) and must read back exactly."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(block_size, kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.zeros(2, kv_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(2, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size, 2 * block_size),
                                   isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    for transposed in (False, True):
        layout = PageLayout(kv_heads, block_size, head_dim, transposed)
        keys, values = read_pages([cache], [1], layout)
        if torch.equal(keys[0], key.permute(1, 0, 2)) and torch.equal(values[0], value.permute(1, 0, 2)):
            return layout
    raise UnsupportedModelError(f"vLLM's CPU attention kernel ({isa}, {dtype}, head dim {head_dim}) writes pages in "
                                "a layout kvshelf does not read back exactly")


class KVShelfConnector(KVConnectorBase_V1):
    """kvshelf's tiers, server and codecs behind vLLM's KV connector API (see the module docstring)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._store: BlockStore | None = None
        self._mover: PageMover | None = None
        self._planner: Planner | None = None
        self._reported: dict[str, int] = {}  # worker counts given to vLLM's stats so far
        self._collector: StoreEventCollector | None = None  # worker: the store's events of this namespace
        self._events: list[Any] = []  # scheduler: the workers' events not taken yet
        try:
            self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
            self.info = model_info(vllm_config, kv_cache_config)
            self.settings.check_block_size(self.info.page_tokens)
            self._store = _acquire_store(self.settings.store, self.settings.namespace)
        except KVShelfError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise type(exc)(f"{REFUSED}: {first}") from None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = Planner(self.info.fingerprint, self.settings.namespace, self.settings.block_tokens,
                                    self.info.page_tokens)
            # read by vLLM's scheduler after this constructor returns
            self._kv_transfer_config.kv_load_failure_policy = self.settings.load_failure_policy  # type: ignore
        log.info("kvshelf connector (%s): store %s, namespace %s, %d-token blocks, model %s (%s)", role.name,
                 self.settings.store, self.settings.namespace, self.settings.block_tokens, self.info.name,
                 self.info.fingerprint)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    # -- scheduler side ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        planner, store = self._planner, self._store
        assert planner is not None and store is not None
        prompt = list(request.prompt_token_ids or ())
        spans = planner.spans(prompt)
        stored = 0
        if spans:
            try:
                stored = store.lookup_prefix([s.key for s in spans], namespace=self.settings.namespace,
                                             model=self.info.name, tokens=[s.end - s.start for s in spans])
            except Exception as exc:  # noqa: BLE001 - a store that fails is a miss: vLLM computes the prompt
                log.warning("kvshelf connector: lookup failed (%s: %s); computing the prompt", type(exc).__name__,
                            exc)
        plan = planner.admit(request.request_id, prompt, spans, stored)
        plan.load_from = num_computed_tokens
        return max(0, planner.loadable(spans, len(prompt), stored) - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._planner is not None
        plan = self._planner.requests.get(request.request_id)
        if plan is not None:
            if num_external_tokens > 0:
                plan.load_to = plan.load_from + num_external_tokens
            else:
                plan.load_from = plan.load_to = 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        planner = self._planner
        assert planner is not None
        out = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            planner.set_pages(new.req_id, new.block_ids[0], replace=True)
            planner.step(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0), out)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                planner.set_pages(req_id, new_ids[0], replace=req_id in cached.resumed_req_ids)
            planner.step(req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), out)
        for req_id in scheduler_output.finished_req_ids:
            planner.drop(req_id)
        return KVShelfMetadata(out)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._planner is not None and connector_output.invalid_block_ids:
            self._planner.load_failed(set(connector_output.invalid_block_ids))
        events = connector_output.kv_cache_events
        if isinstance(events, KVShelfKVEvents):
            self._events.extend(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The store's events the workers reported since the last call (``adapters.vllm.events``); vLLM publishes
        them with its own when KV events are enabled."""
        events, self._events = self._events, []
        return events

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Frees nothing late (saves copy pages out in the step that computed them); the request's output carries
        ``kv_transfer_params={"kvshelf": RequestPlan.report()}``."""
        if self._planner is None:
            return False, None
        plan = self._planner.requests.pop(request.request_id, None)
        return False, ({"kvshelf": plan.report()} if plan is not None else None)

    # -- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        info = self.info
        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        want = (info.kv_heads, info.page_tokens, 2 * info.head_dim)
        for name, cache in ordered:
            if cache.dim() != 4 or tuple(cache.shape[1:]) != want or not cache.is_contiguous():
                raise UnsupportedModelError(
                    f"kvshelf connector: layer {name}'s KV cache is {tuple(cache.shape)} (contiguous: "
                    f"{cache.is_contiguous()}), not [blocks, {want[0]}, {want[1]}, {want[2]}] as vLLM's CPU backend "
                    "lays it out")
        if len(ordered) != info.layers:
            raise UnsupportedModelError(f"kvshelf connector: {len(ordered)} KV caches for {info.layers} layers")
        layout = probe_layout(info.kv_heads, info.page_tokens, info.head_dim, ordered[0][1].dtype)
        assert self._store is not None
        self._mover = PageMover(self._store, [cache for _, cache in ordered], layout, fingerprint=info.fingerprint,
                                namespace=self.settings.namespace, model_name=info.name,
                                max_pending_blocks=self.settings.max_pending_blocks)
        self._collector = StoreEventCollector(self._store, self.settings.namespace)

    def _plan(self) -> StepPlan | None:
        if self._mover is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVShelfMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and plan.loads:
            assert self._mover is not None
            self._mover.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole blocks are copied out in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None and plan.saves:
            assert self._mover is not None
            self._mover.save(plan)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The counts since the last call (vLLM sums them over its logging interval)."""
        if self._mover is None:
            return None
        now = {name: getattr(self._mover.counts, name) for name in STAT_NAMES}
        delta = {name: now[name] - self._reported.get(name, 0) for name in STAT_NAMES}
        self._reported = now
        stats = KVShelfConnectorStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVShelfConnectorStats(data=dict(data or {}))

    def get_kv_connector_kv_cache_events(self) -> KVShelfKVEvents | None:
        return self._collector.take() if self._collector is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._mover.take_errors() if self._mover is not None else set()

    def shutdown(self) -> None:
        if self._collector is not None:
            self._collector.close()
            if self._collector.dropped:
                log.warning("kvshelf connector: %d KV events dropped (no engine step took them in time)",
                            self._collector.dropped)
            self._collector = None
        if self._mover is not None:
            self._mover.close()
            log.info("kvshelf connector: %s", self._mover.counts)
            self._mover = None
        if self._store is not None:
            self._store = None
            _release_store(self.settings.store, self.settings.namespace)
