"""The simulated engine's model: the simulator's `Engine` configured exactly as a replay
configures its instances (a one-instance `ClusterConfig` through `build_cluster`), and the
limits a request must fit before it may join it."""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.cache.prefix_cache import PrefixCache
from kvsched.core.cluster import build_cluster
from kvsched.core.latency import LatencyModel
from kvsched.core.topology import LinkClass
from kvsched.sim.engine import Engine
from kvsched.sim.engine_state import EngineSpec
from services.common.inference_api.openai_api import bad_request
from services.engine.settings import EngineSettings


@dataclass(frozen=True, slots=True)
class EngineModel:
    """Static facts of this engine: the simulator's spec and latency model, the context
    length. Immutable; `new_engine` builds the scheduler state."""

    spec: EngineSpec
    latency: LatencyModel
    max_model_len: int
    pool_link: LinkClass  # host DRAM to GPU memory: what a load from the node's pool crosses
    kv_bytes_per_token: int

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def capacity_blocks(self) -> int:
        return self.spec.capacity_pages

    def pool_load_s(self, tokens: int) -> float:
        """Model seconds to load `tokens` tokens' KV from the node's pool over the host link
        (0 for none): what `kvsched.core.cost.pool_load` prices for the Conductor."""
        return self.pool_link.seconds(tokens * self.kv_bytes_per_token) if tokens > 0 else 0.0

    def new_engine(self, cache: PrefixCache) -> Engine:
        """Scheduler state over `cache` (the reference cache: the live engine reads its nodes)."""
        return Engine(0, self.spec, self.latency, cache=cache)

    def output_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """How many tokens a request gets: `max_tokens`, capped at the context the prompt
        leaves. Raises `ApiError` 400 for an empty prompt, a prompt that leaves no room (in
        vLLM's words), or a request that could never fit the KV memory (it would wait
        forever, since admission reserves pages for the whole output)."""
        if prompt_tokens == 0:
            raise bad_request("The prompt cannot be empty.", "prompt")
        room = self.max_model_len - prompt_tokens
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                "messages",
            )
        output = min(max_tokens, room)
        pages = -(-(prompt_tokens + output) // self.block_size)
        if pages > self.capacity_blocks:
            raise bad_request(
                f"The request needs {pages} KV blocks ({prompt_tokens} prompt and {output} "
                f"output tokens) but this engine holds {self.capacity_blocks}.",
                "max_tokens",
            )
        return output


def build_model(settings: EngineSettings) -> EngineModel:
    """The engine the simulator would run for these settings."""
    config = settings.cluster_config()
    cluster = build_cluster(config)
    cost = cluster.cost
    spec = EngineSpec(
        block_size=config.block_size,
        capacity_pages=cluster.capacity_blocks,
        chunk_tokens=config.chunk_tokens,
        max_running=config.max_running,
        layers=cost.model.layers,
    )
    return EngineModel(
        spec,
        cost.latency,
        settings.max_model_len or cost.model.max_model_len,
        cost.pool_link,
        cost.kv_bytes_per_token,
    )
