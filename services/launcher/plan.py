"""What `kvsched up` starts (`ClusterPlan`): which processes, in which stages, on which
loopback ports, with which ids and certificates, and how each is seen ready, decided up front
from the options (pure: no process is started here). Each process's command line is
`service_commands`'."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.security.identity import Identity, Role
from services.common.security.tls import ClientTls
from services.launcher.cluster_options import ClusterOptions, engine_roles
from services.launcher.credentials import ETCD, ClusterCredentials
from services.launcher.etcd_local import etcd_argv, etcd_env
from services.launcher.ports import Ports
from services.launcher.service_commands import (
    TlsFlags,
    conductor_argv,
    engine_command,
    messenger_argv,
    router_argv,
)

READY_TIMEOUT_S = 60.0  # for a process to serve, unless its Child says otherwise
VLLM_READY_TIMEOUT_S = 900.0  # a vLLM server takes minutes to start on a CPU

# Start order; stopping goes the other way, so nothing loses what it depends on first.
STAGES = ("etcd", "conductor", "engine", "messenger", "router")


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


def plan_cluster(opts: ClusterOptions, run_dir: Path, api_keys: Path, api_key: str) -> ClusterPlan:
    """Ports, ids and flags for every process; `api_keys` is the Routers' key file. Unless
    `opts.insecure`, every process gets its certificate (`ClusterCredentials`, minted when
    the supervisor starts the cluster) and serves and calls mutual TLS."""
    free_port = Ports()
    children: list[Child] = []
    creds = None if opts.insecure else ClusterCredentials.for_run(run_dir, identities(opts))
    tls = TlsFlags(creds)

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

    conductor_urls = []
    for i in range(opts.conductors):
        port, http_port = free_port(), free_port()
        url, http_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        conductor_urls.append(url)
        me = Identity(Role.CONDUCTOR, f"conductor-{i}")
        etcd_env_vars = {"KVSCHED_ETCD_ENDPOINTS": etcd_url}
        if creds is not None:
            etcd_env_vars.update(creds.etcd_env(me))
        argv = conductor_argv(
            opts, tls, me, listen=url, http_listen=http_url.removeprefix("http://")
        )
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
        argv = messenger_argv(
            opts,
            tls,
            node,
            listen=url,
            http_listen=f"127.0.0.1:{http_port}",
            conductors=conductors,
            engines=engines,
            pool_socket=socket,
        )
        ready = f"http://127.0.0.1:{http_port}/ready"
        entry = {"url": url, "node": node, "http_url": f"http://127.0.0.1:{http_port}"}
        children.append(Child(f"messenger-{node}", "messenger", tuple(argv), ready, entry))

    for r in range(opts.routers):
        port, grpc_port = free_port(), free_port()
        url = f"http://127.0.0.1:{port}"
        me = Identity(Role.ROUTER, f"router-{r}")
        argv = router_argv(
            opts,
            tls,
            me,
            listen=f"127.0.0.1:{port}",
            grpc_listen=f"127.0.0.1:{grpc_port}",
            conductors=conductors,
            api_keys=api_keys,
        )
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
    server), and its Messenger's `--engine` value."""
    ports = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{ports[0]}"
    entry = {"id": iid, "url": url, "node": node, "model": model[0]}
    command = engine_command(
        opts,
        iid=iid,
        model=model,
        role=role,
        ports=ports,
        core=core,
        pool_socket=pool_socket,
        lora=lora,
        embedding=embedding,
    )
    timeout = VLLM_READY_TIMEOUT_S if opts.engine == "vllm" else READY_TIMEOUT_S
    child = Child(
        f"engine-{iid}",
        "engine",
        command.argv,
        f"{url}/health",
        entry,
        command.env,
        ready_timeout_s=timeout,
    )
    return child, command.engine_flag


def child_env(child: Child, base: dict[str, str]) -> dict[str, str]:
    """The environment a child starts with."""
    env = etcd_env() if child.clean_env else dict(base)
    env.update(child.env)
    return env
