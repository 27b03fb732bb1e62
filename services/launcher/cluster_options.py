"""The options of `kvsched up`'s cluster (`ClusterOptions`): its shape, its engines and
models, and the checks that refuse a cluster that could not run, made when the options are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvsched.core.latency import load_latency
from kvsched.core.models import MINI_MODEL, model_config
from kvsched.core.policies import POLICIES, parse_spec
from services.common.inference_api.openai_api import DEFAULT_MODEL
from services.dataplane import BlockHashes
from services.launcher.vllm import DEFAULT_PYTHON as DEFAULT_VLLM_PYTHON

ENGINES = ("sim", "vllm")
# Tokens per KV block when none is given, by engine: the simulated engines model vLLM's GPU
# default (16); for vLLM the smallest size both its CPU attention (multiples of 32) and its
# GPU backends (multiples of 16) take, so that prefixes are matched as finely as they allow.
DEFAULT_BLOCK_SIZE = {"sim": 16, "vllm": 32}
DEFAULT_KV_POOL_BYTES = 512 << 20  # resident: 32,768 blocks of the tiny model


@dataclass(frozen=True)
class ClusterOptions:
    """The shape of the local cluster (`kvsched up --help` describes each)."""

    conductors: int = 1
    routers: int = 2
    nodes: int = 2
    engines_per_node: int = 2
    policy: str = "elastic"
    block_size: int = DEFAULT_BLOCK_SIZE["sim"]  # `kvsched up`: DEFAULT_BLOCK_SIZE[engine]
    time_scale: float = 1.0
    instance_ttl_s: int = 3
    leader_ttl_s: int = 2
    seed: int = 0
    model: str = DEFAULT_MODEL  # the served model name
    # The architecture the engines model (KV bytes per token, layers): by default one whose
    # real KV bytes fit this machine's memory (see kvsched.core.models).
    model_config: str = MINI_MODEL
    # The step-time profile the Conductors price placements with and the simulated engines
    # run (a shipped name or a profile .json, e.g. one `tools.fit_latency --engine` fitted to
    # vLLM's engines); its KV capacity is the Conductors' too. "": the default profile.
    latency_profile: str = ""
    transfer_backend: str = "tcp"
    engine: str = "sim"  # sim: our simulated engines; vllm: stock vLLM servers
    model_dir: Path | None = None  # the model vLLM serves (its tokenizer is the Routers')
    # More served models (name, directory): `engines_per_node` engines of each on every node,
    # like the first; the Routers pick the tokenizer by a request's model.
    more_models: tuple[tuple[str, Path], ...] = ()
    # LoRA adapters of the first model (name, directory): its engines hold `max_loras` at
    # once, loaded where the Conductor places their requests.
    lora_modules: tuple[tuple[str, Path], ...] = ()
    max_loras: int = 2
    # Embedding models (name, directory): one vLLM pooling engine of each on every node,
    # for `/v1/embeddings`.
    embedding_models: tuple[tuple[str, Path], ...] = ()
    vllm_python: Path = DEFAULT_VLLM_PYTHON  # the Python of vLLM's own environment
    max_model_len: int = 0  # vLLM engines' and Routers' context (0: the model's)
    tool_call_parser: str = "hermes"  # vLLM's parser of the model's tool calls ("": none)
    dtype: str = ""  # vLLM's --dtype ("": the model's)
    chat_template: Path | None = None  # a template file in place of the model's, for all
    # Each node's KV pool, where its vLLM engines save and load blocks (kvsched's KV
    # connector) and transfers stage KV; host memory set aside (made resident at start).
    kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES
    block_hashes: BlockHashes = field(default_factory=BlockHashes)
    api_keys: Path | None = None  # None: `up` makes one demo tenant and key
    engine_flags: tuple[str, ...] = ()  # passed to every engine as given
    messenger_flags: tuple[str, ...] = ()  # passed to every Messenger as given
    # Plaintext gRPC and etcd, no identities, admin HTTP open: as before mutual TLS.
    insecure: bool = False

    def __post_init__(self) -> None:
        for name in ("conductors", "routers", "nodes", "engines_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be positive")
        model_config(self.model_config)  # raises ValueError naming the known ones
        if self.latency_profile:
            load_latency(self.latency_profile)  # raises ValueError naming the known ones
        parse_spec(self.policy)
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}")
        if self.engine == "vllm" and self.model_dir is None:
            raise ValueError("--engine vllm needs --model DIR (e.g. tools/make_tiny_model.py's)")
        names = [name for name, _ in self.served_models()]
        if len(set(names)) != len(names):
            raise ValueError(f"two --model directories serve the same name: {names}")
        if self.engine == "vllm" and self.block_size % 32:
            raise ValueError("vLLM's CPU attention takes block sizes that are multiples of 32")
        if self.kv_pool_bytes < 0:
            raise ValueError("--kv-pool-bytes must not be negative")
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        adapters = [name for name, _ in self.lora_modules]
        if len(set(adapters)) != len(adapters) or set(adapters) & set(names):
            raise ValueError(f"each --lora needs a name of its own: {adapters}")
        embedders = [name for name, _ in self.embedding_models]
        if len(set(embedders)) != len(embedders) or set(embedders) & {*names, *adapters}:
            raise ValueError(f"each --embedding-model needs a name of its own: {embedders}")
        if embedders and self.engine != "vllm":
            raise ValueError("--embedding-model needs --engine vllm (vLLM's pooling runner)")
        if not self.kv_pool_bytes and any(r != "both" for r in engine_roles(self.policy, 2)):
            raise ValueError(
                f"policy {self.policy} hands KV from prefill to decode engines: engines move "
                "KV only through their nodes' KV pools (--kv-pool-bytes)"
            )

    def served_models(self) -> list[tuple[str, Path | None]]:
        """Every served model's name and directory, the first one's first (its directory
        None: the simulated engines' demo tokenizer)."""
        return [(self.model, self.model_dir), *self.more_models]


def engine_roles(policy: str, n: int) -> list[str]:
    """The role of each engine, in start order: what the policy wants of an n-instance
    cluster (prefill and decode pools for the disaggregated ones, else all both)."""
    name, params = parse_spec(policy)
    return [role.value for role in POLICIES[name].roles(n, params)]
