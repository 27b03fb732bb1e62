"""What the connector's scheduler side tells its workers each step: blocks to load from the
pool into vLLM's KV cache before the forward pass, and blocks to save from it into the pool
after. Values only; both sides speak in vLLM block ids and pool pages."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Copy pool pages `pages[i]` (of the pool's memory file `pool`) into vLLM blocks
    `block_ids[i]` (every layer), then end the pool's export `export_id` that pins them."""

    request_id: str
    pool: str
    export_id: str
    pages: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Copy vLLM blocks `block_ids[i]` into the staged pages `pages[i]` of the pool's memory
    file `pool` (every layer), then commit the pool's import `import_id` with the blocks'
    token ids (and the chain's cache salt, for a chain the pool holds nothing of; the LoRA
    adapter its blocks were computed with, for every block)."""

    request_id: str
    pool: str
    import_id: str
    pages: tuple[int, ...]
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    cache_salt: str | None
    adapter: tuple[str, str] | None = None  # (name, path), as vLLM's hashes name it


@dataclass
class StepJobs(KVConnectorMetadata):  # type: ignore[misc]
    """One step's loads and saves."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
