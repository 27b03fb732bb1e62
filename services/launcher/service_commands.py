"""The command line of each kind of process `kvsched up` starts: a Conductor, a Messenger, a
Router, and an engine (one of ours, simulated, or a stock vLLM server), given where
`plan_cluster` puts it (its addresses, its identity, its node's KV pool). Pure: nothing is
started here."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from services.common.security.identity import Identity, Role
from services.dataplane import BlockHashes
from services.launcher.cluster_options import ClusterOptions
from services.launcher.credentials import ClusterCredentials
from services.launcher.vllm import VllmServer, core_share, lora_rank


@dataclass(frozen=True)
class TlsFlags:
    """The TLS flags of every process: its certificate's files, or, in a cluster without
    credentials (`--insecure`), `--insecure` for its servers and nothing for its clients."""

    credentials: ClusterCredentials | None

    def server(self, prefix: str, identity: Identity) -> list[str]:
        if self.credentials is None:
            return ["--insecure"]
        return self.credentials.server_flags(prefix, identity)

    def client(self, prefix: str, identity: Identity) -> list[str]:
        return [] if self.credentials is None else self.credentials.client_flags(prefix, identity)


def hash_flags(hashes: BlockHashes) -> list[str]:
    """The flags that tell a service how the engines name blocks."""
    flags = ["--prefix-caching-hash-algo", hashes.algo]
    return flags + (["--prefix-hash-seed", hashes.seed] if hashes.seed is not None else [])


def conductor_argv(
    opts: ClusterOptions, tls: TlsFlags, me: Identity, *, listen: str, http_listen: str
) -> list[str]:
    """Conductor `me`, serving gRPC on `listen` and HTTP on `http_listen`."""
    argv = [sys.executable, "-m", "services.conductor", "--id", me.name, "--listen", listen]
    argv += ["--http-listen", http_listen, "--policy", opts.policy]
    argv += ["--block-size", str(opts.block_size), "--seed", str(opts.seed)]
    argv += ["--leader-ttl", str(opts.leader_ttl_s), "--instance-ttl", str(opts.instance_ttl_s)]
    argv += ["--time-scale", repr(opts.time_scale), "--model", opts.model_config]
    argv += hash_flags(opts.block_hashes)
    if opts.latency_profile:
        argv += ["--latency-profile", opts.latency_profile]
    argv += tls.server("tls-", me) + tls.client("messenger-tls-", me)
    if tls.credentials is not None:
        argv += ["--admin-token-file", str(tls.credentials.admin_token_file)]
    return argv


def messenger_argv(
    opts: ClusterOptions,
    tls: TlsFlags,
    node: str,
    *,
    listen: str,
    http_listen: str,
    conductors: str,
    engines: list[str],
    pool_socket: str,
) -> list[str]:
    """`node`'s Messenger, serving on `listen` and `http_listen`, registering `engines` (their
    `--engine` values) with the Conductors at `conductors`; with a `pool_socket`, it serves
    the node's KV pool there."""
    argv = [sys.executable, "-m", "services.messenger", "--listen", listen, "--node", node]
    argv += ["--http-listen", http_listen, "--conductor", conductors]
    for engine in engines:
        argv += ["--engine", engine]
    argv += ["--instance-ttl", str(opts.instance_ttl_s), *hash_flags(opts.block_hashes)]
    argv += ["--block-size", str(opts.block_size), "--transfer-backend", opts.transfer_backend]
    me = Identity(Role.MESSENGER, node)
    argv += tls.server("serve-tls-", me) + tls.client("tls-", me)
    if pool_socket:
        argv += ["--kv-pool-bytes", str(opts.kv_pool_bytes), "--kv-pool-socket", pool_socket]
    argv += opts.messenger_flags
    return argv


def router_argv(
    opts: ClusterOptions,
    tls: TlsFlags,
    me: Identity,
    *,
    listen: str,
    grpc_listen: str,
    conductors: str,
    api_keys: Path,
) -> list[str]:
    """Router `me`, serving HTTP on `listen` and gRPC on `grpc_listen`, its tenants' keys in
    `api_keys`, placing with the Conductors at `conductors`."""
    argv = [sys.executable, "-m", "services.router", "--listen", listen]
    argv += ["--grpc-listen", grpc_listen, "--conductor", conductors]
    argv += ["--api-keys", str(api_keys), "--block-size", str(opts.block_size)]
    argv += ["--model", opts.model, *hash_flags(opts.block_hashes)]
    argv += tls.server("grpc-tls-", me) + tls.client("conductor-", me)
    if opts.model_dir is not None:  # the served model's own tokenizer and chat template
        argv += ["--tokenizer", str(opts.model_dir)]
    if opts.more_models or opts.embedding_models:
        more = ",".join(
            f"{name}={path}" for name, path in (*opts.more_models, *opts.embedding_models)
        )
        argv += ["--model-tokenizer", more]
    if opts.lora_modules:  # the paths the engines load them from: their blocks' hashes
        adapters = ",".join(f"{name}={path}" for name, path in opts.lora_modules)
        argv += ["--lora-modules", adapters]
    if opts.chat_template is not None:
        argv += ["--chat-template", str(opts.chat_template)]
    if opts.max_model_len:
        argv += ["--max-model-len", str(opts.max_model_len)]
    return argv


@dataclass(frozen=True)
class EngineCommand:
    """An engine's process, and how its Messenger names it."""

    argv: tuple[str, ...]
    env: dict[str, str]  # added to the inherited environment
    engine_flag: str  # its Messenger's `--engine` value


def engine_command(
    opts: ClusterOptions,
    *,
    iid: str,
    model: tuple[str, Path | None],
    role: str,
    ports: tuple[int, int, int],
    core: tuple[int, int],
    pool_socket: str,
    lora: bool = False,
    embedding: bool = False,
) -> EngineCommand:
    """Engine `iid` serving `model` (its name and directory; with `lora`, the cluster's
    adapters too) in `role`, on loopback `ports` (HTTP, KV events, KV replay), the `core[0]`th
    of `core[1]` engines on this machine: a simulated one, or a vLLM server."""
    name_served, model_dir = model
    port, kv_port, replay_port = ports
    url = f"http://127.0.0.1:{port}"
    if opts.engine == "vllm":
        assert model_dir is not None  # checked by ClusterOptions
        server = VllmServer(
            python=opts.vllm_python,
            model_dir=model_dir,
            served_name=name_served,
            port=port,
            kv_port=kv_port,
            replay_port=replay_port,
            block_size=opts.block_size,
            hash_algo=opts.block_hashes.algo,
            hash_seed=opts.block_hashes.seed,
            max_model_len=opts.max_model_len,
            cpu_cores=core_share(*core),
            tool_call_parser="" if embedding else opts.tool_call_parser,
            dtype=opts.dtype,
            chat_template="" if opts.chat_template is None else str(opts.chat_template),
            pool_socket=pool_socket,
            max_loras=opts.max_loras if lora else 0,
            max_lora_rank=lora_rank([d for _, d in opts.lora_modules]) if lora else 0,
            embedding=embedding,
        )
        argv = (*server.argv(), *opts.engine_flags)
        loras = f",max_loras={opts.max_loras}" if lora else ""
        return EngineCommand(argv, server.env(), f"{url},kind=vllm,id={iid},role={role}{loras}")
    sim = [sys.executable, "-m", "services.engine", "--listen", f"127.0.0.1:{port}"]
    sim += ["--instance-id", iid, "--kv-events", f"tcp://127.0.0.1:{kv_port}"]
    sim += ["--kv-replay", f"tcp://127.0.0.1:{replay_port}"]
    sim += ["--block-size", str(opts.block_size), "--time-scale", repr(opts.time_scale)]
    sim += ["--model", name_served, "--model-config", opts.model_config, "--role", role]
    sim += ["--seed", str(opts.seed), *hash_flags(opts.block_hashes)]
    if opts.latency_profile:
        sim += ["--latency-profile", opts.latency_profile]
    if pool_socket:
        sim += ["--kv-pool-socket", pool_socket]
    sim += opts.engine_flags
    if model_dir is not None:
        sim += ["--tokenizer", str(model_dir)]
    if opts.chat_template is not None:
        sim += ["--chat-template", str(opts.chat_template)]
    env = {}
    if lora:  # runtime loads, as vLLM's (services.engine.lora)
        sim += ["--enable-lora", "--max-loras", str(opts.max_loras)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return EngineCommand(tuple(sim), env, f"{url},kind=sim")
