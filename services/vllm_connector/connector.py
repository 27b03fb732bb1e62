"""`KvschedConnector`: vLLM's KV connector API (`KVConnectorBase_V1`) over the node's KV pool.

Loaded by a stock vLLM with

    --kv-transfer-config '{"kv_connector": "KvschedConnector",
        "kv_connector_module_path": "services.vllm_connector.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool_socket": "<the Messenger's --kv-pool-socket>"}}'

(`kvsched up --engine vllm` passes it). The scheduler side is `scheduler_side`, the worker
side `worker_side`; this class only routes vLLM's calls to them. Loads are synchronous (done
within the step that needs them, layer by layer), saves are copied in the step that computed
them (and committed after it), so no request's blocks outlive it here: nothing is freed late
and `get_finished` has nothing to report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from services.vllm_connector.metadata import StepJobs
from services.vllm_connector.pool_client import PoolClient
from services.vllm_connector.scheduler_side import SchedulerSide
from services.vllm_connector.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

DEFAULT_HOLD_S = 60.0  # a pin or a staged save the pool keeps at most, should we die


class KvschedConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvsched's connector: one per scheduler and one per worker of a vLLM engine."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        socket = extra.get("pool_socket")
        if not isinstance(socket, str) or not socket:
            raise ValueError("KvschedConnector needs kv_connector_extra_config.pool_socket")
        hold_s = float(extra.get("hold_s", DEFAULT_HOLD_S))
        block_size = vllm_config.cache_config.block_size
        client = PoolClient(socket)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(client, block_size, self._block_ids, hold_s=hold_s)
        else:
            self._worker = WorkerSide(client, block_size, current_platform.device_type)
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0

    def _block_ids(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None
        ids: list[int] = self._kv_cache_manager.get_block_ids(request_id)[0]
        return ids

    # ---- worker ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, StepJobs)
        self._worker.begin_step(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    # ---- scheduler ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.step_jobs(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request)
        return False, None
