"""Simulated-engine settings: command-line flags, each with an environment variable default
(`KVSCHED_ENGINE_<FLAG>`), tracing from `OTEL_*`.

The engine model is configured exactly as the simulator configures its instances (a
`ClusterConfig` through `build_cluster`, see `services.engine.model`), so `--model-config`,
`--latency-profile`, `--block-size`, `--chunk-tokens` and `--max-running` mean what they mean
in a replay, and the defaults are the simulator's but one: `--model-config` defaults to a
model whose KV bytes fit a small machine, since the engine keeps real KV bytes.
"""

from __future__ import annotations

import argparse
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import get_args

from kvsched.core.cluster import ClusterConfig, Role
from kvsched.core.cost_model import default_pool_link
from kvsched.core.latency import DEFAULT_LATENCY
from kvsched.core.models import MINI_MODEL
from kvsched.core.topology import LinkClass
from kvsched.core.vllm_hashing import resolve_seed
from kvsched.data_files import data_path
from services.common.inference_api.chat_prompt import load_chat_template
from services.common.inference_api.openai_api import DEFAULT_MODEL
from services.common.serving.flags import env_flags, otlp_endpoint, pairs, process_id
from services.common.serving.logs import LogSettings, add_log_flags, read_log_settings
from services.dataplane import DEFAULT_KV_MEMORY_DIR, BlockHashes, add_block_hash_flags
from services.kv_events.vllm_wire import Shape

ENV = "KVSCHED_ENGINE_"
_flag = env_flags(ENV)
KV_TOPIC = "kv-events"
_SIM = ClusterConfig(n_instances=1)  # the simulator's engine defaults
_POOL_LINK = default_pool_link()  # the host link the cost model prices pool loads over


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Everything one simulated engine process is configured with."""

    instance_id: str = field(default_factory=process_id)
    listen: str = "127.0.0.1:8100"
    model: str = DEFAULT_MODEL  # the served name (what `model` in a request must say)
    tokenizer: str | None = None  # tokenizer directory or a file in one; None: the shipped one
    chat_template: str | None = None  # the template's text, in place of the tokenizer's
    block_size: int = _SIM.block_size
    # The architecture modelled (KV bytes, layers, context length). Not the simulator's
    # default: the engine keeps real KV bytes for its whole cache, which must fit this
    # machine's shared memory (give the Conductor the same as its --model).
    model_config: str = MINI_MODEL
    latency_profile: str = _SIM.latency_profile
    capacity_blocks: int = 0  # 0: from the latency profile's measured KV capacity
    max_model_len: int = 0  # 0: the model config's
    chunk_tokens: int = _SIM.chunk_tokens
    max_running: int = _SIM.max_running
    time_scale: float = 1.0  # wall seconds per simulated second (0.1: ten times faster)
    stream_interval: int = 1  # decode passes per step, i.e. tokens per streamed chunk
    kv_events: str = "tcp://127.0.0.1:*"  # ZMQ PUB endpoint (`*` port: any free one)
    kv_replay: str | None = None  # ZMQ ROUTER endpoint answering replay requests
    event_shape: Shape = "map"
    block_hashes: BlockHashes = field(default_factory=BlockHashes)  # as vLLM names blocks
    seed: int = 0
    shutdown_grace_s: float = 5.0  # SIGTERM: how long running streams may still finish
    otlp_endpoint: str | None = None
    log: LogSettings = field(default_factory=LogSettings)
    kv_memory_dir: str = DEFAULT_KV_MEMORY_DIR  # where the KV memory file lives (shared memory)
    kv_pool_socket: str | None = None  # the node's KV pool (its Messenger's socket); None: none
    # The host link a load from the pool crosses, charged in model time (the cost model's).
    pool_bandwidth_bytes_per_s: float = _POOL_LINK.bandwidth_bytes_per_s
    pool_setup_s: float = _POOL_LINK.setup_s
    role: Role = Role.BOTH  # what the Conductor may place here (reported, not enforced)
    # LoRA adapters, as vLLM's flags: served at all, how many at once, registered at start.
    enable_lora: bool = False
    max_loras: int = 1
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be positive")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be at least 1")
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if self.event_shape not in get_args(Shape):
            raise ValueError(f"--event-shape must be one of {get_args(Shape)}")
        if self.capacity_blocks < 0 or self.max_model_len < 0:
            raise ValueError("--capacity-blocks and --max-model-len must not be negative")
        if not self.kv_memory_dir:
            raise ValueError("--kv-memory-dir must name a directory")
        if not (self.pool_bandwidth_bytes_per_s > 0 and self.pool_setup_s >= 0):
            raise ValueError(
                "--pool-bandwidth must be positive and --pool-setup not negative, not "
                f"{self.pool_bandwidth_bytes_per_s} and {self.pool_setup_s}"
            )

    def cluster_config(self) -> ClusterConfig:
        """The one-instance cluster the simulator would build for this engine."""
        return ClusterConfig(
            n_instances=1,
            latency_profile=self.latency_profile,
            model=self.model_config,
            block_size=self.block_size,
            chunk_tokens=self.chunk_tokens,
            max_running=self.max_running,
            kv_capacity_tokens=self.capacity_blocks * self.block_size,
            pool_link=LinkClass(self.pool_bandwidth_bytes_per_s, self.pool_setup_s),
        )


def latency_profile_for_gpu(gpu: str, model: str) -> str:
    """The shipped latency profile measured on `gpu` (case-insensitive prefix of its GPU
    name, e.g. `h100`), preferring one measured for `model`, then one GPU an instance."""
    base = data_path("latency")
    found: list[tuple[bool, int, str]] = []
    for entry in sorted(base.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        raw = json.loads(entry.read_text(encoding="utf-8"))
        if str(raw.get("gpu", "")).lower().startswith(gpu.lower()):
            tp = int(raw.get("tp", 1))
            found.append((raw.get("model") != model, tp, entry.name.removesuffix(".json")))
    if not found:
        raise ValueError(f"no shipped latency profile was measured on a GPU named {gpu!r}")
    return min(found)[2]


def _seed(args: argparse.Namespace) -> str | None:
    """The engine's PYTHONHASHSEED: the flag's, else (for vLLM's XXH3 algorithms, which then
    seed themselves at random) a random one, else unset."""
    seed = args.prefix_hash_seed or None
    if resolve_seed(args.prefix_caching_hash_algo, seed) is None:
        return secrets.token_hex(16)
    return seed


def parse(argv: Sequence[str] | None = None) -> EngineSettings:
    d = EngineSettings(instance_id="")
    p = argparse.ArgumentParser(
        prog="kvsched engine", description="Run a simulated vLLM-compatible engine."
    )
    _flag(p, "listen", d.listen, "HTTP listen address (port 0: any free one)")
    _flag(p, "instance-id", "", "this engine's instance id (default host-pid)")
    _flag(p, "model", d.model, "served model name")
    _flag(p, "tokenizer", "", "tokenizer directory (default: the shipped demo tokenizer)")
    _flag(p, "chat-template", "", "chat template file or text, as vLLM's --chat-template")
    _flag(p, "block-size", d.block_size, "tokens per KV block")
    _flag(p, "model-config", d.model_config, "model architecture (KV size, context length)")
    _flag(p, "latency-profile", "", f"latency model profile (default {DEFAULT_LATENCY})")
    _flag(p, "gpu", "", "pick the shipped latency profile measured on this GPU (e.g. a100)")
    _flag(p, "capacity-blocks", d.capacity_blocks, "KV capacity in blocks (0: from the GPU)")
    _flag(p, "max-model-len", d.max_model_len, "context length (0: the model config's)")
    _flag(p, "chunk-tokens", d.chunk_tokens, "token budget of one forward pass")
    _flag(p, "max-running", d.max_running, "most requests admitted at once")
    _flag(p, "time-scale", d.time_scale, "wall seconds per simulated second (0.1: 10x faster)")
    _flag(p, "stream-interval", d.stream_interval, "decode passes (tokens) per streamed chunk")
    _flag(p, "kv-events", d.kv_events, "ZMQ endpoint publishing KV events")
    _flag(p, "kv-replay", "", "ZMQ endpoint answering KV-event replay requests (default off)")
    _flag(p, "event-shape", d.event_shape, "KV event encoding: map (vLLM >= 0.33) or array")
    add_block_hash_flags(_flag, p)
    _flag(p, "seed", d.seed, "seed of the engine's output text")
    _flag(p, "shutdown-grace", d.shutdown_grace_s, "seconds streams may finish on SIGTERM")
    _flag(p, "kv-memory-dir", d.kv_memory_dir, "directory of the KV memory file (shared memory)")
    _flag(p, "kv-pool-socket", "", "the node KV pool's socket, to save into and load from")
    _flag(p, "pool-bandwidth", d.pool_bandwidth_bytes_per_s, "host link bytes/s of pool loads")
    _flag(p, "pool-setup", d.pool_setup_s, "seconds each pool load adds to its bytes' time")
    _flag(p, "role", d.role.value, "what this engine serves: both, prefill or decode")
    _flag(p, "enable-lora", d.enable_lora, "serve LoRA adapters (as vLLM's flag)")
    _flag(p, "max-loras", d.max_loras, "adapters held at once (as vLLM's flag)")
    _flag(p, "lora-modules", "", "NAME=PATH[,...]: adapters registered at start")
    add_log_flags(_flag, p)
    a = p.parse_args(argv)
    roles = [r.value for r in Role]
    if a.role not in roles:
        p.error(f"--role must be one of {', '.join(roles)}, got {a.role!r}")
    profile = a.latency_profile
    if a.gpu:
        try:
            by_gpu = latency_profile_for_gpu(a.gpu, a.model_config)
        except ValueError as exc:
            p.error(str(exc))
        if profile and profile != by_gpu:
            p.error(f"--latency-profile {profile} contradicts --gpu {a.gpu} ({by_gpu})")
        profile = by_gpu
    try:
        return EngineSettings(
            instance_id=a.instance_id or process_id(),
            chat_template=load_chat_template(a.chat_template) if a.chat_template else None,
            listen=a.listen,
            model=a.model,
            tokenizer=a.tokenizer or None,
            block_size=a.block_size,
            model_config=a.model_config,
            latency_profile=profile or DEFAULT_LATENCY,
            capacity_blocks=a.capacity_blocks,
            max_model_len=a.max_model_len,
            chunk_tokens=a.chunk_tokens,
            max_running=a.max_running,
            time_scale=a.time_scale,
            stream_interval=a.stream_interval,
            kv_events=a.kv_events,
            kv_replay=a.kv_replay or None,
            event_shape=a.event_shape,
            block_hashes=BlockHashes(a.prefix_caching_hash_algo, _seed(a)),
            seed=a.seed,
            shutdown_grace_s=a.shutdown_grace,
            otlp_endpoint=otlp_endpoint(),
            log=read_log_settings(p, a),
            kv_memory_dir=a.kv_memory_dir,
            kv_pool_socket=a.kv_pool_socket or None,
            pool_bandwidth_bytes_per_s=a.pool_bandwidth,
            pool_setup_s=a.pool_setup,
            role=Role(a.role),
            enable_lora=a.enable_lora,
            max_loras=a.max_loras,
            lora_modules=pairs(a.lora_modules, "--lora-modules", "NAME=PATH"),
        )
    except ValueError as exc:
        p.error(str(exc))
