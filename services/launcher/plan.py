"""What `kvsched up` starts: every process's command line, address and readiness check,
decided up front from the options (pure: no process is started here)."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsched.core.latency import load_latency
from kvsched.core.models import MINI_MODEL, model_config
from kvsched.core.policies import POLICIES, parse_spec
from services.common.block_hashes import BlockHashes
from services.common.identity import Identity, Role
from services.common.openai_api import DEFAULT_MODEL
from services.common.tls import ClientTls
from services.launcher.credentials import ETCD, ClusterCredentials
from services.launcher.etcd_local import etcd_argv, etcd_env
from services.launcher.ports import Ports
from services.launcher.vllm import DEFAULT_PYTHON as DEFAULT_VLLM_PYTHON
from services.launcher.vllm import VllmServer, core_share, lora_rank

ENGINES = ("sim", "vllm")
# Tokens per KV block when none is given, by engine: the simulated engines model vLLM's GPU
# default (16); for vLLM the smallest size both its CPU attention (multiples of 32) and its
# GPU backends (multiples of 16) take, so that prefixes are matched as finely as they allow.
DEFAULT_BLOCK_SIZE = {"sim": 16, "vllm": 32}
DEFAULT_KV_POOL_BYTES = 512 << 20  # resident: 32,768 blocks of the tiny model
READY_TIMEOUT_S = 60.0  # for a process to serve, unless its Child says otherwise

# Start order; stopping goes the other way, so nothing loses what it depends on first.
STAGES = ("etcd", "conductor", "engine", "messenger", "router")


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


@dataclass(frozen=True)
class Child:
    """One process of the cluster."""

    name: str  # unique, e.g. "engine-n1-e0"
    stage: str  # one of STAGES
    argv: tuple[str, ...]
    ready_url: str  # answers 200 once the process serves
    endpoint: dict[str, Any]  # its entry in the endpoints file (without the pid)
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    clean_env: bool = False  # start from `etcd_env()` rather than os.environ
    ready_timeout_s: float = READY_TIMEOUT_S
    ready_tls: ClientTls | None = None  # the readiness check's client certificate (etcd's)


@dataclass(frozen=True)
class ClusterPlan:
    options: ClusterOptions
    children: tuple[Child, ...]
    api_key: str  # the demo tenant's key ("" when the caller gave --api-keys)
    credentials: ClusterCredentials | None = None  # None: --insecure

    def stage(self, stage: str) -> list[Child]:
        return [c for c in self.children if c.stage == stage]

    def endpoints(self, pids: dict[str, int]) -> dict[str, Any]:
        """The endpoints file: `{"model", "models", "etcd", "conductors", "routers",
        "messengers", "engines"}` (the first served model and all of them), each process with
        its pid, plus what a load generator needs to know."""
        out: dict[str, Any] = {"model": self.options.model}
        out["models"] = [name for name, _ in self.options.served_models()]
        groups = {"conductor": "conductors", "router": "routers", "messenger": "messengers"}
        groups["engine"] = "engines"
        for child in self.children:
            entry = {**child.endpoint, "pid": pids.get(child.name, 0)}
            if child.stage == "etcd":
                out["etcd"] = entry
            else:
                out.setdefault(groups[child.stage], []).append(entry)
        out["api_key"] = self.api_key
        if self.credentials is not None:
            out["admin"] = self.credentials.endpoint()
        out["model_config"] = self.options.model_config
        if self.options.latency_profile:
            out["latency_profile"] = self.options.latency_profile
        out["policy"] = self.options.policy
        out["block_size"] = self.options.block_size
        out["time_scale"] = self.options.time_scale
        out["engine"] = self.options.engine
        return out


def hash_flags(hashes: BlockHashes) -> list[str]:
    """The flags that tell a service how the engines name blocks."""
    flags = ["--prefix-caching-hash-algo", hashes.algo]
    return flags + (["--prefix-hash-seed", hashes.seed] if hashes.seed is not None else [])


def plan_cluster(opts: ClusterOptions, run_dir: Path, api_keys: Path, api_key: str) -> ClusterPlan:
    """Ports, ids and flags for every process; `api_keys` is the Routers' key file. Unless
    `opts.insecure`, every process gets its certificate (`ClusterCredentials`, minted when
    the supervisor starts the cluster) and serves and calls mutual TLS."""
    py = (sys.executable, "-m")
    free_port = Ports()
    children: list[Child] = []
    creds = None if opts.insecure else ClusterCredentials.for_run(run_dir, identities(opts))

    def server_tls(prefix: str, identity: Identity) -> list[str]:
        return ["--insecure"] if creds is None else creds.server_flags(prefix, identity)

    def client_tls(prefix: str, identity: Identity) -> list[str]:
        return [] if creds is None else creds.client_flags(prefix, identity)

    etcd_port, peer_port = free_port(), free_port()
    scheme = "http" if creds is None else "https"
    etcd_url = f"{scheme}://127.0.0.1:{etcd_port}"
    etcd_tls = None if creds is None else creds.files(ETCD)
    peer_url = f"{scheme}://127.0.0.1:{peer_port}"
    argv = etcd_argv("kvsched-up", run_dir / "etcd", etcd_url, peer_url, etcd_tls)
    ready_tls = None if creds is None else creds.admin.client()
    etcd_entry: dict[str, Any] = {"url": etcd_url}
    children.append(
        Child(
            "etcd",
            "etcd",
            tuple(argv),
            f"{etcd_url}/health",
            etcd_entry,
            clean_env=True,
            ready_tls=ready_tls,
        )
    )
    scale = repr(opts.time_scale)
    hashing = hash_flags(opts.block_hashes)
    profile_flags = ["--latency-profile", opts.latency_profile] if opts.latency_profile else []

    conductor_urls = []
    for i in range(opts.conductors):
        port, http_port = free_port(), free_port()
        url, http_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        conductor_urls.append(url)
        me = Identity(Role.CONDUCTOR, f"conductor-{i}")
        etcd_env_vars = {"KVSCHED_ETCD_ENDPOINTS": etcd_url}
        if creds is not None:
            etcd_env_vars.update(creds.etcd_env(me))
        argv = [*py, "services.conductor", "--id", me.name, "--listen", url]
        argv += ["--http-listen", http_url.removeprefix("http://"), "--policy", opts.policy]
        argv += ["--block-size", str(opts.block_size), "--seed", str(opts.seed)]
        argv += ["--leader-ttl", str(opts.leader_ttl_s), "--instance-ttl", str(opts.instance_ttl_s)]
        argv += ["--time-scale", scale, "--model", opts.model_config, *hashing]
        argv += profile_flags
        argv += server_tls("tls-", me) + client_tls("messenger-tls-", me)
        if creds is not None:
            argv += ["--admin-token-file", str(creds.admin_token_file)]
        ready = f"{http_url}/api/leader"
        entry = {"url": url, "http_url": http_url}
        children.append(
            Child(f"conductor-{i}", "conductor", tuple(argv), ready, entry, etcd_env_vars)
        )
    conductors = ",".join(conductor_urls)

    per_model = opts.nodes * opts.engines_per_node
    roles = engine_roles(opts.policy, per_model)  # each model's engines take them alike
    models = opts.served_models()
    embedders = opts.embedding_models
    engine_count = len(models) * per_model + opts.nodes * len(embedders)
    pooled = opts.kv_pool_bytes > 0
    for n in range(opts.nodes):
        node = f"node-{n}"
        socket = pool_socket(run_dir, node) if pooled else ""
        engines = []  # the Messenger's --engine values
        for m, (name, model_dir) in enumerate(models):
            for e in range(opts.engines_per_node):
                index = n * opts.engines_per_node + e  # within the model's engines
                child, engine = _engine(
                    opts,
                    free_port,
                    node=node,
                    iid=f"{node}-e{m * opts.engines_per_node + e}",
                    model=(name, model_dir),
                    role=roles[index],
                    core=(m * per_model + index, engine_count),
                    pool_socket=socket,
                    lora=m == 0 and bool(opts.lora_modules),
                )
                children.append(child)
                engines.append(engine)
        for k, (name, model_dir) in enumerate(embedders):
            child, engine = _engine(
                opts,
                free_port,
                node=node,
                iid=f"{node}-embed{k}",
                model=(name, model_dir),
                role="both",
                core=(len(models) * per_model + n * len(embedders) + k, engine_count),
                pool_socket="",  # it computes no KV a generator could reuse
                embedding=True,
            )
            children.append(child)
            engines.append(engine)
        port, http_port = free_port(), free_port()
        url = f"127.0.0.1:{port}"
        argv = [*py, "services.messenger", "--listen", url, "--node", node]
        argv += ["--http-listen", f"127.0.0.1:{http_port}", "--conductor", conductors]
        for engine in engines:
            argv += ["--engine", engine]
        argv += ["--instance-ttl", str(opts.instance_ttl_s), *hashing]
        argv += ["--block-size", str(opts.block_size), "--transfer-backend", opts.transfer_backend]
        me = Identity(Role.MESSENGER, node)
        argv += server_tls("serve-tls-", me) + client_tls("tls-", me)
        if socket:
            argv += ["--kv-pool-bytes", str(opts.kv_pool_bytes), "--kv-pool-socket", socket]
        argv += opts.messenger_flags
        ready = f"http://127.0.0.1:{http_port}/ready"
        entry = {"url": url, "node": node, "http_url": f"http://127.0.0.1:{http_port}"}
        children.append(Child(f"messenger-{node}", "messenger", tuple(argv), ready, entry))

    for r in range(opts.routers):
        port, grpc_port = free_port(), free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [*py, "services.router", "--listen", f"127.0.0.1:{port}"]
        argv += ["--grpc-listen", f"127.0.0.1:{grpc_port}", "--conductor", conductors]
        argv += ["--api-keys", str(api_keys), "--block-size", str(opts.block_size)]
        argv += ["--model", opts.model, *hashing]
        me = Identity(Role.ROUTER, f"router-{r}")
        argv += server_tls("grpc-tls-", me) + client_tls("conductor-", me)
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
        entry = {"url": url, "grpc_url": f"127.0.0.1:{grpc_port}"}
        children.append(Child(f"router-{r}", "router", tuple(argv), f"{url}/health", entry))
    return ClusterPlan(opts, tuple(children), api_key, creds)


def identities(opts: ClusterOptions) -> tuple[Identity, ...]:
    """Every component's identity: the Conductors, one Messenger a node, the Routers."""
    ids = [Identity(Role.CONDUCTOR, f"conductor-{i}") for i in range(opts.conductors)]
    ids += [Identity(Role.MESSENGER, f"node-{n}") for n in range(opts.nodes)]
    ids += [Identity(Role.ROUTER, f"router-{r}") for r in range(opts.routers)]
    return tuple(ids)


def pool_socket(run_dir: Path, node: str) -> str:
    """Where `node`'s Messenger serves its KV pool: a Unix socket, whose path must stay
    short (108 bytes at most), so in a private folder of the temp dir, named after the run."""
    run = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return str(Path(tempfile.gettempdir()) / f"kvsched-{os.getuid()}" / f"{run}-{node}.sock")


def _engine(
    opts: ClusterOptions,
    free_port: Ports,
    *,
    node: str,
    iid: str,
    model: tuple[str, Path | None],
    role: str,
    core: tuple[int, int],
    pool_socket: str,
    lora: bool = False,
    embedding: bool = False,
) -> tuple[Child, str]:
    """Engine `iid` serving `model` (its name and directory; with `lora`, the cluster's
    adapters too), the `core[0]`th of `core[1]` on this machine (a simulated one, or a vLLM
    server: minutes to start on a CPU), and its Messenger's `--engine` value."""
    name_served, model_dir = model
    port, kv_port, replay_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    entry = {"id": iid, "url": url, "node": node, "model": name_served}
    name, ready = f"engine-{iid}", f"{url}/health"
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
        child = Child(name, "engine", argv, ready, entry, server.env(), ready_timeout_s=900.0)
        loras = f",max_loras={opts.max_loras}" if lora else ""
        return child, f"{url},kind=vllm,id={iid},role={role}{loras}"
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
    return Child(name, "engine", tuple(sim), ready, entry, env), f"{url},kind=sim"


def engine_roles(policy: str, n: int) -> list[str]:
    """The role of each engine, in start order: what the policy wants of an n-instance
    cluster (prefill and decode pools for the disaggregated ones, else all both)."""
    name, params = parse_spec(policy)
    return [role.value for role in POLICIES[name].roles(n, params)]


def child_env(child: Child, base: dict[str, str]) -> dict[str, str]:
    """The environment a child starts with."""
    env = etcd_env() if child.clean_env else dict(base)
    env.update(child.env)
    return env
